"""bench/codec.py runs (quick mode) and reports every case and both targets; bench/scale.py
gives the coordinator a CPU of its own when asked, and refuses one it cannot have."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_scale_bench_pins_the_coordinator(tmp_path: Path) -> None:
    core = max(os.sched_getaffinity(0))
    out = tmp_path / "scale.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "scale.py"), "--ranks", "8",
                    "--seconds", "2", "--no-replay", "--coordinator-core", str(core),
                    "--json", str(out)], check=True, capture_output=True, timeout=300)
    report = json.loads(out.read_text())
    assert report["coordinator_core"] == core
    (row,) = report["rows"]
    assert row["ok"]
    assert row["rounds"] > 0
    assert row["coordinator_cpus"] == [core]
    assert row["simulator_cpus"]
    assert core not in row["simulator_cpus"]


def test_scale_bench_refuses_a_cpu_it_cannot_have() -> None:
    bad = max(os.sched_getaffinity(0)) + 1
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "scale.py"),
                           "--coordinator-core", str(bad)], check=False, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert f"--coordinator-core {bad}: needs one of the CPUs" in done.stderr
