"""``ddpbus coordinator``, ``ddpbus worker`` and ``ddpbus run``: flags and entry points.

All three load the user's training spec (``file.py:name`` or ``module:name``) and check
every setting before anything starts. The coordinator decides the schedule: policy,
backend and knobs from the spec, overridden by ``--policy``, ``--backend``, ``--epochs``,
``--batch-size`` and ``--knob NAME=VALUE``; workers adopt what the coordinator sends them.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
from datetime import timedelta
from pathlib import Path
from typing import Any

from ddpbus.codecs import subjects as sj
from ddpbus.codecs.envelope import MIN_KEY_BYTES
from ddpbus.codecs.errors import ConfigError
from ddpbus.orchestrator.auth import ENV as NATS_AUTH_ENV
from ddpbus.orchestrator.auth import OBSERVER, Access, NatsAuth
from ddpbus.orchestrator.config import KNOBS, Schedule, parse_knob_assignments

ENV_VARS: dict[str, dict[str, str]] = {
    "coordinator": {
        "job": "DDPBUS_JOB", "nats": "DDPBUS_NATS_URL", "key_file": "DDPBUS_KEY_FILE",
        "world_size": "DDPBUS_WORLD_SIZE", "policy": "DDPBUS_POLICY",
        "backend": "DDPBUS_BACKEND", "summary": "DDPBUS_SUMMARY", "events": "DDPBUS_EVENTS",
        "spec": "DDPBUS_SPEC", "lease_ttl": "DDPBUS_LEASE_TTL", "resume": "DDPBUS_RESUME",
        "metrics_port": "DDPBUS_METRICS_PORT", "report": "DDPBUS_REPORT",
    },
    "worker": {
        "job": "DDPBUS_JOB", "nats": "DDPBUS_NATS_URL", "key_file": "DDPBUS_KEY_FILE",
        "world_size": "DDPBUS_WORLD_SIZE", "rank": "DDPBUS_RANK", "out": "DDPBUS_OUT",
        "device": "DDPBUS_DEVICE", "torch_threads": "DDPBUS_TORCH_THREADS",
        "spec": "DDPBUS_SPEC", "bundle_dir": "DDPBUS_BUNDLE_DIR",
    },
    "run": {"workers": "DDPBUS_WORKERS", "out": "DDPBUS_OUT", "policy": "DDPBUS_POLICY",
            "backend": "DDPBUS_BACKEND"},
    "sub": {"job": "DDPBUS_JOB", "nats": "DDPBUS_NATS_URL", "key_file": "DDPBUS_KEY_FILE"},
    "status": {"job": "DDPBUS_JOB", "nats": "DDPBUS_NATS_URL",
               "key_file": "DDPBUS_KEY_FILE"},
    "replay": {"job": "DDPBUS_JOB", "nats": "DDPBUS_NATS_URL",
               "key_file": "DDPBUS_KEY_FILE"},
    "report": {"job": "DDPBUS_JOB", "nats": "DDPBUS_NATS_URL",
               "key_file": "DDPBUS_KEY_FILE"},
    "simulate": {"job": "DDPBUS_JOB", "nats": "DDPBUS_NATS_URL",
                 "key_file": "DDPBUS_KEY_FILE", "ranks": "DDPBUS_WORLD_SIZE"},
}

for _command in ("coordinator", "worker", "sub", "status", "replay", "report", "simulate"):
    ENV_VARS[_command] |= {f"nats_{field}": var for field, var in NATS_AUTH_ENV.items()}

POLICIES = ("sync", "cadence", "async")
BACKENDS = ("auto", "nccl", "gloo", "broker")


def _nonneg(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def _port_number(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0-65535)")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a positive number of seconds")
    return value


def _nonneg_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a number of seconds >= 0")
    return value


def _byte_limit(text: str) -> int:
    value = int(text)
    if value < 1 and value != -1:
        raise argparse.ArgumentTypeError(f"{value} must be a positive number of bytes, or "
                                         "-1 for unlimited")
    return value


def _factor(text: str) -> float:
    value = float(text)
    if not value >= 1.0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1 (how many times slower)")
    return value


def _schedule_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("schedule (overrides the spec)")
    g.add_argument("--policy", choices=POLICIES, help="when to average (env DDPBUS_POLICY)")
    g.add_argument("--backend", choices=BACKENDS, help="how to average: auto = NCCL with "
                   "CUDA, else gloo (env DDPBUS_BACKEND)")
    g.add_argument("--epochs", type=int, help="number of epochs")
    g.add_argument("--batch-size", type=int, help="samples per batch")
    g.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE",
                   help=f"scheduler knob, repeatable; known: {', '.join(KNOBS)}")


def nats_auth_flags(p: argparse.ArgumentParser) -> None:
    """How a command logs in to NATS and trusts its TLS certificate (subjects.md,
    "Identities and permissions"); each flag has a ``DDPBUS_NATS_*`` variable."""
    g = p.add_argument_group("NATS credentials (default: none)")
    g.add_argument("--nats-nkey", type=Path, metavar="FILE", help="this identity's nkey "
                   "seed, as `ddpbus broker --auth` writes it (env DDPBUS_NATS_NKEY)")
    g.add_argument("--nats-creds", type=Path, metavar="FILE", help="a JWT .creds file, for "
                   "an operator-mode server (env DDPBUS_NATS_CREDS)")
    g.add_argument("--nats-user", help="user name (env DDPBUS_NATS_USER)")
    g.add_argument("--nats-password-file", type=Path, metavar="FILE", help="the user's "
                   "password (env DDPBUS_NATS_PASSWORD_FILE)")
    g.add_argument("--nats-tls-ca", type=Path, metavar="FILE", help="CA bundle that signed "
                   "the server's certificate: connect with TLS (env DDPBUS_NATS_TLS_CA)")
    g.add_argument("--nats-tls-cert", type=Path, metavar="FILE", help="client certificate, "
                   "for mutual TLS (env DDPBUS_NATS_TLS_CERT)")
    g.add_argument("--nats-tls-key", type=Path, metavar="FILE", help="its private key "
                   "(env DDPBUS_NATS_TLS_KEY)")


def nats_access(args: argparse.Namespace, identity: str) -> Access:
    """The command's NATS URL, credentials and identity (files checked now)."""
    fields = {field: getattr(args, f"nats_{field}", None) for field in NATS_AUTH_ENV}
    auth = NatsAuth(**fields) if any(v is not None for v in fields.values()) else None
    return Access(url=args.nats, auth=auth, identity=identity)


def _connection_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--job", type=_job, help="job name (env DDPBUS_JOB)")
    p.add_argument("--nats", help="NATS URL (env DDPBUS_NATS_URL)")
    p.add_argument("--key-file", type=Path, help="file holding the job key, >= 16 bytes "
                   "(env DDPBUS_KEY_FILE)")
    p.add_argument("--world-size", type=_positive_int, help="number of ranks (env "
                   "DDPBUS_WORLD_SIZE)")
    nats_auth_flags(p)


def _job(text: str) -> str:
    try:
        return sj.check_job(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parsers(sub: Any) -> None:
    coord = sub.add_parser("coordinator", help="run the coordinator of one job",
                           description="Run a job's coordinator: admits the ranks, decides "
                           "every average and epoch, serves callbacks; exits when the run ends.")
    _connection_flags(coord)
    _schedule_flags(coord)
    coord.add_argument("--summary", type=Path, help="write the run summary JSON here")
    coord.add_argument("--events", type=Path, help="append the decision log (JSON lines)")
    coord.add_argument("--standby", action="store_true",
                       help="wait for the leader lease instead of failing when another "
                       "coordinator holds it (a hot standby), then resume from its snapshot")
    coord.add_argument("--lease-ttl", type=_seconds, default=None,
                       help="leader lease time-to-live in seconds (default 5; renewed every "
                       "third of it)")
    coord.add_argument("--snapshot-every", type=_nonneg_seconds, default=None, metavar="S",
                       help="write the full write-ahead snapshot at most every S seconds "
                       "(default 1), a journal segment of the events since before other "
                       "publishes; 0: a full snapshot before every publish")
    coord.add_argument("--wire-json", action="store_true",
                       help="publish proto3 JSON payloads (readable in `nats sub`)")
    coord.add_argument("--report", type=Path, metavar="DIR", help="at the end, write the run "
                       "report (index.html and PNG plots) here (env DDPBUS_REPORT)")
    coord.add_argument("--metrics-port", type=_port_number, help="serve Prometheus metrics on "
                       "http://0.0.0.0:PORT/metrics (0: any free port, logged; env "
                       "DDPBUS_METRICS_PORT; default: off)")
    keep = coord.add_argument_group("stream retention (subjects.md, Retention)")
    keep.add_argument("--compact-every", type=_nonneg_seconds, default=None, metavar="SECONDS",
                      help="purge what no reader needs any more every SECONDS (default 60; "
                      "0: never, keep the whole history up to the stream's limits)")
    keep.add_argument("--keep-history", type=_nonneg_seconds, default=None,
                      metavar="SECONDS", help="what is younger than this always stays, for "
                      "`ddpbus sub --since`, replay and report (default 1800)")
    keep.add_argument("--stream-max-bytes", type=_byte_limit, default=None, metavar="BYTES",
                      help="the stream's backstop limit, oldest dropped first when full (-1: "
                      "unlimited; default: as the stream has it, unlimited when new); "
                      "nats-server reserves it against its file store up front")
    coord.add_argument("--resume", metavar="SOURCE", help="start from a resume bundle (env "
                       "DDPBUS_RESUME): a bundle directory (or a --bundle-dir / `ddpbus run` "
                       "directory holding one), or the name of an earlier job on this broker "
                       "(its latest bundle); ignored once this job has a snapshot of its own")
    coord.add_argument("spec", nargs="?", help="training spec: file.py:name or module:name "
                       "(env DDPBUS_SPEC)")

    worker = sub.add_parser("worker", help="run one rank's worker agent",
                            description="Run the worker agent of one rank: trains the plans "
                            "the coordinator sends and averages through torch.distributed.")
    _connection_flags(worker)
    worker.add_argument("--rank", type=_nonneg, help="this worker's rank (env DDPBUS_RANK)")
    worker.add_argument("--out", type=Path, help="directory for consensus and rank saves "
                        "(env DDPBUS_OUT)")
    worker.add_argument("--device", help="auto (default: cuda:<rank mod count> with CUDA, "
                        "else cpu), cpu, cuda, cuda:N (env DDPBUS_DEVICE)")
    worker.add_argument("--torch-threads", type=_positive_int, help="torch intra-op threads")
    worker.add_argument("--slowdown", type=_factor, default=1.0, help="SIMULATION: make every "
                        "batch FACTOR times slower (to watch El Che balance on one machine)")
    worker.add_argument("--final-state", type=Path, help="on Shutdown, write this rank's "
                        "final parameters to this safetensors file")
    worker.add_argument("--wire-json", action="store_true", help="publish proto3 JSON")
    worker.add_argument("--bundle-dir", type=Path, help="write resume bundles to this "
                        "directory (a volume every rank and the coordinator share) instead "
                        "of the job's Object Store (env DDPBUS_BUNDLE_DIR)")
    worker.add_argument("spec", nargs="?", help="training spec (env DDPBUS_SPEC)")

    run = sub.add_parser("run", help="train a spec on this machine (broker + coordinator + "
                         "N workers)", description="Start the embedded broker, a coordinator "
                         "and N worker processes on this machine, show progress, print the "
                         "result. Ctrl-C stops everything cleanly.")
    run.add_argument("spec", help="training spec: file.py:name or module:name")
    run.add_argument("--workers", type=_positive_int, help="number of worker processes (env "
                     "DDPBUS_WORKERS; default 2)")
    _schedule_flags(run)
    run.add_argument("--slowdown", action="append", default=[], metavar="RANK=FACTOR",
                     help="SIMULATION: make rank RANK's batches FACTOR times slower; "
                     "repeatable")
    run.add_argument("--summary", type=Path, help="write the run summary JSON here")
    run.add_argument("--out", type=Path, help="run directory: logs, events, consensus model "
                     "(default: ./ddpbus-runs/<job>)")
    run.add_argument("--job", type=_job, help="job name (default: a fresh one)")
    run.add_argument("--torch-threads", type=_positive_int, help="torch threads per worker "
                     "(default: cores / workers)")
    run.add_argument("--no-progress", action="store_true", help="no live progress display")
    run.add_argument("--wire-json", action="store_true", help="proto3 JSON payloads")
    run.add_argument("--resume", metavar="DIR", help="continue from the latest resume bundle "
                     "of an earlier run's directory (or a bundle directory)")
    run.add_argument("--no-auth", action="store_true", help="an open broker: no per-identity "
                     "credentials or subject permissions (messages are still signed with the "
                     "job key); for watching with a plain `nats sub`")
    _add_sub(sub)
    _add_status(sub)
    _add_replay(sub)
    _add_report(sub)
    _add_simulate(sub)


def _reader_flags(p: argparse.ArgumentParser) -> None:
    """What every command that reads a job needs: which job, where, and its key (which
    verifies every message and the coordinator's snapshot)."""
    p.add_argument("--job", type=_job, help="job name (env DDPBUS_JOB)")
    p.add_argument("--nats", help="NATS URL (env DDPBUS_NATS_URL)")
    p.add_argument("--key-file", type=Path, help="the job key (env DDPBUS_KEY_FILE)")
    nats_auth_flags(p)


def _reader(args: argparse.Namespace, command: str) -> bytes:
    """Check a reading command's settings; returns the job key."""
    _require(args, [("--job", "job"), ("--nats", "nats")], command)
    return read_key(args.key_file)


def _add_sub(sub: Any) -> None:
    watch = sub.add_parser("sub", help="show a job's traffic, decoded",
                           description="Like `nats sub`, but every message is verified with "
                           "the job key and decoded: one line per message (time, stream "
                           "sequence, subject, type, sender and generation, key fields) or "
                           "JSON lines. Live unless --since reads the job's stream.")
    watch.add_argument("subject", nargs="?", help="subject or wildcard inside the job "
                       "(default ddpbus.<job>.>)")
    _reader_flags(watch)
    watch.add_argument("--rank", type=_nonneg, help="only this rank's messages")
    watch.add_argument("--type", help="only this message type (Batch or TimingMsg.Batch)")
    watch.add_argument("--json", action="store_true", help="JSON lines")
    watch.add_argument("--since", metavar="SEQ|TIME", help="read the stream from this "
                       "sequence, age (10m, 2h) or ISO time up to its end, instead of live")
    watch.add_argument("--follow", action="store_true", help="with --since: keep going "
                       "after the end of the stream")
    watch.add_argument("--count", type=_positive_int, help="stop after N messages")


def _add_status(sub: Any) -> None:
    status = sub.add_parser("status", help="where a job stands",
                            description="A job's phase, epoch, global step, averaging rounds, "
                            "members (generation, liveness, batch share), El Che anchor and "
                            "counts, last checkpoint, leader lease and stream, from its KV "
                            "bucket and stream. Reads only.")
    _reader_flags(status)
    status.add_argument("--json", action="store_true", help="JSON instead of text")


def run_status(args: argparse.Namespace) -> int:
    from ddpbus.orchestrator import status

    key = _reader(args, "status")
    return asyncio.run(status.show(nats_access(args, OBSERVER), args.job, key,
                                   as_json=args.json))


def _add_simulate(sub: Any) -> None:
    sim = sub.add_parser("simulate", help="many simulated ranks, to load a coordinator",
                         description="Play --ranks ranks of a job in one process: the real "
                         "protocol (hellos, heartbeats, Batch reports at --rate per second "
                         "times each rank's speed, MetricsMsg per plan, SyncAck on SyncNow, "
                         "callback results, Exiting on Shutdown), signed with the job key, "
                         "without training. Start a coordinator with --world-size equal to "
                         "--ranks (and a collective backend). Needs an open broker, or a "
                         "login allowed every rank's subjects.")
    _reader_flags(sim)
    sim.add_argument("--ranks", type=_positive_int, help="how many ranks (env "
                     "DDPBUS_WORLD_SIZE)")
    sim.add_argument("--rate", type=_positive_float, default=10.0, help="batches per second "
                     "of a rank of speed 1 (default 10)")
    sim.add_argument("--speeds", default="equal", help="speed distribution: equal, "
                     "uniform:LO,HI, lognormal:SIGMA or slow:FRACTION,FACTOR (default equal)")
    sim.add_argument("--dataset-size", type=_positive_int, help="samples the ranks say they "
                     "hold (default 1280 per rank)")
    sim.add_argument("--seed", type=int, default=0, help="seed of the speed draw")
    sim.add_argument("--intake", choices=("durable", "core"), default="durable",
                     help="how the ranks read their control subjects: durable (each from "
                     "its own consumer, acked, as a worker does; default) or core (one "
                     "core-NATS subscription for all: the lightest, for the largest loads)")
    sim.add_argument("--kill", type=_kill_spec, metavar="COUNT@SECONDS",
                     help="the COUNT highest ranks die together SECONDS after the first "
                     "batch (no Exiting, no more beats: a rack losing power), for the "
                     "coordinator to declare in one membership change")


def run_simulate(args: argparse.Namespace) -> int:
    from ddpbus.orchestrator import collector
    from ddpbus.orchestrator.simulate import SimulatedCohort, speeds

    key = _reader(args, "simulate")
    _require(args, [("--ranks", "ranks")], "simulate")
    factors = speeds(args.speeds, args.ranks, args.seed)

    async def main() -> None:
        nc = await nats_access(args, OBSERVER).connect(args.job, name=f"ddpbus-simulate-"
                                                       f"{args.job}")
        try:
            cohort = SimulatedCohort(nc, args.job, key, args.ranks, rate=args.rate,
                                     speed=factors, dataset_size=args.dataset_size or 0,
                                     intake=args.intake, kill=args.kill,
                                     collector=collector.Collector())
            # the cohort lives as long as the process: full passes stop scanning it, and
            # run only where the cohort makes them (SimulatedCohort's collector)
            gc.collect()
            gc.freeze()
            collector.take_full_passes()
            await cohort.run()
        finally:
            await nc.close()

    asyncio.run(main())
    return 0


def _add_replay(sub: Any) -> None:
    replay = sub.add_parser("replay", help="a recorded run's timeline, from its stream",
                            description="Tell a job's run from its stream: joins and "
                            "admissions, sessions, averages, epochs, evals, bundles, deaths, "
                            "rejoins, exits and the end, each line stamped with the time "
                            "since the run began.")
    _reader_flags(replay)
    replay.add_argument("--speed", type=_speed, help="X times the recorded pace (default: "
                        "as fast as it reads; 1 = real time)")


def _add_report(sub: Any) -> None:
    report = sub.add_parser("report", help="a recorded run's HTML report with plots",
                            description="Build a job's run report from its stream: an HTML "
                            "page with PNG plots (loss and eval per epoch, per-rank "
                            "throughput, batch share, anchor and averaging interval, "
                            "divergence, membership events).")
    _reader_flags(report)
    report.add_argument("--out", type=Path, help="directory for index.html and the plots "
                        "(default ./ddpbus-report-<job>)")


def run_report(args: argparse.Namespace) -> int:
    from ddpbus.orchestrator import report

    key = _reader(args, "report")
    out = args.out or Path(f"ddpbus-report-{args.job}")
    index = asyncio.run(report.build(nats_access(args, OBSERVER), args.job, key, out))
    print(index)
    return 0


def _speed(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a positive factor")
    return value


def run_replay(args: argparse.Namespace) -> int:
    from ddpbus.orchestrator import replay

    key = _reader(args, "replay")
    return asyncio.run(replay.replay(nats_access(args, OBSERVER), args.job, key,
                                     speed=args.speed))


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _kill_spec(text: str) -> tuple[int, float]:
    count, at, seconds = text.partition("@")
    try:
        spec = int(count), float(seconds)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not COUNT@SECONDS") from None
    if not at or spec[0] < 1 or not 0 <= spec[1] < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: COUNT@SECONDS with COUNT >= 1 and "
                                         "SECONDS >= 0")
    return spec


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number > 0")
    return value


def run_sub(args: argparse.Namespace) -> int:
    from ddpbus.orchestrator import watch

    key = _reader(args, "sub")
    return asyncio.run(watch.from_args(args, key, nats_access(args, OBSERVER)).run())


# ------------------------------------------------------------------ helpers


def schedule_overrides(args: argparse.Namespace) -> dict[str, Any]:
    over: dict[str, Any] = dict(parse_knob_assignments(list(args.knob or [])))
    for name in ("policy", "backend", "epochs", "batch_size"):
        value = getattr(args, name, None)
        if value is not None:
            over[name] = value
    return over


def read_key(path: Path | None) -> bytes:
    if path is None:
        raise ConfigError("--key-file is required (or DDPBUS_KEY_FILE): the job key signs "
                          "every message")
    try:
        key = path.read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the job key file {path}: {exc}") from None
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(f"the job key in {path} is {len(key)} bytes; it must be at least "
                          f"{MIN_KEY_BYTES}")
    return key


def _require(args: argparse.Namespace, names: list[tuple[str, str]], command: str) -> None:
    missing = [flag for flag, dest in names if getattr(args, dest, None) is None]
    if missing:
        raise ConfigError(f"{command} needs {', '.join(missing)} (or their DDPBUS_* "
                          "variables)")


def load_schedule(args: argparse.Namespace) -> tuple[Any, Schedule]:
    from ddpbus.worker_agent.spec import load_spec

    spec = load_spec(args.spec)
    return spec, spec.schedule(schedule_overrides(args))


def run_coordinator(args: argparse.Namespace) -> int:
    from ddpbus.orchestrator import collector, journal
    from ddpbus.orchestrator.retention import Retention
    from ddpbus.orchestrator.service import Coordinator, CoordinatorSettings
    from ddpbus.orchestrator.state import CoreConfig

    _require(args, [("--job", "job"), ("--nats", "nats"), ("--world-size", "world_size"),
                    ("SPEC", "spec")], "coordinator")
    if args.world_size < 1:
        raise ConfigError("--world-size must be >= 1")
    key = read_key(args.key_file)
    spec, schedule = load_schedule(args)
    if schedule.callback_rank is not None and schedule.callback_rank >= args.world_size:
        raise ConfigError(f"knob callback_rank={schedule.callback_rank} is outside world size "
                          f"{args.world_size}")
    config = CoreConfig(schedule=schedule, world_size=args.world_size,
                        has_eval=spec.eval_fn is not None,
                        has_checkpoint_fn=spec.checkpoint_fn is not None,
                        has_epoch_fn=spec.epoch_fn is not None)
    retention = Retention(
        every_s=60.0 if args.compact_every is None else args.compact_every,
        keep_s=1800.0 if args.keep_history is None else args.keep_history)
    settings = CoordinatorSettings(job=args.job, nats=nats_access(args, sj.COORDINATOR), key=key,
                                   summary_path=args.summary, events_path=args.events,
                                   wire_json=args.wire_json, standby=args.standby,
                                   lease_ttl=args.lease_ttl or 5.0, resume=args.resume,
                                   metrics_port=args.metrics_port, report_dir=args.report,
                                   retention=retention, stream_max_bytes=args.stream_max_bytes,
                                   snapshot_every=(journal.FULL_EVERY_S
                                                   if args.snapshot_every is None
                                                   else args.snapshot_every))
    # everything alive now (the libraries, torch's modules among them, and the spec) lives
    # as long as the process: the cycle collector's full passes stop scanning it (at 1,024
    # ranks each pass held the loop ~100 ms, every few seconds, whatever it was doing);
    # and the passes left (~10 ms) run at quiet moments the coordinator picks, not on
    # whichever allocation crosses the threshold (most often the gate's own decision)
    gc.collect()
    gc.freeze()
    collector.take_full_passes()
    return asyncio.run(Coordinator(settings, config).run())


# a worker that decided to exit gets this long (its trainer's join and the final flush take
# up to 30 s each) before it dumps its threads' stacks and exits 1 regardless
WORKER_EXIT_GRACE = timedelta(seconds=90)


def run_worker(args: argparse.Namespace) -> int:
    from ddpbus.worker_agent.agent import WorkerAgent, WorkerSettings
    from ddpbus.worker_agent.spec import load_spec

    _require(args, [("--job", "job"), ("--nats", "nats"), ("--world-size", "world_size"),
                    ("--rank", "rank"), ("SPEC", "spec")], "worker")
    key = read_key(args.key_file)
    spec = load_spec(args.spec)
    settings = WorkerSettings(job=args.job, rank=args.rank, world_size=args.world_size,
                              nats=nats_access(args, sj.rank_consumer(args.rank)), key=key,
                              out_dir=args.out,
                              final_state=args.final_state, device=args.device or "auto",
                              slowdown=args.slowdown, torch_threads=args.torch_threads,
                              wire_json=args.wire_json, exit_grace=WORKER_EXIT_GRACE,
                              bundle_dir=args.bundle_dir)
    return asyncio.run(WorkerAgent(settings, spec).run())


def run_local(args: argparse.Namespace) -> int:
    from ddpbus.orchestrator.launcher import LocalRun

    return LocalRun.from_args(args).run()
