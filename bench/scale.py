"""The control plane at scale: one real coordinator driven by ``ddpbus simulate``.

For each rank count (default 8, 64, 256, 1024) the benchmark runs, on its own nats-server,
two jobs of simulated ranks (cadence, ``--rate`` Batch reports per second per rank, a
lognormal speed spread) against a real ``ddpbus coordinator`` process:

- steady: the run from formation to its end. Reported: messages the coordinator handled
  per second of training; intake latency (a stream message's store time to its handling:
  the backlog shows here) and decision latency (store time to the publish of the commands
  it led to), p50/p99 over the run and over the inputs decided while training (without
  the admission burst, when every rank's Hello waits behind the coordinator's start); the
  coordinator's CPU (% of one core over the process's life, sampled every 0.2 s) and
  peak RSS; the job stream's bytes per simulated hour (stored bytes over the training
  time, times 3600: the retention sizing input); the averages' reduce time as the
  coordinator recorded it (its SyncNow to the last SyncAck it applied, which El Che takes
  for the cost of averaging: the simulator acks at once, so this is the coordinator's own
  time to read a thousand acks), p50 and max;
- replay: the coordinator is SIGKILLed in the middle of training and started again at once;
  snapshot load + replay = the new process from taking the lease to caught up with the
  stream (target <= 5 s at 1,024 ranks). Skipped with ``--no-replay``;
- deaths (with ``--deaths COUNT``): COUNT ranks die together in the middle of training
  (``ddpbus simulate --kill``; heartbeat timeout 5 s): the membership changes and
  communicator rebuilds the coordinator took for them (target: one), the seconds from
  their declaration to the next average, and whether the run still ended with every
  sample trained once.

The simulator runs on the same machine and takes CPU from the coordinator and the broker
(its own CPU is reported too); a 2-core box is far from a cluster's control host, so read
the curve, not the absolute numbers: CPU and RSS should grow linearly (or better) in the
ranks, latency should stay flat while the coordinator keeps up. ``--coordinator-core N``
gives the coordinator CPU N to itself (the broker, the simulator and the bench share the
others), as a control host of its own would: it tells the coordinator's own cost from the
contention with its load.

Run: ``python bench/scale.py [--ranks 8 64 256 1024] [--rate 10] [--seconds 20]
[--no-replay] [--deaths COUNT] [--coordinator-core N] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _results import record
from _runs import ROOT, SPECS, write_json

from ddpbus.codecs import subjects as sj
from ddpbus.orchestrator.runtime.nats_server import BrokerConfig, EmbeddedBroker
from ddpbus.orchestrator.transport.bus import connect

CLI = [sys.executable, "-m", "ddpbus.orchestrator.tools.cli", "--log-level", "INFO"]
KEY = b"scale-bench-job-key-0123456789ab"
BATCH = 8  # bench/specs/simulated.py's batch size
EPOCHS = 2
TICKS = os.sysconf("SC_CLK_TCK")
DEATH_TIMEOUT_S = 5.0  # --deaths: declared in seconds, not the default half minute


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def _rss_peak_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Sampler:
    """CPU seconds and peak RSS of a process, read while it lives (the last good read
    stands), and the seconds it lived until that read: CPU % is over the same span (the
    admission at the start and the report at the end cost CPU too)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc, self.cpu_s, self.rss_mb = proc, 0.0, 0.0
        self.started = time.monotonic()
        self.lived_s = 0.0
        self.cpus: list[int] = []  # the CPUs it may run on (--coordinator-core)

    def sample(self) -> None:
        # it may exit between poll and read (a zombie has no VmHWM): the last read stands
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, IndexError, ValueError):
                cpu, rss = _cpu_s(self.proc.pid), _rss_peak_mb(self.proc.pid)
                cpus = sorted(os.sched_getaffinity(self.proc.pid))
                if not math.isnan(rss):
                    self.cpu_s, self.rss_mb, self.cpus = cpu, rss, cpus
                    self.lived_s = time.monotonic() - self.started

    @property
    def cpu_pct(self) -> float:
        return round(100 * self.cpu_s / max(self.lived_s, 1e-9), 1)


def _events(path: Path) -> list[dict[str, Any]]:
    """The decision log's complete lines (read while the coordinator writes it: a line
    without its newline yet is still being written, and is read next time)."""
    if not path.exists():
        return []
    text = path.read_text()
    return [json.loads(x) for x in text[:text.rfind("\n") + 1].splitlines() if x.strip()]


def _started(events: list[dict[str, Any]]) -> float | None:
    return next((float(e["t"]) for e in events if e["event"] == "training-started"), None)


async def _stream_bytes(url: str, job: str) -> tuple[int, int]:
    nc = await connect(url, name="scale-bench")
    try:
        state = (await nc.jetstream().stream_info(sj.stream_name(job))).state
        return int(state.bytes), int(state.messages)
    finally:
        await nc.close()


def run_job(url: str, tmp: Path, ranks: int, *, rate: float, seconds: float, kill: bool,
            coordinator_core: int | None = None, deaths: int = 0) -> dict[str, Any]:
    """One simulated job to its end; with ``kill`` the coordinator is SIGKILLed mid-training
    and restarted at once; with ``deaths`` that many ranks die together mid-training (the
    heartbeat timeout is then ``DEATH_TIMEOUT_S``)."""
    job = f"scale{ranks}{'r' if kill else 'd' if deaths else 's'}"
    key_file = tmp / "job.key"
    key_file.write_bytes(KEY)
    # samples per rank so that an epoch lasts ``seconds / EPOCHS`` at ``rate``
    per_rank = max(BATCH, round(rate * seconds / EPOCHS) * BATCH)
    common = ["--job", job, "--nats", url, "--key-file", str(key_file)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPBUS_")}
    env["SIM_EPOCHS"] = str(EPOCHS)
    summary, events_file = tmp / f"{job}.summary.json", tmp / f"{job}.events.jsonl"
    coord_argv = [*CLI, "coordinator", *common, "--world-size", str(ranks), "--backend",
                  "gloo", "--summary", str(summary), "--events", str(events_file),
                  *(["--knob", f"heartbeat_timeout={DEATH_TIMEOUT_S}"] if deaths else []),
                  f"{SPECS / 'simulated.py'}:spec"]
    sim_argv = [*CLI, "simulate", *common, "--ranks", str(ranks), "--rate", str(rate),
                "--speeds", "lognormal:0.2", "--intake", "core",  # the lightest client side
                "--dataset-size", str(per_rank * ranks),
                *(["--kill", f"{deaths}@{seconds / 2}"] if deaths else [])]
    logs = []

    def spawn(name: str, argv: list[str], core: int | None = None) -> subprocess.Popen[bytes]:
        log = (tmp / f"{job}.{name}.log").open("wb")
        logs.append(tmp / f"{job}.{name}.log")
        pin = None if core is None else (lambda: os.sched_setaffinity(0, {core}))
        try:
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,  # noqa: S603
                                    cwd=ROOT, preexec_fn=pin)  # noqa: PLW1509
        finally:
            log.close()

    coordinator = spawn("coordinator", coord_argv, coordinator_core)
    simulator = spawn("simulate", sim_argv)
    coord, sim = Sampler(coordinator), Sampler(simulator)
    killed_at: float | None = None
    deadline = time.monotonic() + 120 + 6 * seconds + ranks / 10
    try:
        while simulator.poll() is None or coordinator.poll() is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{job} did not finish in time\n" + "\n".join(
                    f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs))
            coord.sample()
            sim.sample()
            started = _started(_events(events_file))
            if kill and killed_at is None and started is not None and (
                    time.time() - started > seconds / 2):
                coordinator.send_signal(signal.SIGKILL)
                coordinator.wait(10)
                killed_at = time.time()
                coordinator = spawn("coordinator-2", coord_argv, coordinator_core)
                coord = Sampler(coordinator)
            if coordinator.poll() not in (None, 0) or simulator.poll() not in (None, 0):
                raise RuntimeError(f"{job}: a process failed\n" + "\n".join(
                    f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs))
            time.sleep(0.2)  # the sampling interval
    finally:
        for p in (coordinator, simulator):
            if p.poll() is None:
                p.kill()
    done = json.loads(summary.read_text())
    events = _events(events_file)
    train_s = done.get("train_s") or (
        max(float(e["t"]) for e in events) - (_started(events) or 0.0))
    stored, messages = asyncio.run(_stream_bytes(url, job))
    return {"summary": done, "train_s": train_s, "coord_cpu_pct": coord.cpu_pct,
            "coord_rss_mb": coord.rss_mb, "coord_cpus": coord.cpus,
            "sim_cpus": sim.cpus, "sim_cpu_pct": sim.cpu_pct, "stream_bytes": stored,
            "stream_messages": messages, "killed": killed_at is not None, "events": events}


def _deaths(events: list[dict[str, Any]]) -> dict[str, Any]:
    """How the coordinator took the ranks that died together: in how many membership
    changes (runs of ``rank-dead`` records with nothing between them), how many new
    communicators it formed for them, and the seconds from the declaration to the first
    average after it."""
    at = [i for i, e in enumerate(events) if e["event"] == "rank-dead"]
    if not at:
        return {"dead": 0, "membership_changes": 0, "rebuilds": 0, "resumed_s": None}
    changes = 1 + sum(1 for a, b in itertools.pairwise(at) if b != a + 1)
    after = events[at[-1] + 1:]
    declared = float(events[at[-1]]["t"])
    average = next((float(e["t"]) for e in after if e["event"] == "average"), None)
    return {"dead": len(at), "membership_changes": changes,
            "rebuilds": sum(1 for e in events[at[0]:] if e["event"] == "session-formed"),
            "resumed_s": None if average is None else round(average - declared, 2)}


def _reduce_ms(events: list[dict[str, Any]]) -> dict[str, float | int]:
    """The averages' reduce times as the coordinator recorded them (its SyncNow to the
    last SyncAck it applied; El Che counts it as the window's averaging cost): p50, max."""
    times = sorted(float(e["reduce_ms"]) for e in events
                   if e["event"] == "averaged" and "reduce_ms" in e)
    if not times:
        return {"count": 0}
    return {"count": len(times), "p50": round(statistics.median(times), 1),
            "max": round(times[-1], 1)}


def measure(ranks: int, *, rate: float, seconds: float, replay: bool,
            coordinator_core: int | None = None, deaths: int = 0) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ddpbus-scale-") as tmp:
        store = Path(tmp) / "js"
        with EmbeddedBroker(BrokerConfig(store_dir=store)) as broker:
            steady = run_job(broker.url, Path(tmp), ranks, rate=rate, seconds=seconds,
                             kill=False, coordinator_core=coordinator_core)
            again = (run_job(broker.url, Path(tmp), ranks, rate=rate, seconds=seconds,
                             kill=True, coordinator_core=coordinator_core)
                     if replay else None)
            dying = (run_job(broker.url, Path(tmp), ranks, rate=rate, seconds=seconds,
                             kill=False, coordinator_core=coordinator_core,
                             deaths=deaths) if 0 < deaths < ranks else None)
    s, train_s = steady["summary"], steady["train_s"]
    return {
        "ranks": ranks,
        "ok": s["ok"],
        "messages_per_s": round(s["messages_handled"] / max(train_s, 1e-9), 1),
        "intake_ms": s["intake_latency_ms"],
        "decision_ms": s["decision_latency_ms"],
        "training_decision_ms": s["training_decision_latency_ms"],
        "coordinator_cpu_pct": steady["coord_cpu_pct"],
        "coordinator_rss_mb": round(steady["coord_rss_mb"], 1),
        "coordinator_cpus": steady["coord_cpus"],
        "simulator_cpus": steady["sim_cpus"],
        "simulator_cpu_pct": steady["sim_cpu_pct"],
        "stream_mb_per_hour": round(steady["stream_bytes"] / max(train_s, 1e-9) * 3600 / 2**20,
                                    1),
        "stream_messages": steady["stream_messages"],
        "rounds": s["rounds"],
        "reduce_ms": _reduce_ms(steady["events"]),
        "train_s": round(train_s, 2),
        "replay_s": None if again is None else again["summary"].get("replay_s"),
        "replay_ok": None if again is None else again["summary"]["ok"],
        "deaths": None if dying is None else {
            **_deaths(dying["events"]), "ok": dying["summary"]["ok"],
            "coverage_exact": dying["summary"]["coverage"]["exact"]},
    }


def _fmt(x: Any) -> str:
    return "-" if x is None else f"{x:.1f}" if isinstance(x, float) else str(x)


def _figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The history line's figures: per rank count, what the README's table reports."""
    out: dict[str, Any] = {}
    for r in rows:
        n = r["ranks"]
        out |= {f"{n} messages_per_s": r["messages_per_s"],
                f"{n} training_decision_p50_ms": r["training_decision_ms"].get("p50"),
                f"{n} training_decision_p99_ms": r["training_decision_ms"].get("p99"),
                f"{n} coordinator_cpu_pct": r["coordinator_cpu_pct"],
                f"{n} coordinator_rss_mb": r["coordinator_rss_mb"],
                f"{n} reduce_p50_ms": r["reduce_ms"].get("p50"), f"{n} replay_s": r["replay_s"]}
        if r["deaths"] is not None:
            out |= {f"{n} deaths_membership_changes": r["deaths"]["membership_changes"],
                    f"{n} deaths_resumed_s": r["deaths"]["resumed_s"]}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--rate", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=20.0,
                        help="training time per job at the nominal rate")
    parser.add_argument("--no-replay", action="store_true")
    parser.add_argument("--coordinator-core", type=int, metavar="CPU",
                        help="run the coordinator alone on this CPU and the broker, the "
                             "simulator and the bench on the others (a control host of its "
                             "own, as in a cluster)")
    parser.add_argument("--deaths", type=int, default=0, metavar="COUNT",
                        help="a third job per rank count in which COUNT ranks die together "
                             "mid-training (heartbeat timeout "
                             f"{DEATH_TIMEOUT_S:g} s): reported are the membership changes "
                             "and communicator rebuilds it took and the time to the next "
                             "average")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.deaths < 0:
        parser.error("--deaths must be >= 0")
    if args.coordinator_core is not None:
        cores = os.sched_getaffinity(0)
        if args.coordinator_core not in cores or len(cores) < 2:
            parser.error(f"--coordinator-core {args.coordinator_core}: needs one of the CPUs "
                         f"{sorted(cores)} and at least one more for the rest")
        os.sched_setaffinity(0, cores - {args.coordinator_core})  # inherited by the rest
    rows = []
    for n in args.ranks:
        row = measure(n, rate=args.rate, seconds=args.seconds, replay=not args.no_replay,
                      coordinator_core=args.coordinator_core, deaths=args.deaths)
        rows.append(row)
        print(f"  {n} ranks: done", file=sys.stderr, flush=True)
    head = ("ranks", "msgs/s", "intake p50", "intake p99", "decision p50", "decision p99",
            "training decision p50", "training decision p99", "coord CPU %", "coord RSS MB",
            "sim CPU %", "stream MB/h", "reduce p50", "reduce max", "replay s")
    print(" | ".join(head))
    for r in rows:
        cells = (r["ranks"], r["messages_per_s"], r["intake_ms"].get("p50"),
                 r["intake_ms"].get("p99"), r["decision_ms"].get("p50"),
                 r["decision_ms"].get("p99"), r["training_decision_ms"].get("p50"),
                 r["training_decision_ms"].get("p99"), r["coordinator_cpu_pct"],
                 r["coordinator_rss_mb"], r["simulator_cpu_pct"], r["stream_mb_per_hour"],
                 r["reduce_ms"].get("p50"), r["reduce_ms"].get("max"), r["replay_s"])
        print(" | ".join(_fmt(c) for c in cells))
    dying = [r for r in rows if r["deaths"] is not None]
    if dying:
        print("ranks | died together | membership changes | rebuilds | declared -> next "
              "average s | ok | coverage exact")
        for r in dying:
            d = r["deaths"]
            print(" | ".join(_fmt(c) for c in (r["ranks"], d["dead"], d["membership_changes"],
                                               d["rebuilds"], d["resumed_s"], d["ok"],
                                               d["coverage_exact"])))
    doc = {"rate": args.rate, "seconds": args.seconds,
           "coordinator_core": args.coordinator_core, "deaths": args.deaths, "rows": rows}
    path = write_json("scale", doc, args.json)
    print(f"JSON: {path}")
    record("scale", doc, _figures(rows), args.json)
    return 0 if all(r["ok"] and r["replay_ok"] in (None, True)
                    and (r["deaths"] is None or r["deaths"]["ok"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
