"""`ddpbus simulate` drives a real coordinator like a cluster: simulated ranks over a real
nats-server, speaking the protocol the workers speak, without training."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from jobs import KEY, ROOT, Job

from ddpbus.orchestrator.broker import EmbeddedBroker
from ddpbus.orchestrator.simulate import speeds

SPEC = f"{ROOT / 'bench' / 'specs' / 'simulated.py'}:spec"

pytestmark = pytest.mark.timeout(240)


def _simulated_job(url: str, tmp: Path, ranks: int, *, rate: float, speed: str,
                   epochs: int) -> Job:
    tmp.mkdir(parents=True, exist_ok=True)
    key_file = tmp / "job.key"
    key_file.write_bytes(KEY)
    common = ["--job", "sim", "--nats", url, "--key-file", str(key_file)]
    job = Job("sim", url, tmp, ranks)
    job.environ = {k: v for k, v in os.environ.items() if not k.startswith("DDPBUS_")}
    job.environ["SIM_EPOCHS"] = str(epochs)
    job.spawn("coordinator", ["coordinator", *common, "--world-size", str(ranks),
                              "--backend", "gloo", "--summary", str(tmp / "summary.json"),
                              "--events", str(tmp / "events.jsonl"), SPEC])
    job.spawn("simulate", ["simulate", *common, "--ranks", str(ranks), "--rate", str(rate),
                           "--speeds", speed])
    return job


def test_simulated_ranks_train_a_run_to_its_end(broker: EmbeddedBroker, tmp_path: Path
                                                ) -> None:
    ranks = 24
    job = _simulated_job(broker.url, tmp_path, ranks, rate=40.0, speed="slow:0.25,3",
                         epochs=2)
    try:
        summary = job.wait(200)
    finally:
        job.kill()
    assert summary["ok"], summary
    assert summary["epochs"] == 2
    assert summary["rounds"] >= 2
    assert summary["coverage"]["exact"]  # every sample of every epoch, once
    share = {int(r): v for r, v in summary["batch_share"].items()}
    assert set(share) == set(range(ranks))
    slow = range(round(ranks * 0.25))  # ranks 0-5 run 3x slower
    fast = range(len(slow), ranks)
    # cadence: El Che hands the fast ranks more batches than the slow ones
    assert min(share[r] for r in fast) > max(share[r] for r in slow), share
    assert summary["decode_rejections"] == {}
    # every stream message's intake was timed, and every decision that published commands
    assert summary["intake_latency_ms"]["count"] == summary["messages_handled"] > 0
    decisions = summary["decision_latency_ms"]
    assert 0 < decisions["count"] < summary["messages_handled"]
    assert 0 <= decisions["p50"] <= decisions["p99"] <= decisions["max"]
    assert summary["replay_s"] is None  # a fresh job: nothing was replayed


@pytest.mark.parametrize(("spec", "message"), [
    ("uniform:2,1", "one of equal"), ("lognormal:x", "must be numbers"), ("zipf:1", "one of"),
    ("slow:0,2", "one of"),
])
def test_bad_speed_distributions_are_refused(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        speeds(spec, 8, 0)


def test_speed_distributions() -> None:
    assert speeds("equal", 3, 0) == [1.0, 1.0, 1.0]
    assert speeds("slow:0.25,4", 8, 0) == [0.25, 0.25] + [1.0] * 6
    drawn = speeds("uniform:0.5,1.5", 1000, 1)
    assert all(0.5 <= s <= 1.5 for s in drawn)
    assert speeds("lognormal:0.3", 50, 7) == speeds("lognormal:0.3", 50, 7)  # seeded
