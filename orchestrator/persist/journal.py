"""The write-ahead journal: what the coordinator decided since its last full snapshot.

A full snapshot (:mod:`.snapshot`) costs time linear in the cohort (at 1,024 ranks about
60 ms of encoding), too much to write before every batch of commands while a thousand ranks
report. So a full snapshot is written about once every :data:`FULL_EVERY_S`, at a quiet
moment (once an average is over, every rank's SyncAck read: the ranks train the window
that came with the SyncNow and the next gate, the decision everyone waits for, is a window
away; not while the thousand SyncAcks are coming in, whose reading times the average), or
once :data:`OVERDUE` intervals late whatever is happening; before any other batch of
commands is published the shell stores a *segment*: the events the core applied since
the previous write, each with the ``now`` it was decided at, the stream
sequence they cover, and the batch itself (encoded, with their ``Nats-Msg-Id``). The core
is a pure function of ``(state, event, now)``, so the snapshot plus its segments, replayed
in order, is exactly the state that decided the last stored batch: the write-ahead rule
holds with a write the size of the traffic since the last one, not of the cohort.

Keys (the job's KV bucket): each full snapshot names a fresh journal *base*
(``<generation>.<n>``); its segments are ``coordinator.journal.<base>.<i>``, i = 0, 1, ...
A segment is written only while the snapshot key is still at the revision its writer
stored (``Nats-Expected-Last-Subject-Sequence`` on the snapshot key's subject), so:

- a coordinator taking over first re-writes the snapshot it loaded (compare-and-set), which
  fences its predecessor: that one's next segment or snapshot write fails, and it stops
  before publishing anything more; only then does it read the base's segments, which can
  no longer grow;
- after a full snapshot the keys of every older base are purged.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final

from nats.js.errors import APIError, KeyNotFoundError, KeyWrongLastSequenceError

from ddpbus.codecs import DecodeError, Decoder, Outbound
from ddpbus.codecs import subjects as sj
from ddpbus.codecs.errors import DdpbusError
from ddpbus.orchestrator.core.state import (
    BusRestored,
    Disconnected,
    Event,
    Joined,
    Metrics,
    Reconnected,
    Reduced,
    State,
    Stop,
    Tick,
    Timing,
    event_of,
)
from ddpbus.orchestrator.core.transition import transition
from ddpbus.orchestrator.persist import snapshot
from ddpbus.orchestrator.transport import bus

log = logging.getLogger(__name__)

FULL_EVERY_S: Final = 1.0  # a full snapshot wanted this long after the previous one
OVERDUE: Final = 5.0  # ... and forced this many intervals after it, quiet moment or not
MAX_EVENTS: Final = 50_000  # applied without any write: the next write is a full one
FLUSH_EVENTS: Final = 128  # applied without a command: journal them anyway (so the write
# before the next command, often a window's gate, carries little: at 1,024 ranks a gate's
# segment carried up to ~500 events and took up to 7.5 ms to store at 512, 3.6 ms at 128)
MAX_SEGMENTS: Final = 1_000  # on one base: the next write is a full one
WRONG_LAST_SEQUENCE: Final = 10071  # JetStream's error code for a failed expectation

Retry = Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]]


class Deposed(DdpbusError, RuntimeError):
    """A newer coordinator re-wrote the snapshot: this one must publish nothing more."""


@dataclasses.dataclass(frozen=True, slots=True)
class Wire:
    """A message event as it came off the bus (signed bytes: cheaper to journal than the
    decoded tree, and re-verified when replayed). ``stream``: from the job stream (its
    message id deduplicates); otherwise a live heartbeat."""

    subject: str
    headers: dict[str, str]
    payload: bytes
    stream: bool

    def event(self, decoder: Decoder) -> Event:
        try:
            env = decoder.decode(self.subject, self.headers, self.payload)
        except DecodeError as exc:
            raise snapshot.SnapshotError(f"journal holds a message that does not decode: "
                                         f"{exc}") from None
        return event_of(env.message, env.msg_id if self.stream else "")  # type: ignore[arg-type]


@dataclasses.dataclass(slots=True)
class Segment:
    # (event, the ``now`` it was decided at), in order; a message event as its wire bytes
    events: list[tuple[Event | Wire, float]]
    stream_seq: int  # the last stream input covered once these are applied
    outbox: list[Outbound]  # the commands they led to, in order
    coordinator_generation: int
    saved_at: float


def key(base: str, index: int) -> str:
    return f"{sj.JOURNAL_PREFIX}.{base}.{index}"


def replay(state: State, segments: list[Segment], decoder: Decoder) -> State:
    """``state`` after every segment's events, decided at their recorded times (the
    commands they led to are in the segments: nothing is decided anew)."""
    for seg in segments:
        for item, now in seg.events:
            event = item.event(decoder) if isinstance(item, Wire) else item
            state, _ = transition(state, event, now)
    return state


def extend(snap: snapshot.Snapshot, segments: list[Segment], decoder: Decoder
           ) -> snapshot.Snapshot:
    """The snapshot as of its last segment: the replayed state, the covered sequence, and
    every command that may not be stored yet (the snapshot's outbox, then each segment's
    batch, in order: JetStream drops those already stored, by message id)."""
    if not segments:
        return snap
    last = segments[-1]
    return snapshot.Snapshot(state=replay(snap.state, segments, decoder),
                             stream_seq=last.stream_seq,
                             outbox=[*snap.outbox, *(o for s in segments for o in s.outbox)],
                             coordinator_generation=last.coordinator_generation,
                             saved_at=last.saved_at, journal=snap.journal)


MAGIC: Final = b"DDPBUS-JOURNAL-1\n"
LEVEL: Final = 1  # zlib: a segment is written in front of commands, speed over size
_OTHER_EVENTS: Final = (Tick, Stop, BusRestored, Reduced, Joined, Timing, Metrics,
                        Disconnected, Reconnected)


def encode(seg: Segment, secret: bytes) -> bytes:
    """Signed (HMAC-SHA256 with the job key), zlib-compressed JSON, like a snapshot, but
    flat: a message event is ``[now, subject, headers, payload (base64), stream]`` and a
    command ``[subject, headers, payload]`` (JSON's C encoder does those at once); the
    rare other events (ticks, a stop, a reducer's result) are snapshot trees."""
    return snapshot.seal(MAGIC, document(seg), secret, level=LEVEL)


def document(seg: Segment) -> bytes:
    """The JSON text :func:`encode` compresses and signs."""
    b64 = base64.b64encode
    events: list[list[Any]] = []
    for item, now in seg.events:
        if isinstance(item, Wire):
            events.append([now, item.subject, item.headers, b64(item.payload).decode(),
                           item.stream])
        else:
            events.append([now, snapshot.tree(item)])
    doc = {"stream_seq": seg.stream_seq, "generation": seg.coordinator_generation,
           "saved_at": seg.saved_at, "events": events,
           "outbox": [[o.subject, o.headers, b64(o.payload).decode()] for o in seg.outbox]}
    return snapshot.json_text(doc)


def _strings(headers: Any) -> dict[str, str]:
    if not isinstance(headers, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
        raise snapshot.SnapshotError("journal headers are not a string map")
    return headers


def _bytes(text: Any) -> bytes:
    if not isinstance(text, str):
        raise snapshot.SnapshotError("journal payload is not base64 text")
    try:
        return base64.b64decode(text, validate=True)
    except ValueError as exc:
        raise snapshot.SnapshotError(f"journal payload is not base64: {exc}") from None


def decode(data: bytes, secret: bytes) -> Segment:
    """What :func:`encode` stored; anything else is a :class:`~.snapshot.SnapshotError`."""
    doc = snapshot.verify(MAGIC, data, secret, what="journal segment")
    if not isinstance(doc, dict) or set(doc) != {"stream_seq", "generation", "saved_at",
                                                 "events", "outbox"}:
        raise snapshot.SnapshotError("journal segment is not the expected document")
    if not (type(doc["stream_seq"]) is int and type(doc["generation"]) is int
            and isinstance(doc["saved_at"], int | float)
            and isinstance(doc["events"], list) and isinstance(doc["outbox"], list)):
        raise snapshot.SnapshotError("journal segment fields have the wrong types")
    events: list[tuple[Event | Wire, float]] = []
    for row in doc["events"]:
        if not isinstance(row, list) or len(row) not in (2, 5) or not isinstance(
                row[0], int | float):
            raise snapshot.SnapshotError("malformed journal event")
        if len(row) == 5:
            if not isinstance(row[1], str) or not isinstance(row[4], bool):
                raise snapshot.SnapshotError("malformed journal message event")
            events.append((Wire(row[1], _strings(row[2]), _bytes(row[3]), row[4]),
                           float(row[0])))
        else:
            event = snapshot.untree(row[1])
            if not isinstance(event, _OTHER_EVENTS):
                raise snapshot.SnapshotError(f"journal event is a {type(event).__name__}")
            events.append((event, float(row[0])))
    outbox = []
    for row in doc["outbox"]:
        if not isinstance(row, list) or len(row) != 3 or not isinstance(row[0], str):
            raise snapshot.SnapshotError("malformed journal command")
        outbox.append(Outbound(subject=row[0], headers=_strings(row[1]),
                               payload=_bytes(row[2])))
    return Segment(events=events, stream_seq=doc["stream_seq"], outbox=outbox,
                   coordinator_generation=doc["generation"], saved_at=float(doc["saved_at"]))


async def read(kv: Any, base: str, secret: bytes) -> list[Segment]:
    """The segments of ``base``, from 0 up to the first missing index."""
    out: list[Segment] = []
    if not base:
        return out
    while True:
        try:
            entry = await kv.get(key(base, len(out)))
        except KeyNotFoundError:
            return out
        if not entry.value:
            return out
        out.append(decode(entry.value, secret))


class Writer:
    """Appends segments to the base of the latest full snapshot."""

    def __init__(self, js: Any, job: str, secret: bytes, *,
                 every: float = FULL_EVERY_S) -> None:
        self.js, self.job, self.secret, self.every = js, job, secret, every
        self.base: str | None = None  # None: the next write must be a full snapshot
        self.index = 0
        self.full_at = float("-inf")  # when the base was stored (monotonic seconds)
        self.written = 0  # segments stored, over the coordinator's life

    def wanted(self, now: float) -> bool:
        """A full snapshot is due at the next quiet moment."""
        return now - self.full_at >= self.every

    def full_due(self, now: float, events: int) -> bool:
        """The next write must be a full snapshot, whatever it delays."""
        return (self.base is None or now - self.full_at >= self.every * OVERDUE
                or self.index >= MAX_SEGMENTS or events > MAX_EVENTS)

    def force_full(self) -> None:
        self.base = None

    async def rebased(self, base: str, now: float) -> None:
        """A full snapshot naming ``base`` is stored: drop every older base's segments
        (none of ``base`` exists yet: the committer writes them after this returns)."""
        self.base, self.index, self.full_at = base, 0, now
        try:
            await self.js.purge_stream(sj.kv_stream(self.job),
                                       subject=sj.kv_subject(self.job, f"{sj.JOURNAL_PREFIX}.>"))
        except (OSError, TimeoutError, APIError) as exc:  # garbage, purged next time
            log.warning("could not purge old journal segments: %s", exc)

    async def append(self, seg: Segment, snapshot_rev: int, retry: Retry) -> None:
        """Store ``seg`` as the base's next segment, if the snapshot key is still at
        ``snapshot_rev`` (:class:`Deposed` otherwise)."""
        if self.base is None:
            raise RuntimeError("no full snapshot to extend")
        name = key(self.base, self.index)
        payload = await snapshot.seal_in_thread(MAGIC, document(seg), self.secret, level=LEVEL)
        out = Outbound(subject=sj.kv_subject(self.job, name), payload=payload,
                       headers={sj.H_EXPECT_LAST_SUBJECT_SEQ: str(snapshot_rev),
                                sj.H_EXPECT_LAST_SUBJECT_SEQ_SUBJECT:
                                    sj.kv_subject(self.job, sj.SNAPSHOT_KEY),
                                sj.H_MSG_ID: f"{self.job}.{name}"})  # a retried lost ack

        async def put() -> None:
            try:
                await bus.publish(self.js, out)
            except APIError as exc:
                if exc.err_code == WRONG_LAST_SEQUENCE:
                    raise KeyWrongLastSequenceError(description=exc.description) from None
                raise

        try:
            await retry(put)
        except KeyWrongLastSequenceError:
            raise Deposed(f"the snapshot key moved past revision {snapshot_rev}: a newer "
                          "coordinator took over") from None
        self.index += 1
        self.written += 1
