"""The NATS contract in code. ``subjects.md`` at the repository root is its text twin; a
contract test parses that file's tables and checks both directions against these constants.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import timedelta
from functools import lru_cache
from typing import Final, NamedTuple

from ddpbus.codecs.errors import BadSubject, ConfigError, ForeignJob

PREFIX: Final = "ddpbus"
SCHEMA_VERSION: Final = "1"
"""``Ddpbus-Schema``: bumped only for a change old receivers cannot read."""

JOB_PATTERN: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""Job names are one NATS subject token and valid stream/bucket names."""

DUPLICATE_WINDOW: Final = timedelta(minutes=2)
"""JetStream de-duplication window on the job stream (``Nats-Msg-Id``)."""

ALL: Final = "all"
COORDINATOR: Final = "coordinator"
# the coordinator's second login, to the broker's system account (its client advisories)
SYSTEM: Final = "system"
# its client CONNECT and DISCONNECT advisories, $SYS.ACCOUNT.<account>.(DIS)CONNECT
CLIENT_ADVISORIES: Final = "$SYS.ACCOUNT.*.>"


@dataclass(frozen=True, slots=True)
class SubjectSpec:
    """One row of subjects.md's subject table."""

    template: str  # "ddpbus.<job>.control.rank.<N>"
    sender: str  # "coordinator", "rank", "reducer"
    receiver: str
    message: str  # a type family ("ControlMsg") or one type ("TimingMsg.Heartbeat")
    storage: str  # "stream" (JetStream, job stream) or "core" (never stored)
    consumer: str  # who reads it, and how
    kind: str = field(init=False)  # "control.rank", "live.coordinator": no prefix, job, rank
    per_rank: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ".".join(
            t for t in self.template.split(".")[2:] if t != "<N>"))
        object.__setattr__(self, "per_rank", self.template.endswith(".<N>"))

    def allows(self, msg_type: str) -> bool:
        return msg_type == self.message or msg_type.startswith(self.message + ".")

    def subject(self, job: str, rank: int | None = None) -> str:
        check_job(job)
        if self.per_rank:
            if rank is None or rank < 0:
                raise ConfigError(f"{self.template} needs a rank >= 0, got {rank!r}")
            return f"{PREFIX}.{job}.{self.kind}.{rank}"
        if rank is not None:
            raise ConfigError(f"{self.template} takes no rank")
        return f"{PREFIX}.{job}.{self.kind}"

    def wildcard(self, job: str) -> str:
        """A subscription subject matching every rank (or the one subject)."""
        return f"{PREFIX}.{job}.{self.kind}" + (".*" if self.per_rank else "")


CONTROL_RANK: Final = SubjectSpec(
    "ddpbus.<job>.control.rank.<N>", "coordinator", "rank N", "ControlMsg", "stream",
    "durable pull `rank-<N>`")
CONTROL_ALL: Final = SubjectSpec(
    "ddpbus.<job>.control.all", "coordinator", "every rank", "ControlMsg", "stream",
    "durable pull `rank-<N>`")
TIMING_RANK: Final = SubjectSpec(
    "ddpbus.<job>.timing.rank.<N>", "rank", "coordinator", "TimingMsg", "stream",
    "durable pull `coordinator`")
METRICS_RANK: Final = SubjectSpec(
    "ddpbus.<job>.metrics.rank.<N>", "rank", "coordinator", "MetricsMsg", "stream",
    "durable pull `coordinator`")
JOIN_RANK: Final = SubjectSpec(
    "ddpbus.<job>.join.rank.<N>", "rank", "coordinator", "JoinMsg", "stream",
    "durable pull `coordinator`")
ADMIT_RANK: Final = SubjectSpec(
    "ddpbus.<job>.admit.rank.<N>", "coordinator", "rank N", "AdmitMsg", "stream",
    "durable pull `rank-<N>`")
LIVE_RANK: Final = SubjectSpec(
    "ddpbus.<job>.live.rank.<N>", "rank", "coordinator", "TimingMsg.Heartbeat", "core",
    "core subscription")
LIVE_COORDINATOR: Final = SubjectSpec(
    "ddpbus.<job>.live.coordinator", "coordinator", "every rank", "ControlMsg.CoordHeartbeat",
    "core", "core subscription")
DATA_RANK: Final = SubjectSpec(
    "ddpbus.<job>.data.rank.<N>", "rank", "reducer", "TensorFrame", "core",
    "core subscription")
DATA_CONSENSUS: Final = SubjectSpec(
    "ddpbus.<job>.data.consensus", "reducer", "every rank", "TensorFrame", "core",
    "core subscription")

SUBJECTS: Final[tuple[SubjectSpec, ...]] = (
    CONTROL_RANK, CONTROL_ALL, TIMING_RANK, METRICS_RANK, JOIN_RANK, ADMIT_RANK,
    LIVE_RANK, LIVE_COORDINATOR, DATA_RANK, DATA_CONSENSUS,
)
_BY_KIND: Final = {s.kind: s for s in SUBJECTS}


@dataclass(frozen=True, slots=True)
class HeaderSpec:
    """One row of subjects.md's header table."""

    name: str
    value: str
    checked: str


H_TYPE: Final = "Ddpbus-Type"
H_SCHEMA: Final = "Ddpbus-Schema"
H_JOB: Final = "Ddpbus-Job"
H_RANK: Final = "Ddpbus-Rank"
H_GEN: Final = "Ddpbus-Gen"
H_SIG: Final = "Ddpbus-Sig"
H_MSG_ID: Final = "Nats-Msg-Id"
H_CONTENT_TYPE: Final = "Content-Type"
# JetStream's own publish expectations (a conditional write, checked by the server)
H_EXPECT_LAST_SUBJECT_SEQ: Final = "Nats-Expected-Last-Subject-Sequence"
H_EXPECT_LAST_SUBJECT_SEQ_SUBJECT: Final = "Nats-Expected-Last-Subject-Sequence-Subject"

CONTENT_PROTOBUF: Final = "application/protobuf"
CONTENT_JSON: Final = "application/json"

HEADERS: Final[tuple[HeaderSpec, ...]] = (
    HeaderSpec(H_TYPE, "`TimingMsg.Batch`, `ControlMsg.StartEpoch`, `MetricsMsg`, …",
               "a known type that the subject allows"),
    HeaderSpec(H_SCHEMA, "`1`", "equals this build's schema version"),
    HeaderSpec(H_JOB, "the job name", "equals the receiver's job and the subject's job token"),
    HeaderSpec(H_RANK, "`N`, `all` or `coordinator` (the subject's last token)",
               "equals the subject's last token"),
    HeaderSpec(H_GEN, "sender generation, decimal", "not below the receiver's fence"),
    HeaderSpec(H_MSG_ID, "`<sender>.g<gen>.<seq>` on stream subjects (`seq` 1, 2, … over the "
               "sender's stored messages only); `<sender>.g<gen>.c<n>` on core subjects "
               "(`live.*`, `data.*`), counted apart", "JetStream drops duplicates"),
    HeaderSpec(H_CONTENT_TYPE, f"`{CONTENT_PROTOBUF}` (default) or `{CONTENT_JSON}`",
               "one of the two"),
    HeaderSpec(H_SIG, "hex HMAC-SHA256 with the job key", "verifies"),
)


# ------------------------------------------------------------------------- helpers


def check_job(job: str) -> str:
    if not JOB_PATTERN.fullmatch(job):
        raise ConfigError(
            f"job name {job!r} must be 1-64 characters of A-Z a-z 0-9 _ - "
            "(it is a NATS subject token and part of stream and bucket names)"
        )
    return job


def job_wildcard(job: str, *tokens: str) -> str:
    """Every subject of ``job`` (``ddpbus.<job>.>``), or every one under ``tokens``
    (``job_wildcard(job, "live")`` is ``ddpbus.<job>.live.>``): the one place a job's
    wildcards are spelled, for subscriptions and permissions alike."""
    return ".".join((PREFIX, check_job(job), *tokens, ">"))


def stream_name(job: str) -> str:
    return f"DDPBUS_{check_job(job)}"


# Keys of the job's KV bucket (kv_bucket): every key name in one place. subjects.md lists them.
SUMMARY_KEY: Final = "run.summary"  # the run's summary, written once the run is over
CONFIG_KEY: Final = "run.config"  # the run's settings, as the coordinator resolved them
LEASE_KEY: Final = "coordinator.lease"  # the leader lease (compare-and-set)
SNAPSHOT_KEY: Final = "coordinator.snapshot"  # the last full snapshot of the core
JOURNAL_PREFIX: Final = "coordinator.journal"  # journal segments: <prefix>.<base>.<index>
LATEST_BUNDLE_KEY: Final = "bundle.latest"  # the manifest of the newest resume bundle
RESUME_BUNDLE_KEY: Final = "bundle.resume"  # the bundle a resumed run started from
RENDEZVOUS_PREFIX: Final = "td."  # torch.distributed's rendezvous store, base64url keys


def kv_bucket(job: str) -> str:
    return f"ddpbus_{check_job(job)}"


def kv_stream(job: str) -> str:
    """The stream behind the job's KV bucket."""
    return f"KV_{kv_bucket(job)}"


def kv_subject(job: str, key: str) -> str:
    """The subject a key of the job's KV bucket is stored under."""
    return f"$KV.{kv_bucket(job)}.{key}"


def rounds_bucket(job: str) -> str:
    """The Object Store bucket of the broker backend's averaging rounds."""
    return f"{kv_bucket(job)}_rounds"


def bundles_bucket(job: str) -> str:
    """The Object Store bucket of the job's resume bundles."""
    return f"{kv_bucket(job)}_bundles"


def inbox_prefix(job: str, identity: str) -> str:
    """The reply-inbox prefix of one identity (``coordinator``, ``observer``, ``rank-N``) in
    a job: its permissions let it read its own replies and nobody else's."""
    return f"_INBOX.{check_job(job)}.{identity}"


def round_contribution(version: int, rank: int) -> str:
    """Rank ``rank``'s contribution to round ``version`` (an object in :func:`rounds_bucket`)."""
    return f"v{version}.rank{rank}"


def round_consensus(version: int) -> str:
    return f"v{version}.consensus"


def round_version(name: str) -> tuple[int, str] | None:
    """``(version, "consensus" | "rank<N>")`` of a round object's name, None for another."""
    head, _, kind = name.partition(".")
    version = head.removeprefix("v")
    return (int(version), kind) if head.startswith("v") and version.isdigit() else None


class Delivery(NamedTuple):
    stream_seq: int
    stored_at: float  # the store time, epoch seconds (the broker's clock)


def delivery(reply: str | None) -> Delivery | None:
    """A JetStream message's stream sequence and store time, read off the reply subject
    it was delivered with (``$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer
    seq>.<ns>.<pending>``, or the form with a domain and an account hash after ``ACK``, 11
    or 12 tokens): what nats-py's ``msg.metadata`` parses into dataclasses and a datetime,
    at a fraction of the cost (a reader needs it for every message); None for anything
    else."""
    tokens = (reply or "").split(".")
    n = len(tokens)
    if not (n == 9 or n >= 11) or tokens[0] != "$JS" or tokens[1] != "ACK":
        return None
    at = 5 if n == 9 else 7
    try:
        return Delivery(int(tokens[at]), int(tokens[at + 2]) / 1e9)
    except ValueError:
        return None


def stream_subjects(job: str) -> list[str]:
    """What the job's stream captures: every ``storage == "stream"`` subject."""
    return [s.wildcard(job) for s in SUBJECTS if s.storage == "stream"]


def rank_connection_name(job: str, rank: int) -> str:
    """The name a rank's NATS connection gives the broker (its advisories and monitoring
    pages show it; the coordinator reads a reconnect from it)."""
    return f"ddpbus-{job}-rank-{rank}"


def connection_rank(job: str, name: str) -> int | None:
    """The rank :func:`rank_connection_name` gave ``name`` for ``job``, or None."""
    prefix = f"ddpbus-{job}-rank-"
    tail = name[len(prefix):] if name.startswith(prefix) else ""
    return int(tail) if tail.isdigit() and len(tail) <= 6 else None


def rank_consumer(rank: int) -> str:
    return f"rank-{rank}"


class MsgId(NamedTuple):
    sender: str  # "coordinator", "reducer", "rank-N"
    generation: int
    seq: int


def parse_msg_id(msg_id: str) -> MsgId | None:
    """A stream message's ``Nats-Msg-Id`` (``<sender>.g<generation>.<seq>``, ``seq`` dense
    over the sender incarnation's stream messages); None for anything else, a core-NATS
    message's ``.c<n>`` id included (envelope.Encoder)."""
    sender, _, rest = msg_id.partition(".g")
    gen_text, _, seq_text = rest.partition(".")
    if not sender or not (gen_text.isdigit() and seq_text.isdigit()):
        return None
    return MsgId(sender, int(gen_text), int(seq_text))


def sender_rank(sender: str) -> int | None:
    """The rank of a ``rank-N`` sender (the ``Ddpbus-Sender`` header), else None."""
    prefix, _, number = sender.partition("-")
    return int(number) if prefix == "rank" and number.isdigit() else None


COORDINATOR_CONSUMER: Final = "coordinator"


def rank_filters(job: str, rank: int) -> list[str]:
    """A rank's consumer: its own control and admit subjects plus the broadcast, in order."""
    return [CONTROL_RANK.subject(job, rank), CONTROL_ALL.subject(job), ADMIT_RANK.subject(job,
                                                                                         rank)]


def coordinator_filters(job: str) -> list[str]:
    return [TIMING_RANK.wildcard(job), METRICS_RANK.wildcard(job), JOIN_RANK.wildcard(job)]


@dataclass(frozen=True, slots=True)
class ParsedSubject:
    job: str
    spec: SubjectSpec
    token: str  # the last token: the rank as text, "all" or "coordinator"
    rank: int | None
    sender: str = field(init=False)
    """Whose generation fences this message: ``coordinator``, ``reducer`` or ``rank-N``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "sender", f"rank-{self.rank}" if self.spec.sender == "rank"
                           else self.spec.sender)


_RANK_TOKEN: Final = re.compile(r"0|[1-9][0-9]{0,19}")


@lru_cache(maxsize=4096)
def parse_subject(subject: str, job: str | None = None) -> ParsedSubject:
    """Split a subject into job, template and rank; :class:`BadSubject` when it fits none.

    With ``job``, a subject of another job raises :class:`ForeignJob`.
    """
    tokens = subject.split(".")
    if len(tokens) < 3 or tokens[0] != PREFIX or not JOB_PATTERN.fullmatch(tokens[1]):
        raise BadSubject("not a ddpbus subject", subject=subject)
    if job is not None and tokens[1] != job:
        raise ForeignJob(f"subject belongs to job {tokens[1]!r}, not {job!r}", subject=subject)
    rest = tokens[2:]
    spec = _BY_KIND.get(".".join(rest))
    if spec is not None and not spec.per_rank:
        return ParsedSubject(tokens[1], spec, rest[-1], None)
    spec = _BY_KIND.get(".".join(rest[:-1]))
    if spec is None or not spec.per_rank:
        raise BadSubject("matches no template of subjects.md", subject=subject)
    if not _RANK_TOKEN.fullmatch(rest[-1]) or int(rest[-1]) >= 2**64:
        raise BadSubject(f"rank token {rest[-1]!r} is not a canonical u64", subject=subject)
    return ParsedSubject(tokens[1], spec, rest[-1], int(rest[-1]))
