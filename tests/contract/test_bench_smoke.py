"""bench/codec.py runs (quick mode) and reports every case and both targets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_codec_bench_quick(tmp_path: Path) -> None:
    out = tmp_path / "codec.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "codec.py"), "--quick", "--json",
                    str(out)], check=True, capture_output=True, timeout=120)
    report = json.loads(out.read_text())
    cases = {(r["group"], r["case"]) for r in report["results"]}
    assert ("TimingMsg.Batch", "payload codec protobuf") in cases
    assert ("ControlMsg.StartEpoch", "envelope JSON (HMAC)") in cases
    assert any(c.endswith("memcpy bytes(view) (baseline)") for _, c in cases)
    assert [t["is_target"] for t in report["targets"]] == [True, False, True, False]
    assert all(r["median"] > 0 for r in report["results"])
