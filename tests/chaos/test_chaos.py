"""Chaos: real coordinator and worker processes over a real nats-server, killed, stopped
and restarted mid-run. Each run must still finish, with every sample of every epoch in the
consensus exactly once (the dead incarnation's lost batches excluded, as the coordinator's
`work-reassigned` record names them), accuracy >= 95 % and identical surviving replicas.

Each scenario runs once by default; DDPBUS_CHAOS_REPEAT=N repeats it N times.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from jobs import Job, spec, start_job
from safetensors.torch import load_file

from ddpbus.orchestrator.broker import BrokerConfig, EmbeddedBroker
from ddpbus.worker_agent.data import epoch_permutation

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

N_TRAIN, BATCH, SEED, EPOCHS = 1438, 32, 42, 30
REPEAT = range(int(os.environ.get("DDPBUS_CHAOS_REPEAT", "1")))


def wait_for(what: str, cond: Callable[[], bool], timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)  # poll interval of a deadline-bound wait


def lines(ledger: Path, rank: int) -> list[tuple[int, int, int]]:
    path = ledger / f"rank-{rank}.txt"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3:  # a killed process may leave half a line
            out.append((int(parts[0]), int(parts[1]), int(parts[2])))
    return out


def trained_epochs(ledger: Path, rank: int) -> int:
    return len({e for e, _, _ in lines(ledger, rank)})


def finish(job: Job, *, failed: dict[str, int | None]) -> list[dict[str, Any]]:
    """Every process ends; the named ones with the given code (None: any), others with 0."""
    for name, p in job.procs.items():
        try:
            p.wait(180)
        except subprocess.TimeoutExpired:
            job.kill()
            raise AssertionError(f"{name} still running\n{job.dump()}") from None
    for name, p in job.procs.items():
        want = failed.get(name, 0)
        if name in failed and want is None:
            continue
        assert p.returncode == want, f"{name} exited {p.returncode}\n{job.dump()}"
    return job.events()


def exactly_once(job: Job, ledger: Path, events: list[dict[str, Any]],
                 dead_pids: dict[int, int]) -> None:
    """Survivors' batches plus each dead incarnation's kept batches cover each epoch once."""
    lost: dict[int, set[tuple[int, int]]] = {}
    for e in events:
        if e["event"] == "work-reassigned":
            for epoch, offset, size in e["ranges"]:
                perm = epoch_permutation(N_TRAIN, SEED, epoch)
                idx = perm[offset * BATCH:(offset + size) * BATCH].tolist()
                lost.setdefault(e["rank"], set()).update((epoch, i) for i in idx)
    counted: Counter[tuple[int, int]] = Counter()
    for rank in range(job.workers):
        for epoch, index, pid in lines(ledger, rank):
            if dead_pids.get(rank) == pid and (epoch, index) in lost.get(rank, set()):
                continue  # trained by the dead incarnation, never averaged: lost, redone
            counted[(epoch, index)] += 1
    per_epoch = (N_TRAIN // BATCH) * BATCH
    for epoch in range(EPOCHS):
        expected = set(epoch_permutation(N_TRAIN, SEED, epoch)[:per_epoch].tolist())
        got = {i for (e, i) in counted if e == epoch}
        assert got == expected, f"epoch {epoch}: {len(expected ^ got)} samples differ"
    twice = [k for k, n in counted.items() if n > 1]
    assert not twice, f"{len(twice)} samples in the consensus twice, e.g. {twice[:3]}"


def same_replicas(out: Path, ranks: list[int]) -> None:
    states = [load_file(str(out / f"rank{r}.final.safetensors")) for r in ranks]
    for other in states[1:]:
        for k in states[0]:
            assert torch.equal(states[0][k], other[k]), f"replicas differ at {k}"


def recovered(job: Job, ledger: Path, events: list[dict[str, Any]],
              dead_pids: dict[int, int], survivors: list[int]) -> dict[str, Any]:
    """The run ended well: summary ok, accuracy, coverage exactly once, equal replicas."""
    summary = job.wait_summary()
    assert summary["ok"], summary
    assert summary["test_accuracy"] >= 0.95
    exactly_once(job, ledger, events, dead_pids)
    same_replicas(job.out, survivors)
    return summary


def of(events: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == name]


_STARTED: list[Job] = []


@pytest.fixture(autouse=True)
def _no_leftovers() -> Iterator[None]:
    """A failed scenario must not leave its processes to disturb the next one."""
    yield
    while _STARTED:
        _STARTED.pop().kill()


def run_job(broker: EmbeddedBroker, tmp: Path, workers: int, name: str,
            worker_args: dict[int, list[str]] | None = None) -> tuple[Job, Path]:
    ledger = tmp / "ledger"
    ledger.mkdir(parents=True)
    job = start_job(broker.url, tmp, spec("chaos"), workers=workers, job=name,
                    coordinator_args=["--policy", "cadence"], worker_args=worker_args,
                    env={"LEDGER_DIR": str(ledger), "CHAOS_EPOCHS": str(EPOCHS)})
    _STARTED.append(job)
    return job, ledger


@pytest.mark.parametrize("attempt", REPEAT)
def test_sigkill_one_of_three_the_survivors_finish(broker: EmbeddedBroker, tmp_path: Path,
                                                   attempt: int) -> None:
    job, ledger = run_job(broker, tmp_path, 3, f"kill3-{attempt}")
    wait_for("rank 1 to train 5 epochs", lambda: trained_epochs(ledger, 1) >= 5)
    victim = job.procs["rank-1"]
    victim.send_signal(signal.SIGKILL)
    events = finish(job, failed={"rank-1": -signal.SIGKILL})
    [dead] = of(events, "rank-dead")
    assert dead["rank"] == 1
    assert dead["alive"] == [0, 2]
    assert of(events, "work-reassigned")
    assert [e["members"] for e in of(events, "session-formed")] == [[0, 1, 2], [0, 2]]
    recovered(job, ledger, events, {1: victim.pid}, [0, 2])


@pytest.mark.parametrize("attempt", REPEAT)
def test_a_killed_worker_restarted_grows_back(broker: EmbeddedBroker, tmp_path: Path,
                                              attempt: int) -> None:
    # rank 0 is slowed down (simulated) so that the run outlasts a process start
    job, ledger = run_job(broker, tmp_path, 2, f"grow-{attempt}",
                          worker_args={0: ["--slowdown", "6"]})
    wait_for("rank 1 to train 4 epochs", lambda: trained_epochs(ledger, 1) >= 4)
    victim = job.procs["rank-1"]
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    reborn = job.respawn("rank-1", "rank-1b")  # like a pod restart: at once, same command
    events = finish(job, failed={"rank-1": -signal.SIGKILL})
    [dead] = of(events, "rank-dead")
    assert dead["rank"] == 1
    [back] = of(events, "rank-rejoined")
    assert back["rank"] == 1
    assert back["generation"] == 2
    assert [len(e["members"]) for e in of(events, "session-formed")][-1] == 2
    assert any(pid == reborn.pid for _, _, pid in lines(ledger, 1)), "it never trained again"
    assert "rejoin sent" in job.log("rank-1b")
    recovered(job, ledger, events, {1: victim.pid}, [0, 1])


@pytest.mark.parametrize("attempt", REPEAT)
def test_a_stopped_worker_is_fenced_when_it_wakes(broker: EmbeddedBroker, tmp_path: Path,
                                                  attempt: int) -> None:
    job, ledger = run_job(broker, tmp_path, 3, f"stop-{attempt}")
    wait_for("rank 2 to train 4 epochs", lambda: trained_epochs(ledger, 2) >= 4)
    sleeper = job.procs["rank-2"]
    sleeper.send_signal(signal.SIGSTOP)
    try:
        wait_for("the death", lambda: bool(of(job.events(), "rank-dead")))
    finally:
        sleeper.send_signal(signal.SIGCONT)
    events = finish(job, failed={"rank-2": 1})
    [dead] = of(events, "rank-dead")
    assert dead["rank"] == 2
    assert "silent" in dead["why"]
    assert "declared this rank dead" in job.log("rank-2")
    recovered(job, ledger, events, {2: sleeper.pid}, [0, 1])


@pytest.mark.parametrize("attempt", REPEAT)
def test_a_killed_coordinator_restarted_resumes_from_its_snapshot(
        broker: EmbeddedBroker, tmp_path: Path, attempt: int) -> None:
    job, ledger = run_job(broker, tmp_path, 2, f"coord-{attempt}",
                          worker_args={0: ["--slowdown", "3"], 1: ["--slowdown", "3"]})
    wait_for("rank 0 to train 4 epochs", lambda: trained_epochs(ledger, 0) >= 4)
    first = job.procs["coordinator"]
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    # the workers train on inside their window while the new process starts (seconds)
    job.respawn("coordinator", "coordinator-2")
    events = finish(job, failed={"coordinator": -signal.SIGKILL})
    [resumed] = of(events, "coordinator-resumed")
    assert resumed["generation"] == resumed["from_generation"] + 1
    assert not of(events, "rank-dead")  # nobody was lost while it was away
    summary = recovered(job, ledger, events, {}, [0, 1])
    assert summary["resumed_from_seq"] == resumed["stream_seq"]
    assert "took over" in job.log("rank-0")


@pytest.mark.parametrize("attempt", REPEAT)
def test_a_standby_takes_over_and_the_stopped_leader_is_deposed(
        broker: EmbeddedBroker, tmp_path: Path, attempt: int) -> None:
    job, ledger = run_job(broker, tmp_path, 2, f"standby-{attempt}",
                          worker_args={0: ["--slowdown", "3"], 1: ["--slowdown", "3"]})
    wait_for("the leader's lease", lambda: "holding the coordinator lease" in
             job.log("coordinator"))
    standby = job.spawn("standby", [*job.argv["coordinator"], "--standby",
                                    "--lease-ttl", "2"])
    wait_for("rank 0 to train 4 epochs", lambda: trained_epochs(ledger, 0) >= 4)
    leader = job.procs["coordinator"]
    leader.send_signal(signal.SIGSTOP)
    try:
        wait_for("the standby to resume", lambda: "resuming job" in job.log("standby"))
    finally:
        leader.send_signal(signal.SIGCONT)
    events = finish(job, failed={"coordinator": 3})  # deposed: it exits without a word
    assert "deposed" in job.log("coordinator")
    assert standby.returncode == 0
    assert of(events, "coordinator-resumed")
    recovered(job, ledger, events, {}, [0, 1])


@pytest.mark.parametrize("attempt", REPEAT)
def test_the_broker_restarted_on_its_store_loses_nothing(broker: EmbeddedBroker,
                                                         tmp_path: Path, attempt: int) -> None:
    rng = random.Random(f"broker-{attempt}-{time.time_ns()}")
    seed = rng.randrange(2**32)
    rng.seed(seed)
    outage_s = rng.uniform(0.5, 4.0)  # up to twice the heartbeat timeout: silence, no death
    print(f"broker restart: seed {seed}, outage {outage_s:.2f}s")
    job, ledger = run_job(broker, tmp_path, 2, f"broker-{attempt}",
                          worker_args={0: ["--slowdown", "3"], 1: ["--slowdown", "3"]})
    wait_for("rank 0 to train 4 epochs", lambda: trained_epochs(ledger, 0) >= 4)
    port, store = broker.port, broker.store_dir
    broker.stop()
    time.sleep(outage_s)  # the outage itself is the scenario, not a wait for a condition
    again = EmbeddedBroker(BrokerConfig(port=port, store_dir=store))
    again.start()
    try:
        events = finish(job, failed={})
        assert not of(events, "rank-dead"), f"seed {seed}: a rank was declared dead"
        assert of(events, "bus-restored"), "the coordinator never noticed the outage"
        recovered(job, ledger, events, {}, [0, 1])
        assert "reconnected to NATS" in job.log("rank-0")
    finally:
        again.stop()
