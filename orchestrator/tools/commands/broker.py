"""``ddpbus broker``: the embedded nats-server with JetStream, optionally locked to one job."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from ddpbus.codecs.errors import ConfigError
from ddpbus.orchestrator.runtime.nats_server import BrokerConfig, EmbeddedBroker
from ddpbus.orchestrator.tools import argtypes
from ddpbus.orchestrator.transport.auth import write_credentials

NAME = "broker"
ENV = {
    "host": "DDPBUS_BROKER_HOST", "port": "DDPBUS_BROKER_PORT",
    "store": "DDPBUS_BROKER_STORE", "config": "DDPBUS_BROKER_CONFIG",
    "max_payload": "DDPBUS_BROKER_MAX_PAYLOAD", "monitor_port": "DDPBUS_BROKER_MONITOR_PORT",
    "auth": "DDPBUS_BROKER_AUTH", "job": "DDPBUS_JOB", "world_size": "DDPBUS_WORLD_SIZE",
    "tls_cert": "DDPBUS_BROKER_TLS_CERT", "tls_key": "DDPBUS_BROKER_TLS_KEY",
    "tls_ca": "DDPBUS_BROKER_TLS_CA", "system_nkey": "DDPBUS_BROKER_SYSTEM_NKEY",
}
log = logging.getLogger("ddpbus.cli")

# shown under the subcommand's --help
EXAMPLES = (
    'ddpbus broker --port 4222 --store /var/lib/ddpbus     # an open broker',
    'ddpbus broker --auth creds/ --job digits --world-size 2  # per-identity logins',
    'ddpbus broker --port 0 --monitor-port 8222              # a free port; /varz',
)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    broker: argparse.ArgumentParser = sub.add_parser(
        NAME, help="run the embedded nats-server with JetStream",
        description="Run the nats-server shipped with ddpbus, with JetStream; prints its URL, "
        "stops cleanly on SIGINT/SIGTERM.")
    broker.add_argument("--host", help="listen address (default 127.0.0.1)")
    broker.add_argument("--port", type=argtypes.port, help="client port; 0 picks a free one "
                        "(default)")
    broker.add_argument("--store", type=Path, help="JetStream store directory "
                        "(default: a temporary directory removed on exit)")
    broker.add_argument("--config", type=Path, help="extra nats-server config file, included "
                        "after ddpbus's settings")
    broker.add_argument("--max-payload", type=argtypes.positive, help="server max_payload in "
                        "bytes (default 8 MiB)")
    broker.add_argument("--monitor-port", type=argtypes.port, help="HTTP monitoring port "
                        "(0 = free)")
    sec = broker.add_argument_group("security")
    sec.add_argument("--auth", type=Path, metavar="DIR", help="admit only the identities of "
                     "--job (coordinator, observer, rank-0 .. rank-N-1), each with its own "
                     "nkey and subject permissions: seeds <identity>.nk are made in DIR "
                     "(kept when present) with authorization.conf")
    sec.add_argument("--job", type=argtypes.job, help="with --auth: the job (env DDPBUS_JOB)")
    sec.add_argument("--world-size", type=argtypes.positive, help="with --auth: its number of "
                     "ranks (env DDPBUS_WORLD_SIZE)")
    sec.add_argument("--resume-from", action="append", default=[], type=argtypes.job,
                     metavar="JOB", help="with --auth: an earlier job on this broker whose "
                     "bundles the job may read (coordinator --resume JOB); repeatable")
    sec.add_argument("--system-nkey", type=Path, metavar="FILE", help="a system-account "
                     "user with the nkey seed in FILE (made when absent), for coordinator "
                     "--nats-system-nkey: it reads the client advisories that tell a killed "
                     "rank at once (default with --auth: DIR/system.nk; without: none)")
    sec.add_argument("--tls-cert", type=Path, metavar="FILE", help="server certificate: "
                     "clients must connect with TLS")
    sec.add_argument("--tls-key", type=Path, metavar="FILE", help="its private key")
    sec.add_argument("--tls-ca", type=Path, metavar="FILE", help="CA of client "
                     "certificates: clients must present one (mutual TLS)")
    return broker


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


def _auth_file(args: argparse.Namespace) -> Path | None:
    if args.auth is None:
        if args.resume_from:
            raise ConfigError("--resume-from goes with --auth")
        return None
    missing = [f for f, v in (("--job", args.job), ("--world-size", args.world_size))
               if v is None]
    if missing:
        raise ConfigError(f"--auth needs {' and '.join(missing)} (or their DDPBUS_* "
                          "variables)")
    creds = write_credentials(args.auth, args.job, args.world_size,
                              resume_from=args.resume_from)
    log.info("identities of job %s: %s (nkey seeds in %s)", args.job,
             ", ".join(creds.identities), creds.directory)
    return creds.config


def _system_seed(args: argparse.Namespace) -> Path | None:
    seed: Path | None = args.system_nkey
    if seed is None and args.auth is not None:
        seed = args.auth / "system.nk"
    if seed is not None:
        log.info("system-account login: %s (coordinator --nats-system-nkey)", seed)
    return seed


def run(args: argparse.Namespace) -> int:
    config = BrokerConfig(
        auth_file=_auth_file(args),
        tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca,
        host=args.host or "127.0.0.1",
        port=args.port if args.port is not None else 0,
        store_dir=args.store,
        config_file=args.config,
        max_payload=args.max_payload or BrokerConfig.max_payload,
        monitor_port=args.monitor_port,
        system_seed=_system_seed(args),
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
