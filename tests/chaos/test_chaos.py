"""Chaos: real coordinator and worker processes over a real nats-server, killed, stopped
and restarted mid-run. Each run must still finish, with every sample of every epoch in the
consensus exactly once (the dead incarnation's lost batches excluded, as the coordinator's
`work-reassigned` record names them), accuracy >= 95 % and identical surviving replicas.

Each scenario runs once by default; DDPTEST_CHAOS_REPEAT=N repeats it N times.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from faults import FAULTS, loops, scenario_rng
from jobs import Job, freeze, spec, start_job, wait_for
from safetensors.torch import load_file

from ddpbus.orchestrator.persist import bundles
from ddpbus.orchestrator.runtime.nats_server import BrokerConfig, EmbeddedBroker
from ddpbus.orchestrator.transport.bus import connect
from ddpbus.worker_agent.data import epoch_permutation

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

N_TRAIN, BATCH, SEED, EPOCHS = 1438, 32, 42, 30
COMPACT_HARD = ["--compact-every", "0.5", "--keep-history", "0"]
REPEAT = range(int(os.environ.get("DDPTEST_CHAOS_REPEAT", "1")))
# recovery scenarios run on the collective path; the full run repeats them on the broker
# backend (no communicator: a death or a restart never rebuilds one)
BACKENDS = ["gloo", *([pytest.param("broker", marks=pytest.mark.slow)]
                      if os.environ.get("DDPTEST_CHAOS_FULL") == "1" else [])]


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


_BASELINE: dict[str, float] = {}


def undisturbed_accuracy(tmp: Path) -> float:
    """Test accuracy of the same job with no fault (3 workers), once per session."""
    if "accuracy" not in _BASELINE:
        with EmbeddedBroker(BrokerConfig(store_dir=tmp / "store")) as b:
            job, _ = run_job(b, tmp, 3, "undisturbed")
            finish(job, failed={})
            _BASELINE["accuracy"] = float(job.wait_summary()["test_accuracy"])
    return _BASELINE["accuracy"]


def accuracy_bound(accuracy: float, baseline: float, context: str = "") -> None:
    """A recovered run's accuracy: at least 95 %, or within 1 pp of the undisturbed run.
    ``DDPTEST_ACCURACY_LOG=<file>`` appends each (test, accuracy, baseline) as a JSON line,
    for the spread behind this bound. Measured over one `make chaos-full` with random
    seeds (46 recovered runs, every scenario; undisturbed 0.9805 / 0.9861): 0.9749 / 0.9861
    / 0.9944 (min / median / max), the worst 0.0249 above its bound
    (bench/results/chaos-accuracy-20261207T124500Z.json)."""
    log = os.environ.get("DDPTEST_ACCURACY_LOG")
    if log:
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "?"),
                                "accuracy": accuracy, "baseline": baseline}) + "\n")
    assert accuracy >= min(0.95, baseline - 0.01), (
        f"{context}accuracy {accuracy:.4f}, undisturbed {baseline:.4f}")


def recovered(job: Job, ledger: Path, events: list[dict[str, Any]],
              dead_pids: dict[int, int], survivors: list[int]) -> dict[str, Any]:
    """The run ended well: summary ok, accuracy within 1 pp of an undisturbed run,
    coverage exactly once (by the workers' ledger and by the coordinator's), equal
    replicas."""
    summary = job.wait_summary()
    assert summary["ok"], summary
    baseline = undisturbed_accuracy(job.tmp.parent / "undisturbed")
    accuracy_bound(summary["test_accuracy"], baseline)
    assert summary["coverage"]["exact"], summary["coverage"]  # the coordinator's own proof
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
            worker_args: dict[int, list[str]] | None = None,
            coordinator_args: list[str] | None = None) -> tuple[Job, Path]:
    ledger = tmp / "ledger"
    ledger.mkdir(parents=True)
    job = start_job(broker.url, tmp, spec("chaos"), workers=workers, job=name,
                    coordinator_args=["--policy", "cadence", *(coordinator_args or [])],
                    worker_args=worker_args,
                    env={"LEDGER_DIR": str(ledger), "CHAOS_EPOCHS": str(EPOCHS)})
    _STARTED.append(job)
    return job, ledger


@pytest.mark.slow
@pytest.mark.parametrize("attempt", REPEAT)
def test_sigkill_one_of_three_the_survivors_finish(broker: EmbeddedBroker, tmp_path: Path,
                                                   attempt: int) -> None:
    job, ledger = run_job(broker, tmp_path, 3, f"kill3-{attempt}")
    wait_for("rank 1 to train 5 epochs", lambda: trained_epochs(ledger, 1) >= 5)
    victim = job.procs["rank-1"]
    victim.send_signal(signal.SIGKILL)
    FAULTS["worker SIGKILL"] += 1
    events = finish(job, failed={"rank-1": -signal.SIGKILL})
    [dead] = of(events, "rank-dead")
    assert dead["rank"] == 1
    assert dead["alive"] == [0, 2]
    assert of(events, "work-reassigned")
    assert [e["members"] for e in of(events, "session-formed")] == [[0, 1, 2], [0, 2]]
    recovered(job, ledger, events, {1: victim.pid}, [0, 2])


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("attempt", REPEAT)
def test_a_killed_worker_restarted_grows_back(broker: EmbeddedBroker, tmp_path: Path,
                                              attempt: int, backend: str) -> None:
    # rank 0 is slowed down (simulated) so that the run outlasts a process start
    # on a stream compacted every half second with no history kept (subjects.md,
    # Retention): the reborn rank resumes from its durable's ack floor all the same
    job, ledger = run_job(broker, tmp_path, 2, f"grow-{backend}-{attempt}",
                          worker_args={0: ["--slowdown", "6"]},
                          coordinator_args=["--backend", backend, *COMPACT_HARD])
    wait_for("rank 1 to train 4 epochs", lambda: trained_epochs(ledger, 1) >= 4)
    victim = job.procs["rank-1"]
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    reborn = job.respawn("rank-1", "rank-1b")  # like a pod restart: at once, same command
    FAULTS["worker SIGKILL"] += 1
    FAULTS["worker restarted"] += 1
    events = finish(job, failed={"rank-1": -signal.SIGKILL})
    [dead] = of(events, "rank-dead")
    assert dead["rank"] == 1
    [back] = of(events, "rank-rejoined")
    assert back["rank"] == 1
    assert back["generation"] == 2
    if backend == "gloo":
        assert [len(e["members"]) for e in of(events, "session-formed")][-1] == 2
    else:
        assert len(of(events, "session-formed")) == 1  # nothing to rebuild
    assert any(pid == reborn.pid for _, _, pid in lines(ledger, 1)), "it never trained again"
    assert "rejoin sent" in job.log("rank-1b")
    summary = recovered(job, ledger, events, {1: victim.pid}, [0, 1])
    assert {"telemetry", "rank", "broadcast"} <= set(summary["retention"]["purged"])


@pytest.mark.slow
@pytest.mark.parametrize("attempt", REPEAT)
def test_a_worker_killed_mid_round_on_the_broker_backend(broker: EmbeddedBroker,
                                                         tmp_path: Path, attempt: int) -> None:
    """SIGKILL a rank while a broker round is in flight (RequestParams out, no Update yet):
    the round completes with the survivors' mass (or the dead rank's, if its snapshot made
    it), as soon as the death is known, not at the snapshot deadline; no communicator is
    rebuilt."""
    job, ledger = run_job(broker, tmp_path, 3, f"brk-kill-{attempt}", coordinator_args=[
        "--backend", "broker", "--knob", "snapshot_timeout=60"])
    wait_for("rank 1 to train 4 epochs", lambda: trained_epochs(ledger, 1) >= 4)
    seen = len(of(job.events(), "average"))

    def round_in_flight() -> bool:
        events = job.events()
        opened = of(events, "average")
        return len(opened) > seen and opened[-1]["round"] not in {
            e["round"] for e in of(events, "update")}

    wait_for("a round to open", round_in_flight)
    victim = job.procs["rank-1"]
    victim.send_signal(signal.SIGKILL)
    killed_in = of(job.events(), "average")[-1]["round"]
    FAULTS["worker SIGKILL"] += 1
    events = finish(job, failed={"rank-1": -signal.SIGKILL})
    [dead] = of(events, "rank-dead")
    assert dead["rank"] == 1
    [update] = [e for e in of(events, "update") if e["round"] == killed_in]
    assert update["realized"]
    assert update["accepted"] in ([0, 2], [0, 1, 2])  # the snapshot made it, or not
    FAULTS["broker round: snapshot " + ("kept" if 1 in update["accepted"] else "lost")] += 1
    assert not of(events, "snapshot-timeout")  # no stall until the deadline
    assert not of(events, "session-rebuild")
    assert [e["members"] for e in of(events, "session-formed")] == [[0, 1, 2]]
    recovered(job, ledger, events, {1: victim.pid}, [0, 2])


@pytest.mark.slow
@pytest.mark.parametrize("attempt", REPEAT)
def test_a_stopped_worker_is_fenced_when_it_wakes(broker: EmbeddedBroker, tmp_path: Path,
                                                  attempt: int) -> None:
    job, ledger = run_job(broker, tmp_path, 3, f"stop-{attempt}")
    wait_for("rank 2 to train 4 epochs", lambda: trained_epochs(ledger, 2) >= 4)
    sleeper = job.procs["rank-2"]
    freeze(sleeper.pid)  # every thread stopped before the clock of the death starts
    FAULTS["worker SIGSTOP"] += 1
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


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("attempt", REPEAT)
def test_a_killed_coordinator_restarted_resumes_from_its_snapshot(
        broker: EmbeddedBroker, tmp_path: Path, attempt: int, backend: str) -> None:
    # the telemetry below its journal is purged by then (compacted every half second); one
    # full snapshot at the start, journal segments after it: the takeover replays them
    job, ledger = run_job(broker, tmp_path, 2, f"coord-{backend}-{attempt}",
                          worker_args={0: ["--slowdown", "3"], 1: ["--slowdown", "3"]},
                          coordinator_args=["--backend", backend, "--snapshot-every", "3600",
                                            *COMPACT_HARD])
    wait_for("rank 0 to train 4 epochs", lambda: trained_epochs(ledger, 0) >= 4)
    first = job.procs["coordinator"]
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    FAULTS["coordinator SIGKILL mid-epoch"] += 1
    # the workers train on inside their window while the new process starts (seconds)
    job.respawn("coordinator", "coordinator-2")
    events = finish(job, failed={"coordinator": -signal.SIGKILL})
    [resumed] = of(events, "coordinator-resumed")
    assert resumed["generation"] == resumed["from_generation"] + 1
    assert resumed["journal_segments"] > 0
    assert resumed["journal_events"] > 0
    assert not of(events, "rank-dead")  # nobody was lost while it was away
    summary = recovered(job, ledger, events, {}, [0, 1])
    assert summary["resumed_from_seq"] == resumed["stream_seq"]
    assert summary["retention"]["purged"].get("telemetry", 0) > 0
    assert summary["replay_s"] is not None  # it caught up with the stream it was behind
    assert "caught up with the stream" in job.log("coordinator-2")
    assert "took over" in job.log("rank-0")


@pytest.mark.slow
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
    freeze(leader.pid)
    FAULTS["coordinator SIGSTOP (standby takes over)"] += 1
    try:
        wait_for("the standby to resume", lambda: "resuming job" in job.log("standby"))
    finally:
        leader.send_signal(signal.SIGCONT)
    events = finish(job, failed={"coordinator": 3})  # deposed: it exits without a word
    assert "deposed" in job.log("coordinator")
    assert standby.returncode == 0
    assert of(events, "coordinator-resumed")
    recovered(job, ledger, events, {}, [0, 1])


@pytest.mark.parametrize("attempt", loops(1, 5))
def test_the_broker_restarted_on_its_store_loses_nothing(broker: EmbeddedBroker,
                                                         tmp_path: Path, attempt: int) -> None:
    rng, seed = scenario_rng(f"broker-restart-{attempt}")
    after = rng.randint(2, 10)
    outage_s = rng.uniform(0.5, 4.0)  # up to twice the heartbeat timeout: silence, no death
    print(f"broker outage {outage_s:.2f}s after {after} epochs")
    # the coordinator reads the broker's disconnect advisories too: a restart (which
    # closes every connection) must not read as deaths there either
    system = broker.config.system_seed
    assert system is not None
    job, ledger = run_job(broker, tmp_path, 2, f"broker-{attempt}",
                          worker_args={0: ["--slowdown", "3"], 1: ["--slowdown", "3"]},
                          coordinator_args=["--nats-system-nkey", str(system)])
    wait_for(f"rank 0 to train {after} epochs", lambda: trained_epochs(ledger, 0) >= after)
    wait_for("the coordinator to read the broker's advisories",
             lambda: "reading the broker's client advisories" in job.log("coordinator"))
    port, store = broker.port, broker.store_dir
    broker.stop()
    FAULTS["broker restart"] += 1
    back_at = time.monotonic() + outage_s
    wait_for("every process to notice the outage, and the outage to last", lambda:
             time.monotonic() >= back_at and all("lost the NATS connection" in job.log(n)
                                                  for n in job.procs))
    again = EmbeddedBroker(BrokerConfig(port=port, store_dir=store, system_seed=system))
    again.start()
    try:
        events = finish(job, failed={})
        assert not of(events, "rank-dead"), f"seed {seed}: a rank was declared dead"
        assert of(events, "bus-restored"), "the coordinator never noticed the outage"
        recovered(job, ledger, events, {}, [0, 1])
        assert "reconnected to NATS" in job.log("rank-0")
    finally:
        again.stop()


class Tail:
    """The job's event records, read incrementally: cheap enough to poll every millisecond."""

    def __init__(self, path: Path) -> None:
        self.path, self.pos = path, 0
        self.events: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        if self.path.exists():
            with self.path.open("rb") as f:
                f.seek(self.pos)
                chunk = f.read()
            whole = chunk[:chunk.rfind(b"\n") + 1]
            self.pos += len(whole)
            self.events += [json.loads(line) for line in whole.splitlines()]
        return self.events

    def average_in_flight(self) -> int | None:
        """The round whose SyncNow is out and whose result has not come back, if any."""
        done = {e["round"] for e in self.poll() if e["event"] in ("averaged", "average-failed")}
        started = [e["round"] for e in self.events if e["event"] == "average"]
        return started[-1] if started and started[-1] not in done else None


# make test's worker smoke is the restarted variant (a kill and a rejoin); test-all adds
# the rank that stays dead
@pytest.mark.parametrize("restart", [pytest.param(False, id="stays-dead", marks=pytest.mark.slow),
                                     pytest.param(True, id="restarted")])
@pytest.mark.parametrize("attempt", loops(1, 10))
def test_sigkill_a_random_worker_at_a_random_moment(broker: EmbeddedBroker, tmp_path: Path,
                                                    attempt: int, restart: bool) -> None:
    rng, seed = scenario_rng(f"worker-kill-{restart}-{attempt}")
    # a restarted rank must find work left: an early kill and slower batches make the run
    # outlast the new process's start (Python + torch: up to ~5 s on a loaded 2-core box;
    # at slowdown 8 the 24 epochs left after a kill at epoch 6 took 5 s in one CI run)
    victim, after = rng.randrange(3), rng.randint(1, 6 if restart else 12)
    slow = {r: ["--slowdown", "16"] for r in range(3)} if restart else None
    job, ledger = run_job(broker, tmp_path, 3, f"rk{int(restart)}-{attempt}", worker_args=slow)
    wait_for(f"rank {victim} to train {after} epochs",
             lambda: trained_epochs(ledger, victim) >= after)
    at = len(lines(ledger, victim)) + rng.randint(0, 1000)  # a random sample of the epoch
    wait_for(f"rank {victim} to reach sample {at}", lambda: len(lines(ledger, victim)) >= at)
    proc = job.procs[f"rank-{victim}"]
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    FAULTS["worker SIGKILL"] += 1
    if restart:
        job.respawn(f"rank-{victim}", f"rank-{victim}b")
        FAULTS["worker restarted"] += 1
    events = finish(job, failed={f"rank-{victim}": -signal.SIGKILL})
    assert [d["rank"] for d in of(events, "rank-dead")] == [victim], f"seed {seed}"
    if restart:
        assert [e["rank"] for e in of(events, "rank-rejoined")] == [victim], f"seed {seed}"
    survivors = [0, 1, 2] if restart else [r for r in range(3) if r != victim]
    recovered(job, ledger, events, {victim: proc.pid}, survivors)


# make test's coordinator smoke is the kill mid-average; test-all adds mid-epoch
@pytest.mark.parametrize("moment", [pytest.param("mid-epoch", marks=pytest.mark.slow),
                                    "mid-average"])
@pytest.mark.parametrize("attempt", loops(1, 5))
def test_sigkill_the_coordinator_at_a_random_moment_and_restart_it(
        broker: EmbeddedBroker, tmp_path: Path, attempt: int, moment: str) -> None:
    rng, seed = scenario_rng(f"coordinator-kill-{moment}-{attempt}")
    after = rng.randint(2, 10)
    job, ledger = run_job(broker, tmp_path, 2, f"ck-{moment}-{attempt}",
                          worker_args={0: ["--slowdown", "3"], 1: ["--slowdown", "3"]})
    wait_for(f"rank 0 to train {after} epochs", lambda: trained_epochs(ledger, 0) >= after)
    first = job.procs["coordinator"]
    if moment == "mid-average":
        tail = Tail(job.tmp / "events.jsonl")
        deadline = time.monotonic() + 60
        while (in_flight := tail.average_in_flight()) is None:
            assert time.monotonic() < deadline, f"seed {seed}: never saw an average in flight"
            time.sleep(0.001)  # poll interval of a deadline-bound wait (a short round)
        print(f"killing the coordinator while round {in_flight} is in flight")
    else:
        at = len(lines(ledger, 0)) + rng.randint(0, 1000)  # a random sample of the epoch
        wait_for(f"rank 0 to reach sample {at}", lambda: len(lines(ledger, 0)) >= at)
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    FAULTS[f"coordinator SIGKILL {moment}"] += 1
    job.respawn("coordinator", "coordinator-2")
    events = finish(job, failed={"coordinator": -signal.SIGKILL})
    [resumed] = of(events, "coordinator-resumed")
    assert resumed["generation"] == resumed["from_generation"] + 1
    assert not of(events, "rank-dead"), f"seed {seed}: a rank died while it was away"
    recovered(job, ledger, events, {}, [0, 1])


@pytest.mark.slow
@pytest.mark.parametrize("attempt", REPEAT)
def test_two_workers_killed_at_once(broker: EmbeddedBroker, tmp_path: Path,
                                    attempt: int) -> None:
    job, ledger = run_job(broker, tmp_path, 4, f"two-{attempt}")
    wait_for("rank 1 to train 5 epochs", lambda: trained_epochs(ledger, 1) >= 5)
    victims = [job.procs["rank-1"], job.procs["rank-2"]]
    for p in victims:
        p.send_signal(signal.SIGKILL)
    FAULTS["worker SIGKILL"] += 2
    events = finish(job, failed={"rank-1": -signal.SIGKILL, "rank-2": -signal.SIGKILL})
    assert sorted(d["rank"] for d in of(events, "rank-dead")) == [1, 2]
    assert of(events, "session-formed")[-1]["members"] == [0, 3]
    recovered(job, ledger, events, {1: victims[0].pid, 2: victims[1].pid}, [0, 3])


@pytest.mark.slow
@pytest.mark.parametrize("attempt", REPEAT)
def test_the_elected_id_generator_killed_during_the_rebuild(broker: EmbeddedBroker,
                                                            tmp_path: Path,
                                                            attempt: int) -> None:
    job, ledger = run_job(broker, tmp_path, 4, f"gen-{attempt}")
    wait_for("rank 3 to train 5 epochs", lambda: trained_epochs(ledger, 3) >= 5)
    first = job.procs["rank-3"]
    first.send_signal(signal.SIGKILL)
    tail = Tail(job.tmp / "events.jsonl")
    wait_for("the rebuild's id request", lambda: any(
        e["event"] == "session-requested" and 3 not in e["members"] for e in tail.poll()))
    generator = next(e["generator"] for e in tail.events
                     if e["event"] == "session-requested" and 3 not in e["members"])
    second = job.procs[f"rank-{generator}"]
    second.send_signal(signal.SIGKILL)
    FAULTS["worker SIGKILL"] += 1
    FAULTS["id generator SIGKILL during a rebuild"] += 1
    events = finish(job, failed={"rank-3": -signal.SIGKILL,
                                 f"rank-{generator}": -signal.SIGKILL})
    assert sorted(d["rank"] for d in of(events, "rank-dead")) == sorted([3, generator])
    later = [e for e in of(events, "session-requested") if generator not in e["members"]]
    assert later, "no session was requested after the generator died"
    assert later[-1]["generator"] != generator  # another rank minted the session
    survivors = [r for r in range(4) if r not in (3, generator)]
    assert of(events, "session-formed")[-1]["members"] == survivors
    recovered(job, ledger, events, {3: first.pid, generator: second.pid}, survivors)


def latest_bundle(url: str, job: str) -> int:
    """The version of ``job``'s latest stored resume bundle (0: none yet)."""
    async def read() -> int:
        nc = await connect(url, name="test-bundle-probe")
        try:
            found = await bundles.latest(nc.jetstream(), job)
            return found.version if found is not None else 0
        finally:
            await nc.close()
    return asyncio.run(read())


@pytest.mark.slow
@pytest.mark.parametrize("attempt", REPEAT)
def test_the_whole_run_killed_resumes_from_its_last_bundle(broker: EmbeddedBroker,
                                                           tmp_path: Path,
                                                           attempt: int) -> None:
    """Coordinator and every worker SIGKILLed at once; a new job on the same broker resumes
    from the old job's last bundle in its Object Store. Across both runs every sample of
    every epoch is in the final model exactly once: epochs before the bundle from the first
    run (its later, unbundled work is discarded), the rest from the second."""
    rng, seed = scenario_rng(f"resume-{attempt}")
    want = rng.randint(2, 5)
    first, ledger_a = run_job(broker, tmp_path / "a", 2, f"whole-{attempt}")
    wait_for(f"bundle v{want}", lambda: latest_bundle(broker.url, first.name) >= want)
    for p in first.procs.values():
        p.send_signal(signal.SIGKILL)
    for p in first.procs.values():
        p.wait(10)
    FAULTS["whole run SIGKILL, resumed"] += 1
    version = latest_bundle(broker.url, first.name)  # the commit point: nothing torn
    assert version >= want, f"seed {seed}"
    second, ledger_b = run_job(broker, tmp_path / "b", 2, f"whole-{attempt}-b",
                               coordinator_args=["--resume", first.name])
    events = finish(second, failed={})
    [resumed] = of(events, "resumed-from-bundle")
    assert (resumed["job"], resumed["version"], resumed["epoch"]) == (
        first.name, version, version), f"seed {seed}"
    summary = second.wait_summary()
    assert summary["ok"], summary
    assert summary["coverage"]["exact"], summary["coverage"]
    assert summary["coverage"]["resumed_epochs"] == version
    assert summary["resumed_from"]["epoch"] == version
    assert all("loaded bundle v" in second.log(f"rank-{r}") for r in range(2))
    baseline = undisturbed_accuracy(tmp_path / "undisturbed")
    accuracy_bound(summary["test_accuracy"], baseline, f"seed {seed}: ")
    counted: Counter[tuple[int, int]] = Counter()
    for rank in range(2):
        counted.update((e, i) for e, i, _ in lines(ledger_a, rank) if e < version)
        again = [(e, i) for e, i, _ in lines(ledger_b, rank)]
        assert all(e >= version for e, _ in again), "the resumed run retrained bundled epochs"
        counted.update(again)
    per_epoch = (N_TRAIN // BATCH) * BATCH
    for epoch in range(EPOCHS):
        expected = set(epoch_permutation(N_TRAIN, SEED, epoch)[:per_epoch].tolist())
        assert {i for (e, i) in counted if e == epoch} == expected, f"epoch {epoch}"
    assert max(counted.values()) == 1, "a sample trained twice across the resume"
    same_replicas(second.out, [0, 1])
