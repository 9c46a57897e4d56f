"""The ``ddpbus`` command line.

Settings come from flags, then ``DDPBUS_*`` environment variables, then defaults; an
unknown ``DDPBUS_*`` variable or a bad value is refused before anything starts (exit 2).
This is the only module that reads ``os.environ``.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from ddpbus.codecs import subjects as sj
from ddpbus.codecs.errors import ConfigError, DdpbusError
from ddpbus.orchestrator import commands
from ddpbus.orchestrator.auth import COORDINATOR, Access, write_credentials
from ddpbus.orchestrator.auth import ENV as NATS_AUTH_ENV
from ddpbus.orchestrator.broker import BrokerConfig, EmbeddedBroker

log = logging.getLogger("ddpbus.cli")

# flag dest -> environment variable, per subcommand
ENV_VARS: dict[str, dict[str, str]] = {
    "broker": {
        "host": "DDPBUS_BROKER_HOST",
        "port": "DDPBUS_BROKER_PORT",
        "store": "DDPBUS_BROKER_STORE",
        "config": "DDPBUS_BROKER_CONFIG",
        "max_payload": "DDPBUS_BROKER_MAX_PAYLOAD",
        "monitor_port": "DDPBUS_BROKER_MONITOR_PORT",
        "auth": "DDPBUS_BROKER_AUTH",
        "job": "DDPBUS_JOB",
        "world_size": "DDPBUS_WORLD_SIZE",
        "tls_cert": "DDPBUS_BROKER_TLS_CERT",
        "tls_key": "DDPBUS_BROKER_TLS_KEY",
        "tls_ca": "DDPBUS_BROKER_TLS_CA",
    },
    "init-job": {
        "job": "DDPBUS_JOB",
        "nats": "DDPBUS_NATS_URL",
        "world_size": "DDPBUS_WORLD_SIZE",
        **{f"nats_{field}": var for field, var in NATS_AUTH_ENV.items()},
    },
    "delete-job": {
        "job": "DDPBUS_JOB",
        "nats": "DDPBUS_NATS_URL",
        **{f"nats_{field}": var for field, var in NATS_AUTH_ENV.items()},
    },
    **commands.ENV_VARS,
}
GLOBAL_ENV = {"DDPBUS_LOG_LEVEL"}


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0-65535; 0 = any free port)")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _job(text: str) -> str:
    try:
        return sj.check_job(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddpbus", description="Data-parallel PyTorch training orchestrated over NATS.")
    parser.add_argument("--log-level", default=None,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="log level (env DDPBUS_LOG_LEVEL; default INFO)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    broker = sub.add_parser("broker", help="run the embedded nats-server with JetStream",
                            description="Run the nats-server shipped with ddpbus, with "
                            "JetStream; prints its URL, stops cleanly on SIGINT/SIGTERM.")
    broker.add_argument("--host", help="listen address (default 127.0.0.1)")
    broker.add_argument("--port", type=_port, help="client port; 0 picks a free one (default)")
    broker.add_argument("--store", type=Path, help="JetStream store directory "
                        "(default: a temporary directory removed on exit)")
    broker.add_argument("--config", type=Path, help="extra nats-server config file, included "
                        "after ddpbus's settings")
    broker.add_argument("--max-payload", type=_positive, help="server max_payload in bytes "
                        "(default 8 MiB)")
    broker.add_argument("--monitor-port", type=_port, help="HTTP monitoring port (0 = free)")
    sec = broker.add_argument_group("security")
    sec.add_argument("--auth", type=Path, metavar="DIR", help="admit only the identities of "
                     "--job (coordinator, observer, rank-0 .. rank-N-1), each with its own "
                     "nkey and subject permissions: seeds <identity>.nk are made in DIR "
                     "(kept when present) with authorization.conf")
    sec.add_argument("--job", type=_job, help="with --auth: the job (env DDPBUS_JOB)")
    sec.add_argument("--world-size", type=_positive, help="with --auth: its number of ranks "
                     "(env DDPBUS_WORLD_SIZE)")
    sec.add_argument("--resume-from", action="append", default=[], type=_job, metavar="JOB",
                     help="with --auth: an earlier job on this broker whose bundles the job "
                     "may read (coordinator --resume JOB); repeatable")
    sec.add_argument("--tls-cert", type=Path, metavar="FILE", help="server certificate: "
                     "clients must connect with TLS")
    sec.add_argument("--tls-key", type=Path, metavar="FILE", help="its private key")
    sec.add_argument("--tls-ca", type=Path, metavar="FILE", help="CA of client "
                     "certificates: clients must present one (mutual TLS)")

    init = sub.add_parser("init-job", help="create a job's stream, KV bucket, Object Stores "
                          "and consumers",
                          description="Create (or update) the JetStream stream, KV bucket, "
                          "Object Stores (rounds and bundles) and durable consumers of one "
                          "job, per subjects.md. Idempotent.")
    init.add_argument("--job", type=_job, help="job name (env DDPBUS_JOB)")
    init.add_argument("--nats", help="NATS URL (env DDPBUS_NATS_URL)")
    init.add_argument("--world-size", type=_positive, help="number of ranks "
                      "(env DDPBUS_WORLD_SIZE)")
    commands.nats_auth_flags(init)

    delete = sub.add_parser(
        "delete-job", help="delete a finished job's stream, KV bucket and Object Stores",
        description="Delete everything a job holds on the broker: its stream, KV bucket and "
        "the Object Stores of its rounds and resume bundles (status, replay, report and "
        "--resume JOB read them: delete a job once nothing needs its record). Refuses a "
        "running job (its lease held, or a beat heard within 2.5 s) and, without --force, "
        "one that has not finished (no run summary). Files under a --bundle-dir stay.")
    delete.add_argument("--job", type=_job, help="job name (env DDPBUS_JOB)")
    delete.add_argument("--nats", help="NATS URL (env DDPBUS_NATS_URL)")
    delete.add_argument("--force", action="store_true", help="delete a job that has not "
                        "finished too (never a running one)")
    delete.add_argument("--dry-run", action="store_true", help="say what would be deleted, "
                        "delete nothing")
    commands.nats_auth_flags(delete)
    commands.add_parsers(sub)
    return parser


def _flags(parser: argparse.ArgumentParser, command: str) -> dict[str, argparse.Action]:
    """The flags (and positionals) of one subcommand, by destination."""
    for action in parser._actions:  # argparse lists its subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            return {a.dest: a for a in action.choices[command]._actions}
    raise AssertionError("ddpbus's parser has no subcommands")


def _from_env(flag: argparse.Action, text: str) -> Any:
    """A variable's value, converted and checked exactly as its flag's would be."""
    value = flag.type(text) if callable(flag.type) else text
    if flag.choices is not None and value not in flag.choices:
        raise ValueError(f"not one of {', '.join(map(str, flag.choices))}")
    return value


def merge_env(parser: argparse.ArgumentParser, args: argparse.Namespace,
              environ: Mapping[str, str]) -> argparse.Namespace:
    """Fill unset flags from ``DDPBUS_*`` variables; refuse unknown ones."""
    known = GLOBAL_ENV | {v for table in ENV_VARS.values() for v in table.values()}
    unknown = sorted(k for k in environ if k.startswith("DDPBUS_") and k not in known)
    if unknown:
        parser.error(f"unknown environment variable(s) {', '.join(unknown)}; "
                     f"known: {', '.join(sorted(known))}")
    if args.log_level is None:
        # `ddpbus run` shows its own progress and table; its processes log to files
        quiet = "WARNING" if args.command == "run" else "INFO"
        args.log_level = environ.get("DDPBUS_LOG_LEVEL", quiet).upper()
        levels = next(a.choices for a in parser._actions if a.dest == "log_level")
        if levels is not None and args.log_level not in levels:
            parser.error(f"DDPBUS_LOG_LEVEL={environ['DDPBUS_LOG_LEVEL']!r}: not one of "
                         f"{', '.join(levels)}")
    flags = _flags(parser, args.command)
    for dest, var in ENV_VARS.get(args.command, {}).items():
        if getattr(args, dest, None) is None and var in environ:
            try:
                setattr(args, dest, _from_env(flags[dest], environ[var]))
            except (ValueError, argparse.ArgumentTypeError) as exc:
                parser.error(f"{var}={environ[var]!r}: {exc}")
    return args


def _catch_stop_signals() -> Callable[[], int]:
    """Catch SIGINT and SIGTERM from now on; returns a wait for the first one (its number).
    Installed before anything is announced, so a signal right after the announcement is
    never the default action (death by signal)."""
    got = threading.Event()
    which: list[int] = []

    def handler(signum: int, _frame: FrameType | None) -> None:
        which.append(signum)
        got.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)

    def wait() -> int:
        got.wait()
        return which[0]

    return wait


def _broker_auth(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Path | None:
    if args.auth is None:
        if args.resume_from:
            parser.error("--resume-from goes with --auth")
        return None
    missing = [f for f, v in (("--job", args.job), ("--world-size", args.world_size))
               if v is None]
    if missing:
        parser.error(f"--auth needs {' and '.join(missing)} (or their DDPBUS_* variables)")
    creds = write_credentials(args.auth, args.job, args.world_size,
                              resume_from=args.resume_from)
    log.info("identities of job %s: %s (nkey seeds in %s)", args.job,
             ", ".join(creds.identities), creds.directory)
    return creds.config


def run_broker(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    config = BrokerConfig(
        auth_file=_broker_auth(parser, args),
        tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca,
        host=args.host or "127.0.0.1",
        port=args.port if args.port is not None else 0,
        store_dir=args.store,
        config_file=args.config,
        max_payload=args.max_payload or BrokerConfig.max_payload,
        monitor_port=args.monitor_port,
    )
    broker = EmbeddedBroker(config)
    wait_for_stop = _catch_stop_signals()
    broker.start()
    try:
        sys.stdout.write(broker.url + "\n")
        sys.stdout.flush()
        log.info("nats-server %s ready at %s (store %s, log %s)", broker.binary, broker.url,
                 broker.store_dir, broker.log_path)
        signum = wait_for_stop()
        log.info("received %s; stopping nats-server", signal.Signals(signum).name)
    finally:
        rc = broker.stop()
    if rc not in (0, None, -signal.SIGTERM):
        log.error("nats-server exited with status %s", rc)
        return 1
    return 0


async def _init_job(nats: Access, job: str, world_size: int) -> str:
    from ddpbus.orchestrator.provision import ensure_job

    nc = await nats.connect(job, name=f"ddpbus-init-{job}")
    try:
        res = await ensure_job(nc.jetstream(), job, world_size)
    finally:
        await nc.close()
    return (f"stream {res.stream}, bucket {res.bucket}, consumers "
            f"{', '.join(res.consumers)}")


def run_init_job(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    missing = [flag for flag, value in (("--job", args.job), ("--nats", args.nats),
                                        ("--world-size", args.world_size)) if value is None]
    if missing:
        parser.error(f"init-job needs {', '.join(missing)} (or their DDPBUS_* variables)")
    # provisioning takes the coordinator's rights
    access = commands.nats_access(args, COORDINATOR)
    sys.stdout.write(asyncio.run(_init_job(access, args.job, args.world_size)) + "\n")
    return 0


def run_delete_job(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from ddpbus.orchestrator import teardown

    missing = [flag for flag, value in (("--job", args.job), ("--nats", args.nats))
               if value is None]
    if missing:
        parser.error(f"delete-job needs {', '.join(missing)} (or their DDPBUS_* variables)")
    # the coordinator's rights cover its job's streams, and only those
    lines = asyncio.run(teardown.delete(commands.nats_access(args, COORDINATOR), args.job,
                                        force=args.force, dry_run=args.dry_run))
    sys.stdout.write("".join(f"{line}\n" for line in lines))
    return 0


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    parser = build_parser()
    args = merge_env(parser, parser.parse_args(argv), os.environ if environ is None else environ)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # `kill -USR1 <pid>` prints every thread's stack to stderr: a hung process explains itself
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        if args.command == "broker":
            return run_broker(parser, args)
        runners = {"coordinator": commands.run_coordinator,
                   "worker": commands.run_worker, "run": commands.run_local,
                   "sub": commands.run_sub, "status": commands.run_status,
                   "replay": commands.run_replay, "report": commands.run_report,
                   "simulate": commands.run_simulate}
        if args.command in runners:
            return runners[args.command](args)
        if args.command == "delete-job":
            return run_delete_job(parser, args)
        return run_init_job(parser, args)
    except ConfigError as exc:
        parser.error(str(exc))
    except DdpbusError as exc:
        log.error("%s", exc)  # noqa: TRY400 - a known failure, said in one line
        return 1


if __name__ == "__main__":
    sys.exit(main())
