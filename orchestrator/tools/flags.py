"""Flag groups more than one subcommand shares, and the checks that go with them: the NATS
login, the job a command works on, the schedule overrides, the job key."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ddpbus.codecs import subjects as sj
from ddpbus.codecs.envelope import MIN_KEY_BYTES
from ddpbus.codecs.errors import ConfigError
from ddpbus.orchestrator.core.config import KNOBS, Schedule, parse_knob_assignments
from ddpbus.orchestrator.tools import argtypes
from ddpbus.orchestrator.transport.auth import ENV as NATS_AUTH_ENV
from ddpbus.orchestrator.transport.auth import Access, NatsAuth

POLICIES = ("sync", "cadence", "async")
BACKENDS = ("auto", "nccl", "gloo", "broker")

# flag dest -> environment variable of the NATS login, for every command that connects
NATS_LOGIN_ENV = {f"nats_{field}": var for field, var in NATS_AUTH_ENV.items()}
# ... and of a command that reads one job
READER_ENV = {"job": "DDPBUS_JOB", "nats": "DDPBUS_NATS_URL", "key_file": "DDPBUS_KEY_FILE",
              "timeout": "DDPBUS_TIMEOUT", **NATS_LOGIN_ENV}
# how long a command that reads (or deletes) a job tries to reach NATS: a person is waiting;
# init-job, often an init container, 30 s; the job's own processes wait longer still (a
# coordinator 30 s, a worker 300 s for its job to be there: pods start in any order)
TIMEOUT_S = 5.0
INIT_TIMEOUT_S = 30.0


def nats_login(p: argparse.ArgumentParser) -> None:
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
    within = getattr(args, "timeout", None)
    if within is None:
        within = getattr(args, "timeout_default", None)
    return Access(url=args.nats, auth=auth, identity=identity, connect_within=within)


def system_access(args: argparse.Namespace) -> Access | None:
    """The coordinator's system-account login (``--nats-system-nkey``, ``-creds`` or
    ``-user`` with ``-password-file``), on the job's URL with its TLS settings; None
    without one."""
    nkey, creds = getattr(args, "nats_system_nkey", None), getattr(args, "nats_system_creds",
                                                                   None)
    user = getattr(args, "nats_system_user", None)
    password = getattr(args, "nats_system_password_file", None)
    given = [n for n, v in (("--nats-system-nkey", nkey), ("--nats-system-creds", creds),
                            ("--nats-system-user", user)) if v is not None]
    if not given and password is None:
        return None
    if len(given) > 1:
        raise ConfigError(f"choose one system-account login, not {' and '.join(given)}")
    if (user is None) != (password is None):
        raise ConfigError("--nats-system-user needs --nats-system-password-file, and the "
                          "password file a user")
    auth = NatsAuth(nkey=nkey, creds=creds, user=user, password_file=password,
                    tls_ca=getattr(args, "nats_tls_ca", None),
                    tls_cert=getattr(args, "nats_tls_cert", None),
                    tls_key=getattr(args, "nats_tls_key", None))
    within = getattr(args, "timeout", None)
    return Access(url=args.nats, auth=auth, identity=sj.SYSTEM, connect_within=within)


def job_and_server(p: argparse.ArgumentParser) -> None:
    p.add_argument("--job", type=argtypes.job, help="job name (env DDPBUS_JOB)")
    p.add_argument("--nats", metavar="URL", help="NATS URL (env DDPBUS_NATS_URL, then "
                   "NATS_URL; default nats://127.0.0.1:4222)")


def timeout(p: argparse.ArgumentParser, default: float = TIMEOUT_S) -> None:
    p.add_argument("--timeout", type=argtypes.positive_float, metavar="SECONDS",
                   help=f"give up reaching NATS after this long (env DDPBUS_TIMEOUT; default "
                   f"{default:g})")
    p.set_defaults(timeout_default=default)  # --timeout stays None: a variable may set it


def reader(p: argparse.ArgumentParser) -> None:
    """What every command that reads a job needs: which job, where, and its key (which
    verifies every message and the coordinator's snapshot)."""
    job_and_server(p)
    p.add_argument("--key-file", type=Path, help="the job key (env DDPBUS_KEY_FILE)")
    timeout(p)
    nats_login(p)


def member(p: argparse.ArgumentParser) -> None:
    """What a process of the job (the coordinator, a worker) needs."""
    job_and_server(p)
    p.add_argument("--key-file", type=Path, help="file holding the job key, >= 16 bytes "
                   "(env DDPBUS_KEY_FILE)")
    p.add_argument("--world-size", type=argtypes.positive, help="number of ranks (env "
                   "DDPBUS_WORLD_SIZE)")
    nats_login(p)


def schedule(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("schedule (overrides the spec)")
    g.add_argument("--policy", choices=POLICIES, help="when to average (env DDPBUS_POLICY)")
    g.add_argument("--backend", choices=BACKENDS, help="how to average: auto = NCCL with "
                   "CUDA, else gloo (env DDPBUS_BACKEND)")
    g.add_argument("--epochs", type=int, help="number of epochs")
    g.add_argument("--batch-size", type=int, help="samples per batch")
    g.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE",
                   help=f"scheduler knob, repeatable; known: {', '.join(KNOBS)}")


def require(args: argparse.Namespace, names: list[tuple[str, str]], command: str) -> None:
    """Refuse a command that lacks a setting: (flag, dest) pairs."""
    missing = [flag for flag, dest in names if getattr(args, dest, None) is None]
    if missing:
        raise ConfigError(f"{command} needs {', '.join(missing)} (or their DDPBUS_* "
                          "variables)")


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


def reader_key(args: argparse.Namespace, command: str) -> bytes:
    """Check a reading command's settings; returns the job key."""
    require(args, [("--job", "job"), ("--nats", "nats")], command)
    return read_key(args.key_file)


def schedule_overrides(args: argparse.Namespace) -> dict[str, Any]:
    over: dict[str, Any] = dict(parse_knob_assignments(list(args.knob or [])))
    for name in ("policy", "backend", "epochs", "batch_size"):
        value = getattr(args, name, None)
        if value is not None:
            over[name] = value
    return over


def load_schedule(args: argparse.Namespace) -> tuple[Any, Schedule]:
    """The user's spec and the schedule it gives under the command's overrides."""
    from ddpbus.worker_agent.spec import load_spec  # torch: only for the commands that train

    spec = load_spec(args.spec)
    return spec, spec.schedule(schedule_overrides(args))
