"""`ddpbus simulate` drives a real coordinator like a cluster: simulated ranks over a real
nats-server, speaking the protocol the workers speak, without training."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from jobs import KEY, ROOT, Job, wait_for

from ddpbus.codecs import subjects as sj
from ddpbus.codecs.errors import ConfigError
from ddpbus.orchestrator.runtime.nats_server import EmbeddedBroker
from ddpbus.orchestrator.tools.simulate import SimulatedCohort, speeds
from ddpbus.orchestrator.transport.bus import connect

SPEC = f"{ROOT / 'bench' / 'specs' / 'simulated.py'}:spec"

pytestmark = pytest.mark.timeout(240)


def _simulated_job(url: str, tmp: Path, ranks: int, *, rate: float, speed: str,
                   epochs: int, intake: str = "durable",
                   coordinator_args: tuple[str, ...] = (),
                   simulate_args: tuple[str, ...] = ()) -> Job:
    tmp.mkdir(parents=True, exist_ok=True)
    key_file = tmp / "job.key"
    key_file.write_bytes(KEY)
    common = ["--job", "sim", "--nats", url, "--key-file", str(key_file)]
    job = Job("sim", url, tmp, ranks)
    job.environ = {k: v for k, v in os.environ.items() if not k.startswith("DDPBUS_")}
    job.environ["SIM_EPOCHS"] = str(epochs)
    job.spawn("coordinator", ["coordinator", *common, "--world-size", str(ranks),
                              "--backend", "gloo", "--summary", str(tmp / "summary.json"),
                              "--events", str(tmp / "events.jsonl"), *coordinator_args,
                              SPEC])
    job.spawn("simulate", ["simulate", *common, "--ranks", str(ranks), "--rate", str(rate),
                           "--speeds", speed, "--intake", intake, *simulate_args])
    return job


def _to_the_end(job: Job, epochs: int = 2) -> dict[str, Any]:
    """The job run to its end, every process stopped; its summary, checked ok."""
    try:
        summary = job.wait(200)
    finally:
        job.kill()
    assert summary["ok"], summary
    assert summary["epochs"] == epochs
    return summary


@pytest.mark.parametrize("intake", ["durable", pytest.param("core", marks=pytest.mark.slow)])
def test_simulated_ranks_train_a_run_to_its_end(broker: EmbeddedBroker, tmp_path: Path,
                                                intake: str) -> None:
    """Each rank reading its own durable (as a worker does), or all through one core
    subscription (the lightest, for the largest loads)."""
    ranks = 24
    job = _simulated_job(broker.url, tmp_path, ranks, rate=40.0, speed="slow:0.25,3",
                         epochs=2, intake=intake)
    summary = _to_the_end(job)
    assert summary["rounds"] >= 2
    assert summary["coverage"]["exact"]  # every sample of every epoch, once
    share = {int(r): v for r, v in summary["batch_share"].items()}
    assert set(share) == set(range(ranks))
    slow = range(round(ranks * 0.25))  # ranks 0-5 run 3x slower
    fast = range(len(slow), ranks)
    # cadence: El Che hands the fast ranks more batches than the slow ones
    assert min(share[r] for r in fast) > max(share[r] for r in slow), share
    assert summary["decode_rejections"] == {}
    # the ranks' stream ids are dense: their beacons (core NATS, one a second) count apart
    # and leave no gap for deduplication to remember (it held ~1 a rank a second)
    assert summary["unseen_ids"] == 0
    # every stream message's intake was timed, and every decision that published commands
    assert summary["intake_latency_ms"]["count"] == summary["messages_handled"] > 0
    decisions = summary["decision_latency_ms"]
    assert 0 < decisions["count"] < summary["messages_handled"]
    assert 0 <= decisions["p50"] <= decisions["p99"] <= decisions["max"]
    assert summary["replay_s"] is None  # a fresh job: nothing was replayed
    # both processes made full collections at their quiet moments (collector.py)
    assert summary["collector"]["passes"] >= 1
    made = re.search(r"full collections, after the SyncAcks: \{'passes': (\d+)",
                     job.log("simulate"))
    assert made is not None
    assert int(made.group(1)) >= 1


def test_ranks_that_die_together_are_one_membership_change(broker: EmbeddedBroker,
                                                           tmp_path: Path) -> None:
    """Half of 64 simulated ranks lose power at once (`--kill 32@1`): their last beats
    landed up to a second apart, yet the coordinator process declares all 32 in one tick,
    forms one new communicator over the 32 survivors, hands them the lost work, and the
    run ends with every sample of every epoch trained once."""
    ranks, dead = 64, 32
    job = _simulated_job(broker.url, tmp_path, ranks, rate=40.0, speed="equal", epochs=2,
                         intake="core", coordinator_args=("--knob", "heartbeat_timeout=5"),
                         simulate_args=("--kill", f"{dead}@1", "--dataset-size",
                                        str(ranks * 8 * 40)))
    summary = _to_the_end(job)
    assert summary["coverage"]["exact"]
    events = job.events()
    at = [i for i, e in enumerate(events) if e["event"] == "rank-dead"]
    deaths = [events[i] for i in at]
    assert sorted(e["rank"] for e in deaths) == list(range(ranks - dead, ranks))
    # one membership change: all 32 declared in one transition, nothing between them
    assert at == list(range(at[0], at[0] + dead))
    assert deaths[-1]["alive"] == list(range(ranks - dead))
    requested = [e for e in events if e["event"] == "session-requested"]
    assert len(requested) == 2  # the first communicator, and one rebuild
    sessions = [e for e in events if e["event"] == "session-formed"]
    assert [len(e["members"]) for e in sessions] == [ranks, ranks - dead]
    assert sessions[-1]["members"] == list(range(ranks - dead))


@pytest.mark.parametrize("flag", ["32", "x@1", "0@1", "3@-1", "3@inf"])
def test_bad_kill_flags_are_refused(flag: str, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "ddpbus.orchestrator.tools.cli", "simulate",
                           "--job", "sim", "--nats", "nats://127.0.0.1:1", "--ranks", "8",
                           "--kill", flag], check=False, capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert done.returncode == 2
    assert "COUNT@SECONDS" in done.stderr


def test_a_kill_needs_a_survivor() -> None:
    with pytest.raises(ConfigError, match="one must survive"):
        SimulatedCohort(None, "sim", KEY, 8, kill=(8, 1.0))  # type: ignore[arg-type]


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


class StreamSampler:
    """The job stream's size, sampled every 0.2 s from a thread of its own until stopped."""

    def __init__(self, url: str, job: str) -> None:
        self.url, self.stream = url, sj.stream_name(job)
        self.samples: list[tuple[int, int, int, int]] = []  # messages, bytes, first, last
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        nc = await connect(self.url, name="stream-sampler")
        js = nc.jetstream()
        try:
            while True:
                with contextlib.suppress(Exception):  # not created yet
                    st = (await js.stream_info(self.stream)).state
                    self.samples.append((st.messages, st.bytes, st.first_seq, st.last_seq))
                # the sampling interval, cut short by the stop
                if await asyncio.to_thread(self._stop.wait, 0.2):
                    return
        finally:
            await nc.close()

    def __enter__(self) -> StreamSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.mark.slow  # a soak: test-all
def test_a_long_run_stays_inside_its_limits_and_a_restarted_coordinator_resumes(
        broker: EmbeddedBroker, tmp_path: Path) -> None:
    """Retention (subjects.md): compacting every second with no history kept, the stream
    holds a few seconds of traffic however long the run; the coordinator killed mid-run
    resumes from its snapshot although the telemetry below it is gone, and every sample
    of every epoch is still trained exactly once."""
    ranks, rate, every = 12, 40.0, 1.0
    max_bytes = 64 * 1024 * 1024
    with StreamSampler(broker.url, "sim") as sampler:
        job = _simulated_job(broker.url, tmp_path, ranks, rate=rate, speed="equal",
                             epochs=8, coordinator_args=(
                                 "--compact-every", str(every), "--keep-history", "0",
                                 "--stream-max-bytes", str(max_bytes)))
        try:
            # well into the run, after compaction has purged: first_seq moved on
            wait_for("the stream to be compacted", lambda: bool(sampler.samples) and (
                sampler.samples[-1][2] > 2000), timeout=120)
            first = job.procs.pop("coordinator")
            first.send_signal(signal.SIGKILL)
            first.wait(10)
            job.respawn("coordinator", "coordinator-2")
            summary = job.wait(200)
        finally:
            job.kill()
    assert summary["ok"], summary
    assert summary["coverage"]["exact"]  # every sample of every epoch, once
    assert summary["resumed_from_seq"] is not None
    assert "caught up with the stream" in job.log("coordinator-2")
    # the second coordinator purged every class too
    purged = summary["retention"]["purged"]
    assert {"telemetry", "rank", "broadcast"} <= set(purged), summary["retention"]
    assert summary["retention"]["max_bytes"] == max_bytes
    total = sampler.samples[-1][3]
    peak_msgs = max(s[0] for s in sampler.samples)
    peak_bytes = max(s[1] for s in sampler.samples)
    # the sizing rule: messages per rank-second x ranks x (interval + slack for the
    # snapshot, the acks and a pass); a coordinator away for a restart holds it back too
    bound = ranks * rate * 1.5 * (every + 8.0)
    assert peak_msgs <= bound, (peak_msgs, bound, total)
    assert total >= 3 * peak_msgs, (total, peak_msgs)  # most of the run is gone
    assert peak_bytes < max_bytes
