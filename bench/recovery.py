"""Recovery times: a worker killed, a worker restarted, the coordinator killed, beside an
undisturbed run of the same job.

Each round runs four jobs one after the other (real `ddpbus coordinator` / `ddpbus worker`
processes on the benchmark's own nats-server, gloo, the chaos test spec: digits for 48
epochs, 3 workers slowed 3x, heartbeat timeout 2 s), so the four are measured side by side
under the same machine load:

- undisturbed: nothing happens; its train time is the baseline;
- worker kill: rank 1 is SIGKILLed after 4 epochs. Kill -> survivors training together
  again = the shrunk session formed; kill -> first completed average after it.
  Target <= heartbeat timeout + 2 s;
- worker kill, advisory: the same, with the coordinator logged in to the broker's system
  account (``--nats-system-nkey``): the broker's disconnect advisory declares the rank dead
  once ``disconnect_grace`` (0.5 s) passes, not the heartbeat timeout. Target: kill ->
  survivors training again <= 1 s;
- worker restart: rank 1 is SIGKILLed and started again at once (a pod restart). Start ->
  back in the average = the first completed average after a session including it formed.
  Target <= 10 s (a Python + torch process start is most of it);
- coordinator kill: the coordinator is SIGKILLed after 4 epochs and started again at once.
  Kill -> decisions resume = the first decision record of the new incarnation after its
  `coordinator-resumed`. Target <= 5 s.

Training time lost per failure = the faulted run's train time minus the undisturbed one's
(for a kill without restart it includes training the rest on 2 ranks instead of 3).
Times come from the coordinator's event records (wall clock) and the benchmark's own wall
clock at the kill, on one host. Medians over ``--rounds``.

Run: ``python bench/recovery.py [--rounds 3] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _results import record
from _runs import ROOT, median, write_json

sys.path.insert(0, str(ROOT / "tests" / "integration"))
from jobs import Job, spec, start_job  # the tests' real-process job runner

from ddpbus.orchestrator.runtime.nats_server import BrokerConfig, EmbeddedBroker

HEARTBEAT_S, EPOCHS, KILL_AFTER = 2.0, 48, 4
TARGETS = {"kill_to_training_s": HEARTBEAT_S + 2.0, "advisory_kill_to_training_s": 1.0,
           "restart_to_average_s": 10.0, "coordinator_kill_to_decision_s": 5.0}
DECISIONS = {"average", "epoch-boundary", "epoch-aggregated", "session-requested",
             "finishing", "run-complete"}


def _wait(what: str, cond: Callable[[], bool], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.02)  # poll interval of a deadline-bound wait


def _epochs_trained(ledger: Path, rank: int) -> int:
    path = ledger / f"rank-{rank}.txt"
    if not path.exists():
        return 0
    return len({line.split()[0] for line in path.read_text().splitlines() if line.strip()})


def _start(broker: EmbeddedBroker, tmp: Path, name: str, epochs: int, *,
           advisories: bool = False) -> tuple[Job, Path]:
    ledger = tmp / "ledger"
    ledger.mkdir(parents=True)
    system = ["--nats-system-nkey", str(broker.config.system_seed)] if advisories else []
    job = start_job(broker.url, tmp, spec("chaos"), workers=3, job=name,
                    coordinator_args=["--policy", "cadence", *system],
                    worker_args={r: ["--slowdown", "3"] for r in range(3)},
                    env={"LEDGER_DIR": str(ledger), "CHAOS_EPOCHS": str(epochs)},
                    final_state=False)
    return job, ledger


def _end(job: Job) -> list[dict[str, Any]]:
    for p in job.procs.values():
        p.wait(300)
    summary = job.wait_summary()
    if not summary["ok"]:
        raise RuntimeError(f"{job.name}: the run failed: {summary['reason']}\n{job.dump()}")
    return job.events()


def _first(events: list[dict[str, Any]], after: float, pred: Callable[[dict[str, Any]], bool]
           ) -> float:
    return next(float(e["t"]) for e in events if e["t"] >= after and pred(e)) - after


def _train_s(job: Job) -> float:
    return float(job.wait_summary()["train_s"])


def undisturbed(broker: EmbeddedBroker, tmp: Path, n: int, epochs: int) -> dict[str, float]:
    job, _ = _start(broker, tmp, f"calm-{n}", epochs)
    _end(job)
    return {"train_s": _train_s(job)}


def worker_kill(broker: EmbeddedBroker, tmp: Path, n: int, epochs: int, *,
                advisories: bool = False) -> dict[str, float]:
    job, ledger = _start(broker, tmp, f"kill-{'adv-' if advisories else ''}{n}", epochs,
                         advisories=advisories)
    _wait("rank 1's epochs", lambda: _epochs_trained(ledger, 1) >= KILL_AFTER)
    victim = job.procs.pop("rank-1")  # its exit status is the kill's
    victim.send_signal(signal.SIGKILL)
    killed = time.time()
    events = _end(job)
    [dead] = [e for e in events if e["event"] == "rank-dead"]
    want = "disconnected" if advisories else "silent"
    if dead.get("cause") != want:
        raise RuntimeError(f"{job.name}: rank 1 died of {dead.get('cause')}, not {want}")
    formed = _first(events, killed, lambda e: e["event"] == "session-formed")
    return {"train_s": _train_s(job), "kill_to_declared_s": float(dead["t"]) - killed,
            "kill_to_training_s": formed,
            "kill_to_average_s": formed + _first(events, killed + formed,
                                                 lambda e: e["event"] == "averaged")}


def worker_kill_advisory(broker: EmbeddedBroker, tmp: Path, n: int, epochs: int
                         ) -> dict[str, float]:
    return worker_kill(broker, tmp, n, epochs, advisories=True)


def worker_restart(broker: EmbeddedBroker, tmp: Path, n: int, epochs: int
                   ) -> dict[str, float]:
    job, ledger = _start(broker, tmp, f"restart-{n}", epochs)
    _wait("rank 1's epochs", lambda: _epochs_trained(ledger, 1) >= KILL_AFTER)
    victim = job.procs["rank-1"]
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    job.respawn("rank-1", "rank-1b")
    started = time.time()
    job.procs.pop("rank-1")  # its exit status is the kill's; _end waits for the rest
    events = _end(job)
    rejoined = _first(events, started, lambda e: e["event"] == "rank-rejoined")
    back = _first(events, started, lambda e: e["event"] == "session-formed"
                  and 1 in e["members"])
    return {"train_s": _train_s(job), "restart_to_rejoin_s": rejoined,
            "restart_to_average_s": back + _first(
                events, started + back, lambda e: e["event"] == "averaged")}


def coordinator_kill(broker: EmbeddedBroker, tmp: Path, n: int, epochs: int
                     ) -> dict[str, float]:
    job, ledger = _start(broker, tmp, f"coord-{n}", epochs)
    _wait("rank 0's epochs", lambda: _epochs_trained(ledger, 0) >= KILL_AFTER)
    first = job.procs.pop("coordinator")
    first.send_signal(signal.SIGKILL)
    killed = time.time()
    first.wait(10)
    job.respawn("coordinator", "coordinator-2")
    events = _end(job)
    resumed = _first(events, killed, lambda e: e["event"] == "coordinator-resumed")
    return {"train_s": _train_s(job), "coordinator_kill_to_resumed_s": resumed,
            "coordinator_kill_to_decision_s": resumed + _first(
                events, killed + resumed, lambda e: e["event"] in DECISIONS)}


SCENARIOS = {"undisturbed": undisturbed, "worker_kill": worker_kill,
             "worker_kill_advisory": worker_kill_advisory,
             "worker_restart": worker_restart, "coordinator_kill": coordinator_kill}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=EPOCHS,
                    help=f"epochs per job (default {EPOCHS}; > {KILL_AFTER}, the fault's)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.epochs <= KILL_AFTER:
        ap.error(f"--epochs must be more than {KILL_AFTER} (the faults come after that many)")
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in SCENARIOS}
    with tempfile.TemporaryDirectory(prefix="ddpbus-bench-recovery-") as tmp, \
            EmbeddedBroker(BrokerConfig(store_dir=Path(tmp) / "store",
                                        system_seed=Path(tmp) / "system.nk")) as broker:
        for n in range(args.rounds):
            for name, scenario in SCENARIOS.items():
                runs[name].append(scenario(broker, Path(tmp) / f"{name}-{n}", n,
                                           args.epochs))
    medians = {name: {k: median([r[k] for r in rs]) for k in rs[0]}
               for name, rs in runs.items()}
    calm = medians["undisturbed"]["train_s"]
    lost = {name: median([r["train_s"] - calm for r in rs])
            for name, rs in runs.items() if name != "undisturbed"}
    measured = {"kill_to_training_s": medians["worker_kill"]["kill_to_training_s"],
                "advisory_kill_to_training_s":
                    medians["worker_kill_advisory"]["kill_to_training_s"],
                "restart_to_average_s": medians["worker_restart"]["restart_to_average_s"],
                "coordinator_kill_to_decision_s":
                    medians["coordinator_kill"]["coordinator_kill_to_decision_s"]}
    doc = {"rounds": args.rounds, "runs": runs, "medians": medians,
           "train_s_lost_per_failure": lost, "measured": measured, "targets": TARGETS,
           "met": {k: measured[k] <= TARGETS[k] for k in TARGETS}}
    out = sys.stdout
    out.write(f"recovery, medians over {args.rounds} round(s) (3 workers, heartbeat "
              f"timeout {HEARTBEAT_S:.0f} s)\n")
    for k, target in TARGETS.items():
        out.write(f"  {k:32s} {measured[k]:7.2f} s   target <= {target:4.1f} s   "
                  f"{'PASS' if doc['met'][k] else 'FAIL'}\n")
    for name in ("worker_kill", "worker_kill_advisory"):
        med = medians[name]
        out.write(f"  {name:22s} kill -> declared dead {med['kill_to_declared_s']:6.2f} s, "
                  f"-> training {med['kill_to_training_s']:6.2f} s, -> averaged "
                  f"{med['kill_to_average_s']:6.2f} s\n")
    out.write(f"  undisturbed train time           {calm:7.2f} s\n")
    for name, s in lost.items():
        out.write(f"  train time lost, {name:16s} {s:+7.2f} s  "
                  f"({s / calm:+.0%} of the undisturbed run)\n")
    out.write(f"wrote {write_json('recovery', doc, args.json)}\n")
    record("recovery", doc, {**measured, "undisturbed_train_s": calm,
                             **{f"train_s_lost_{k}": v for k, v in lost.items()}}, args.json)


if __name__ == "__main__":
    main()
