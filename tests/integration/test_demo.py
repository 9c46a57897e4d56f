"""`make demo`'s script runs end to end against its own embedded broker."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wire_tour_runs_and_refuses_bad_messages() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "wire_tour.py")],
                         capture_output=True, text=True, timeout=120, check=True)
    assert "rank-0      got ControlMsg.StartEpoch" in out.stdout
    assert "coordinator got TimingMsg.Batch" in out.stdout
    assert "forged message refused: bad-signature" in out.stdout
    assert "stale message refused: stale-generation" in out.stdout
