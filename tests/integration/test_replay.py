"""`ddpbus replay` of a recorded run with a death and a rejoin."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from jobs import chaos_job, kill_and_restart

from ddpbus.orchestrator.runtime.nats_server import EmbeddedBroker

pytestmark = pytest.mark.timeout(240)
CLI = [sys.executable, "-m", "ddpbus.orchestrator.tools.cli", "replay"]


def replay(url: str, key_file: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPBUS_")}
    return subprocess.run([*CLI, "--job", "told", "--nats", url, "--key-file", str(key_file),
                           *args], capture_output=True, text=True, timeout=120, env=env,
                          check=False)


def test_replay_tells_a_run_with_a_death_and_a_rejoin(broker: EmbeddedBroker,
                                                      tmp_path: Path) -> None:
    job, ledger = chaos_job(broker.url, tmp_path, "told", epochs=16, slowdown=6)  # lasts
    try:
        kill_and_restart(job, ledger, 1, after_epochs=1)  # a death and a rejoin
    finally:
        job.kill()
    summary = job.wait_summary()
    assert summary["ok"], summary
    out = replay(broker.url, tmp_path / "job.key")
    assert out.returncode == 0, out.stderr
    lines = [line.strip().split("  ", 1)[1] for line in out.stdout.splitlines() if "  " in line]
    told = "\n".join(lines)
    for needle in ("rank 0 joined (generation 1", "rank 1 admitted (world size 2)",
                   "first session: world size 2", "rank 1 declared dead",
                   "new session: world size 1", "rank 1 came back (generation 2",
                   "epoch 15 done: loss", "eval after epoch 15:", "bundle v16 asked of rank",
                   "rank 0 exited", f"run complete after {summary['rounds']} averages"):
        assert needle in told, f"{needle!r} missing from\n{out.stdout}"
    order = [next(i for i, x in enumerate(lines) if x.startswith(needle)) for needle in (
        "first session", "rank 1 declared dead", "rank 1 came back", "run complete")]
    assert order == sorted(order), out.stdout
    averages = [x for x in lines if x.startswith("average #")]
    assert len(averages) == summary["rounds"]
    paced = replay(broker.url, tmp_path / "job.key", "--speed", "1000")
    assert paced.returncode == 0, paced.stderr
    assert paced.stdout == out.stdout
