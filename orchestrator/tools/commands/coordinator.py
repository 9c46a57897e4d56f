"""``ddpbus coordinator``: the coordinator of one job.

It loads the user's training spec (``file.py:name`` or ``module:name``), checks every setting
before anything starts, and decides the schedule: policy, backend and knobs from the spec,
overridden by ``--policy``, ``--backend``, ``--epochs``, ``--batch-size`` and
``--knob NAME=VALUE``; workers adopt what the coordinator sends them.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
from pathlib import Path
from typing import Any

from ddpbus.codecs import subjects as sj
from ddpbus.codecs.errors import ConfigError
from ddpbus.orchestrator.tools import argtypes, flags

NAME = "coordinator"
ENV = {
    "job": "DDPBUS_JOB", "nats": "DDPBUS_NATS_URL", "key_file": "DDPBUS_KEY_FILE",
    "world_size": "DDPBUS_WORLD_SIZE", "policy": "DDPBUS_POLICY",
    "backend": "DDPBUS_BACKEND", "summary": "DDPBUS_SUMMARY", "events": "DDPBUS_EVENTS",
    "spec": "DDPBUS_SPEC", "lease_ttl": "DDPBUS_LEASE_TTL", "resume": "DDPBUS_RESUME",
    "metrics_port": "DDPBUS_METRICS_PORT", "report": "DDPBUS_REPORT",
    "nats_system_nkey": "DDPBUS_NATS_SYSTEM_NKEY", "nats_system_creds": "DDPBUS_NATS_SYSTEM_CREDS",
    "nats_system_user": "DDPBUS_NATS_SYSTEM_USER",
    "nats_system_password_file": "DDPBUS_NATS_SYSTEM_PASSWORD_FILE",
    **flags.NATS_LOGIN_ENV,
}

# shown under the subcommand's --help
EXAMPLES = (
    'ddpbus coordinator examples/digits.py:spec --job digits --world-size 2 \\',
    '    --key-file job.key --nats nats://nats:4222 --metrics-port 9464',
    'ddpbus coordinator examples/digits.py:spec --standby ...   # a hot standby',
    'ddpbus coordinator examples/digits.py:spec --resume old-job ...',
)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    coord: argparse.ArgumentParser = sub.add_parser(
        NAME, help="run the coordinator of one job",
        description="Run a job's coordinator: admits the ranks, decides every average and "
        "epoch, serves callbacks; exits when the run ends.")
    flags.member(coord)
    flags.schedule(coord)
    presence = coord.add_argument_group(
        "fast death detection (default: off, heartbeats only)",
        "A login to the broker's system account lets the coordinator read its client "
        "disconnect advisories: a rank whose connection closes (a killed process) and does "
        "not reconnect within knob disconnect_grace (0.5 s) is dead at once, not after "
        "heartbeat_timeout. `ddpbus run` and `ddpbus broker` set this up themselves.")
    presence.add_argument("--nats-system-nkey", type=Path, metavar="FILE", help="nkey seed "
                          "of a system-account user (env DDPBUS_NATS_SYSTEM_NKEY)")
    presence.add_argument("--nats-system-creds", type=Path, metavar="FILE", help="a JWT "
                          ".creds file of a system-account user (env "
                          "DDPBUS_NATS_SYSTEM_CREDS)")
    presence.add_argument("--nats-system-user", help="a system-account user name (env "
                          "DDPBUS_NATS_SYSTEM_USER), with --nats-system-password-file")
    presence.add_argument("--nats-system-password-file", type=Path, metavar="FILE",
                          help="that user's password (env DDPBUS_NATS_SYSTEM_PASSWORD_FILE)")
    coord.add_argument("--summary", type=Path, help="write the run summary JSON here")
    coord.add_argument("--events", type=Path, help="append the decision log (JSON lines)")
    coord.add_argument("--standby", action="store_true",
                       help="wait for the leader lease instead of failing when another "
                       "coordinator holds it (a hot standby), then resume from its snapshot")
    coord.add_argument("--lease-ttl", type=argtypes.seconds, default=None,
                       help="leader lease time-to-live in seconds (default 5; renewed every "
                       "third of it)")
    coord.add_argument("--snapshot-every", type=argtypes.nonneg_seconds, default=None,
                       metavar="S", help="write the full write-ahead snapshot at most every S "
                       "seconds (default 1), a journal segment of the events since before "
                       "other publishes; 0: a full snapshot before every publish")
    coord.add_argument("--wire-json", action="store_true",
                       help="publish proto3 JSON payloads (readable in `nats sub`)")
    coord.add_argument("--report", type=Path, metavar="DIR", help="at the end, write the run "
                       "report (index.html and PNG plots) here (env DDPBUS_REPORT)")
    coord.add_argument("--metrics-port", type=argtypes.port, help="serve Prometheus metrics "
                       "on http://0.0.0.0:PORT/metrics (0: any free port, logged; env "
                       "DDPBUS_METRICS_PORT; default: off)")
    keep = coord.add_argument_group("stream retention (subjects.md, Retention)")
    keep.add_argument("--compact-every", type=argtypes.nonneg_seconds, default=None,
                      metavar="SECONDS", help="purge what no reader needs any more every "
                      "SECONDS (default 60; 0: never, keep the whole history up to the "
                      "stream's limits)")
    keep.add_argument("--keep-history", type=argtypes.nonneg_seconds, default=None,
                      metavar="SECONDS", help="what is younger than this always stays, for "
                      "`ddpbus sub --since`, replay and report (default 1800)")
    keep.add_argument("--stream-max-bytes", type=argtypes.byte_limit, default=None,
                      metavar="BYTES", help="the stream's backstop limit, oldest dropped "
                      "first when full (-1: unlimited; default: as the stream has it, "
                      "unlimited when new); nats-server reserves it against its file store "
                      "up front")
    coord.add_argument("--resume", metavar="SOURCE", help="start from a resume bundle (env "
                       "DDPBUS_RESUME): a bundle directory (or a --bundle-dir / `ddpbus run` "
                       "directory holding one), or the name of an earlier job on this broker "
                       "(its latest bundle); ignored once this job has a snapshot of its own")
    coord.add_argument("spec", nargs="?", help="training spec: file.py:name or module:name "
                       "(env DDPBUS_SPEC)")
    return coord


def run(args: argparse.Namespace) -> int:
    from ddpbus.orchestrator.core import gc_policy
    from ddpbus.orchestrator.core.state import CoreConfig
    from ddpbus.orchestrator.persist import journal
    from ddpbus.orchestrator.runtime.coordinator import Coordinator, CoordinatorSettings
    from ddpbus.orchestrator.runtime.retention import Retention

    flags.require(args, [("--job", "job"), ("--nats", "nats"), ("--world-size", "world_size"),
                         ("SPEC", "spec")], NAME)
    key = flags.read_key(args.key_file)
    spec, schedule = flags.load_schedule(args)
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
    settings = CoordinatorSettings(
        job=args.job, nats=flags.nats_access(args, sj.COORDINATOR), key=key,
        system=flags.system_access(args),
        summary_path=args.summary, events_path=args.events, wire_json=args.wire_json,
        standby=args.standby, lease_ttl=args.lease_ttl or 5.0, resume=args.resume,
        metrics_port=args.metrics_port, report_dir=args.report, retention=retention,
        stream_max_bytes=args.stream_max_bytes,
        snapshot_every=(journal.FULL_EVERY_S if args.snapshot_every is None
                        else args.snapshot_every))
    # everything alive now (the libraries, torch's modules among them, and the spec) lives
    # as long as the process: the cycle collector's full passes stop scanning it (at 1,024
    # ranks each pass held the loop ~100 ms, every few seconds, whatever it was doing);
    # and the passes left (~10 ms) run at quiet moments the coordinator picks, not on
    # whichever allocation crosses the threshold (most often the gate's own decision)
    gc.collect()
    gc.freeze()
    gc_policy.take_full_passes()
    return asyncio.run(Coordinator(settings, config).run())
