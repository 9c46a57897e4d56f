"""NATS authentication for one job: identities, their permissions, credentials, TLS.

A job has ``coordinator``, one ``rank-<N>`` per rank and ``observer`` (read-only: ``ddpbus
sub``, ``status``, ``replay``, ``report`` and the ``ddpbus run`` monitor). Each may publish
and subscribe exactly what its role needs (subjects.md, "Identities and permissions"):

- the coordinator publishes ``control.>``, ``admit.>``, ``live.coordinator`` and
  ``data.consensus`` and reads ``timing.>``, ``metrics.>``, ``join.>``, ``live.>`` and
  ``data.rank.*``; it manages the job's stream, KV bucket and Object Stores;
- rank N publishes only ``timing``, ``metrics``, ``join``, ``live`` and ``data`` of rank N,
  and reads only its own ``control.rank.N``, ``admit.rank.N``, ``control.all``,
  ``live.coordinator`` and ``data.consensus``; on JetStream it may read its own durable
  consumer (never create or change one), write only its own generation counter, the
  rendezvous keys and the bundle manifest in KV, and use the two Object Stores;
- the observer subscribes to ``ddpbus.<job>.>`` and may read the job's resources, with
  ddpbus's tools or natscli's stream readers (``nats stream view``, ``nats sub --stream``,
  ``nats consumer next``, given ``--inbox-prefix _INBOX.<job>.observer``): it may create,
  pull from, ack and delete consumers of its own on the job's stream, by any name but the
  job's durables (the coordinator's and each rank's: a pull or an ack there would take
  their messages), which its publish deny list names.

Every identity gets its own reply-inbox prefix (``_INBOX.<job>.<identity>``): a rank cannot
read the replies, and so the pull-consumer deliveries, of another.

:func:`write_credentials` makes an nkey per identity (the server's config holds only the
public keys) and the ``authorization`` block ``ddpbus broker --auth`` includes; the Helm
chart renders the same permissions with passwords. :class:`NatsAuth` is a client's side.
"""

from __future__ import annotations

import json
import os
import secrets
import ssl
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Final

import nkeys
from nats.aio.client import Client

from ddpbus.codecs import subjects as sj
from ddpbus.codecs.errors import ConfigError
from ddpbus.orchestrator.transport import bus

COORDINATOR: Final = sj.COORDINATOR
OBSERVER: Final = "observer"
AUTH_CONF: Final = "authorization.conf"
SEED_SUFFIX: Final = ".nk"


def identities(world_size: int) -> list[str]:
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    return [COORDINATOR, OBSERVER, *(sj.rank_consumer(r) for r in range(world_size))]


@dataclass(frozen=True, slots=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    publish_deny: tuple[str, ...] = ()  # carved out of a wildcard of ``publish``

    def as_config(self) -> dict[str, Any]:
        """The nats-server ``permissions`` value: allow lists (what is not listed is
        refused) and, for publishing only, a deny list (a subscribe deny would be checked at
        delivery and could drop a message the role needs)."""
        publish: dict[str, list[str]] = {"allow": list(self.publish)}
        if self.publish_deny:
            publish["deny"] = list(self.publish_deny)
        return {"publish": publish, "subscribe": {"allow": list(self.subscribe)}}


def durable_deny(stream: str, consumer: str) -> list[str]:
    """What nobody but its owner may do to the durable ``consumer`` of ``stream``: create or
    change it, pull from it, ack its deliveries, delete it."""
    return [f"$JS.API.CONSUMER.CREATE.{stream}.{consumer}",
            f"$JS.API.CONSUMER.CREATE.{stream}.{consumer}.>",
            f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{consumer}",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}",
            f"$JS.API.CONSUMER.DELETE.{stream}.{consumer}",
            f"$JS.ACK.{stream}.{consumer}.>"]


def observer_stream_reads(stream: str) -> list[str]:
    """The JetStream calls of natscli's and nats.py's stream readers on ``stream``:
    consumers by name (the current API: ``CONSUMER.CREATE.<stream>.<name>[.<filter>]``) or
    the legacy ephemeral create, pulls, acks, flow control and clean-up."""
    return ["$JS.API.INFO", f"$JS.API.STREAM.INFO.{stream}",
            f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}.*",
            f"$JS.API.CONSUMER.CREATE.{stream}.*.>", f"$JS.API.CONSUMER.INFO.{stream}.*",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.*", f"$JS.API.CONSUMER.DELETE.{stream}.*",
            f"$JS.ACK.{stream}.>", f"$JS.FC.{stream}.>",
            f"$JS.API.DIRECT.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}.>"]


def _streams(job: str) -> dict[str, str]:
    rounds, bundles = sj.rounds_bucket(job), sj.bundles_bucket(job)
    return {"stream": sj.stream_name(job), "kv": sj.kv_stream(job), "rounds": f"OBJ_{rounds}",
            "bundles": f"OBJ_{bundles}"}


def _read_objects(job: str) -> list[str]:
    """What reading a job's two Object Stores takes: bucket info, the meta lookup (nats-py
    gets it with a stream-message get, which names no subject) and an ephemeral ordered
    consumer over the chunks (the exact ephemeral create subject: no durable can be made or
    changed through it)."""
    out = ["$JS.API.STREAM.NAMES"]  # nats-py finds a chunk subject's stream by name lookup
    for name in (_streams(job)["rounds"], _streams(job)["bundles"]):
        out += [f"$JS.API.STREAM.INFO.{name}", f"$JS.API.STREAM.MSG.GET.{name}",
                f"$JS.API.DIRECT.GET.{name}.>",
                f"$JS.API.CONSUMER.CREATE.{name}", f"$JS.API.CONSUMER.DELETE.{name}.>",
                f"$JS.FC.{name}.>"]
    return out


def _read_kv(job: str) -> list[str]:
    """Key reads (direct get) and key listing (an ephemeral ordered consumer)."""
    kv = _streams(job)["kv"]
    return [f"$JS.API.STREAM.INFO.{kv}", f"$JS.API.DIRECT.GET.{kv}.>",
            f"$JS.API.CONSUMER.CREATE.{kv}", f"$JS.API.CONSUMER.DELETE.{kv}.>",
            f"$JS.FC.{kv}.>"]


def permissions(job: str, identity: str, *, resume_from: Sequence[str] = (),
                world_size: int = 0) -> Permissions:
    """The allow lists of ``identity`` in ``job``; ``resume_from``: earlier jobs on the same
    broker whose bundles this run may read (``--resume JOB``); ``world_size``: its ranks,
    whose durables the observer's deny list names."""
    sj.check_job(job)
    res = _streams(job)
    inbox = f"{sj.inbox_prefix(job, identity)}.>"
    earlier = [x for other in resume_from for x in _read_kv(sj.check_job(other))
               + _read_objects(other)]
    if identity == COORDINATOR:
        pub = [sj.job_wildcard(job, "control"), sj.job_wildcard(job, "admit"),
               sj.LIVE_COORDINATOR.subject(job), sj.DATA_CONSENSUS.subject(job),
               "$JS.API.INFO", "$JS.API.STREAM.NAMES"]
        for name in res.values():
            pub += [f"$JS.API.STREAM.*.{name}", f"$JS.API.STREAM.MSG.*.{name}",
                    f"$JS.API.CONSUMER.*.{name}", f"$JS.API.CONSUMER.*.{name}.>",
                    f"$JS.API.CONSUMER.DURABLE.CREATE.{name}.>",
                    f"$JS.API.CONSUMER.MSG.NEXT.{name}.>", f"$JS.API.DIRECT.GET.{name}",
                    f"$JS.API.DIRECT.GET.{name}.>", f"$JS.ACK.{name}.>", f"$JS.FC.{name}.>"]
        pub += [f"$KV.{sj.kv_bucket(job)}.>", f"$O.{sj.rounds_bucket(job)}.>",
                f"$O.{sj.bundles_bucket(job)}.>", *earlier]
        sub = [sj.job_wildcard(job, "timing"), sj.job_wildcard(job, "metrics"),
               sj.job_wildcard(job, "join"), sj.job_wildcard(job, "live"),
               sj.DATA_RANK.wildcard(job), inbox]
        return Permissions(_unique(pub), _unique(sub))
    if identity == OBSERVER:
        stream = res["stream"]
        pub = [*observer_stream_reads(stream), *_read_kv(job), *_read_objects(job), *earlier]
        deny = [x for name in (sj.COORDINATOR_CONSUMER, *(sj.rank_consumer(r)
                                                         for r in range(world_size)))
                for x in durable_deny(stream, name)]
        return Permissions(_unique(pub), (sj.job_wildcard(job), inbox), _unique(deny))
    rank = sj.sender_rank(identity)
    if rank is None or identity != sj.rank_consumer(rank):
        raise ConfigError(f"unknown identity {identity!r}: coordinator, observer or rank-<N>")
    me, stream, kv = sj.rank_consumer(rank), res["stream"], sj.kv_bucket(job)
    pub = [spec.subject(job, rank) for spec in (sj.TIMING_RANK, sj.METRICS_RANK, sj.JOIN_RANK,
                                                 sj.LIVE_RANK, sj.DATA_RANK)]
    pub += [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.CONSUMER.INFO.{stream}.{me}",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{me}", f"$JS.ACK.{stream}.{me}.>",
            *_read_kv(job), f"$KV.{kv}.generation.{me}", f"$KV.{kv}.td.>",
            f"$KV.{kv}.{sj.LATEST_BUNDLE_KEY}", *_read_objects(job),
            f"$O.{sj.rounds_bucket(job)}.>", f"$O.{sj.bundles_bucket(job)}.>",
            f"$JS.API.STREAM.PURGE.{res['rounds']}", f"$JS.API.STREAM.PURGE.{res['bundles']}",
            *earlier]
    sub = [sj.CONTROL_RANK.subject(job, rank), sj.ADMIT_RANK.subject(job, rank),
           sj.CONTROL_ALL.subject(job), sj.LIVE_COORDINATOR.subject(job),
           sj.DATA_CONSENSUS.subject(job), inbox]
    return Permissions(_unique(pub), _unique(sub))


def _unique(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


# ------------------------------------------------------------------ credentials


def seed_path(directory: Path, identity: str) -> Path:
    return directory / f"{identity}{SEED_SUFFIX}"


def ensure_seed(path: Path) -> bytes:
    """The user nkey seed in ``path``, made (mode 0600) when the file does not exist."""
    if path.exists():
        seed = path.read_bytes().strip()
        try:
            nkeys.from_seed(bytearray(seed)).public_key  # noqa: B018 - validates the seed
        except nkeys.NkeysError as exc:
            raise ConfigError(f"{path} does not hold an nkey seed: {exc!r}") from None
        return seed
    seed = bytes(nkeys.encode_seed(secrets.token_bytes(32), nkeys.PREFIX_BYTE_USER))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(seed + b"\n")
    return seed


def public_key(seed: bytes) -> str:
    return bytes(nkeys.from_seed(bytearray(seed)).public_key).decode()


@dataclass(frozen=True, slots=True)
class Credentials:
    directory: Path
    config: Path  # the nats-server ``authorization`` block to include
    identities: tuple[str, ...]

    def seed(self, identity: str) -> Path:
        return seed_path(self.directory, identity)


def write_credentials(directory: Path, job: str, world_size: int, *,
                      resume_from: Sequence[str] = ()) -> Credentials:
    """An nkey seed per identity of ``job`` in ``directory`` (existing ones are kept, so a
    restarted broker admits the same processes) and ``authorization.conf`` naming each
    public key with its permissions. Nothing else may connect to a broker that includes
    it: there is no anonymous user."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    names = identities(world_size)
    users = [{"nkey": public_key(ensure_seed(seed_path(directory, name))),
              "permissions": permissions(job, name, resume_from=resume_from,
                                         world_size=world_size).as_config()}
             for name in names]
    # the nats-server config format accepts JSON values
    text = ("# generated by ddpbus for job " + job + ": one nkey user per identity\n"
            "authorization " + json.dumps({"users": users}, indent=1) + "\n")
    config = directory / AUTH_CONF
    tmp = config.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.chmod(0o600)
    os.replace(tmp, config)
    return Credentials(directory, config, tuple(names))


# ---------------------------------------------------------------------- client


@dataclass(frozen=True, kw_only=True)
class NatsAuth:
    """How a client proves who it is, and trusts the server.

    At most one of ``nkey`` (a seed file, as ``ddpbus broker --auth`` writes), ``creds`` (a
    JWT ``.creds`` file, for operator-mode servers) and ``user`` + ``password_file``;
    ``tls_ca`` verifies the server, ``tls_cert`` + ``tls_key`` are a client certificate
    (mutual TLS). Credentials inside the URL (``nats://user:pass@host``) also work.
    """

    nkey: Path | None = None
    creds: Path | None = None
    user: str | None = None
    password_file: Path | None = None
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None

    def __post_init__(self) -> None:
        chosen = [n for n, v in (("nkey", self.nkey), ("creds", self.creds),
                                 ("user", self.user)) if v is not None]
        if len(chosen) > 1:
            raise ConfigError(f"choose one way to authenticate, not {' and '.join(chosen)}")
        if (self.user is None) != (self.password_file is None):
            raise ConfigError("a NATS user needs a password file and a password file a user")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("a client TLS certificate needs its key, and the key its "
                              "certificate")
        for name in ("nkey", "creds", "password_file", "tls_ca", "tls_cert", "tls_key"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"NATS {name.removesuffix('_file').replace('_', ' ')} file "
                                  f"{path} does not exist")
        if self.nkey is not None:
            seed = self.nkey.read_bytes().strip()
            try:
                nkeys.from_seed(bytearray(seed)).public_key  # noqa: B018 - validates the seed
            except nkeys.NkeysError:
                raise ConfigError(f"NATS nkey file {self.nkey} does not hold an nkey seed "
                                  "(one line, S...)") from None
        if self.tls:
            try:
                self._tls_context()
            except (ssl.SSLError, OSError, ValueError) as exc:
                raise ConfigError(f"NATS TLS files do not load: {exc}") from None

    @property
    def tls(self) -> bool:
        return self.tls_ca is not None or self.tls_cert is not None

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.connect`` (secrets read now, never logged)."""
        opts: dict[str, Any] = {}
        if self.nkey is not None:
            opts["nkeys_seed_str"] = self.nkey.read_text().strip()
        if self.creds is not None:
            opts["user_credentials"] = str(self.creds)
        if self.user is not None and self.password_file is not None:
            opts["user"] = self.user
            opts["password"] = self.password_file.read_text().strip()
        if self.tls:
            opts["tls"] = self._tls_context()
        return opts

    def _tls_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.tls_ca) if self.tls_ca else None)
        if self.tls_cert is not None and self.tls_key is not None:
            ctx.load_cert_chain(str(self.tls_cert), str(self.tls_key))
        return ctx

    def env(self) -> dict[str, str]:
        """The ``DDPBUS_NATS_*`` variables that give a child process these settings."""
        return {var: str(getattr(self, field)) for field, var in ENV.items()
                if getattr(self, field) is not None}


ENV: Final = {"nkey": "DDPBUS_NATS_NKEY", "creds": "DDPBUS_NATS_CREDS",
              "user": "DDPBUS_NATS_USER", "password_file": "DDPBUS_NATS_PASSWORD_FILE",
              "tls_ca": "DDPBUS_NATS_TLS_CA", "tls_cert": "DDPBUS_NATS_TLS_CERT",
              "tls_key": "DDPBUS_NATS_TLS_KEY"}
"""Client settings by environment variable (every command that connects reads them)."""


@dataclass(frozen=True, kw_only=True)
class Access:
    """Where a process reaches NATS and as whom: the URL, its credentials and its
    identity in the job (which names its reply inbox)."""

    url: str
    auth: NatsAuth | None = None
    identity: str = OBSERVER
    connect_within: float | None = None
    """seconds to keep trying the first connect (None: the bus's default, 30 s)"""

    def as_identity(self, identity: str) -> Access:
        return replace(self, identity=identity)

    async def connect(self, job: str, *, name: str, **options: Any) -> Client:
        if self.connect_within is not None:
            options.setdefault("deadline", timedelta(seconds=self.connect_within))
        return await bus.connect(self.url, name=name, auth=self.auth,
                                 inbox_prefix=sj.inbox_prefix(job, self.identity), **options)


def access(nats: str | Access, identity: str = OBSERVER) -> Access:
    """``nats`` as an :class:`Access` (a bare URL: no credentials, as ``identity``)."""
    return nats if isinstance(nats, Access) else Access(url=nats, identity=identity)


def chart_permissions() -> dict[str, Any]:
    """The permissions of each role with placeholders, for the Helm chart: ``@JOB@`` the job,
    ``@RANK@`` the rank (role ``rank``), and under ``resume`` what ``resume_from=[@RESUME@]``
    adds (the chart appends it, dropping repeats, when ``training.resume`` names a job).
    ``helm/ddpbus/files/permissions.json`` holds this; a chart test keeps them equal."""
    job, rank, earlier = "JOBSENTINEL", 999999, "RESUMESENTINEL"
    marks = {job: "@JOB@", earlier: "@RESUME@", str(rank): "@RANK@"}

    def mark(items: Iterable[str]) -> list[str]:
        out = []
        for item in items:
            text = item
            for value, placeholder in marks.items():
                text = text.replace(value, placeholder)
            out.append(text)
        return out

    roles = {"coordinator": COORDINATOR, "observer": OBSERVER, "rank": sj.rank_consumer(rank)}
    result: dict[str, Any] = {}
    for role, identity in roles.items():
        base = permissions(job, identity)
        more = permissions(job, identity, resume_from=[earlier])
        result[role] = {
            "publish": mark(base.publish), "subscribe": mark(base.subscribe),
            "resume": {"publish": mark(x for x in more.publish if x not in base.publish),
                       "subscribe": mark(x for x in more.subscribe if x not in base.subscribe)}}
    # the observer's deny list: the coordinator's durable, and per rank (the chart repeats
    # "perRank" for each, @RANK@ filled in)
    observer = permissions(job, OBSERVER)
    result["observer"]["publishDeny"] = mark(observer.publish_deny)
    result["observer"]["publishDenyPerRank"] = mark(
        durable_deny(sj.stream_name(job), sj.rank_consumer(rank)))
    return result
