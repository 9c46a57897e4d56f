"""The atheris harness, briefly: a few thousand libFuzzer runs over every target, no crash.

The full campaign (``make fuzz``) runs it for 100k inputs per target; here it only has to
start, reach each target from its seed corpus and exit cleanly (a crash exits non-zero and
leaves the input under ``tmp_path``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris")

HARNESS = Path(__file__).with_name("atheris_decoders.py")
RUNS = 4000
TARGETS = {"ControlMsg", "TimingMsg", "MetricsMsg", "JoinMsg", "AdmitMsg", "TensorFrame",
           "TensorBlob", "Snapshot", "BundleManifest", "Lease"}


def test_a_short_libfuzzer_session_over_every_target_finds_no_crash(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, str(HARNESS), f"-atheris_runs={RUNS}", "-seed=1",
         f"-report={report}", f"-artifact_prefix={tmp_path}/"],
        capture_output=True, text=True, timeout=100, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"Done {RUNS} " in proc.stderr
    runs = json.loads(report.read_text())["atheris"]
    assert set(runs) == TARGETS
    # every input but libFuzzer's first, the empty one, which picks no target
    assert sum(r["runs"] for r in runs.values()) == RUNS - 1
    # each family's payloads reach the parser: some decode, some are refused for content
    for family in ("ControlMsg", "TimingMsg", "JoinMsg", "AdmitMsg"):
        assert runs[family]["outcomes"].get("accepted"), runs[family]
        assert runs[family]["outcomes"].get("malformed"), runs[family]
