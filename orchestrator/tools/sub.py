"""``ddpbus sub``: a job's traffic, decoded, one line (or one JSON object) per message.

Like ``nats sub``, but every payload is verified with the job key and decoded (protobuf or
proto3 JSON) into the message it is. Live by default (core NATS: what is published from
now on); ``--since SEQ|TIME`` reads the job's stream instead, from that stream sequence or
time up to its end (``--follow`` keeps going). A message that fails to verify or decode is
printed as refused, with the reason; nothing the wire carries stops it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import difflib
import enum
import json
import math
import re
import sys
from dataclasses import dataclass
from typing import IO, Any

from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy

from ddpbus.codecs import DecodeError, Decoder, convert, tensor
from ddpbus.codecs import messages as m
from ddpbus.codecs import subjects as sj
from ddpbus.codecs.errors import ConfigError
from ddpbus.orchestrator.persist import recording
from ddpbus.orchestrator.transport.auth import Access

MAX_LIST = 8  # longer sequences are shown by their length only
KNOWN_TYPES = sorted({*convert.BY_TYPE, tensor.TYPE_NAME,
                      *(t.rsplit(".", 1)[-1] for t in convert.BY_TYPE)})


@dataclass(frozen=True, slots=True)
class Since:
    """Where a stream read starts: a stream sequence or a time."""

    seq: int | None = None
    time: dt.datetime | None = None


_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")


def parse_since(text: str, now: dt.datetime | None = None) -> Since:
    """``42`` (a stream sequence), ``10m`` / ``2h`` / ``30s`` / ``1d`` ago, or an ISO time."""
    if text.isdigit():
        if int(text) < 1:
            raise ConfigError("--since: stream sequences start at 1")
        return Since(seq=int(text))
    now = now or dt.datetime.now(dt.UTC)
    if m := _RELATIVE.match(text):
        unit = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[m.group(2)]
        return Since(time=now - dt.timedelta(**{unit: float(m.group(1))}))
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(f"--since {text!r}: a stream sequence (42), an age (10m, 2h) or an "
                          "ISO time (2026-12-03T10:00:00Z)") from None
    return Since(time=when if when.tzinfo else when.replace(tzinfo=dt.UTC))


@dataclass(frozen=True, slots=True)
class Filter:
    rank: int | None = None
    msg_type: str | None = None

    def keeps(self, rank: int | None, msg_type: str | None) -> bool:
        """``msg_type`` matches by full name (``TimingMsg.Batch``) or variant (``Batch``)."""
        return (self.rank is None or rank == self.rank) and (
            self.msg_type is None or (msg_type is not None and (
                msg_type == self.msg_type or msg_type.endswith(f".{self.msg_type}"))))


# -------------------------------------------------------------------- formatting


def plain(value: Any) -> Any:
    """A message's value as JSON-able data: dataclasses as objects, enums by name, bytes
    as hex; a Reports' items each say their type."""
    if isinstance(value, m.Reports):
        return {"rank": value.rank, "items": [{"type": type(x).__name__, **plain(x)}
                                              for x in value.items]}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    if isinstance(value, tuple | list):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, float) and math.isnan(value):  # NaN has no JSON
        return "nan"
    return value


def key_fields(value: Any, prefix: str = "") -> list[str]:
    """``name=value`` for every field, nested ones dotted; long lists and bytes shortened;
    coalesced reports summarized (``--json`` shows every item)."""
    if isinstance(value, m.Reports):
        return _reports_fields(value)
    out: list[str] = []
    for f in dataclasses.fields(value):
        v = getattr(value, f.name)
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            out += key_fields(v, f"{name}.")
        elif isinstance(v, bytes | bytearray | memoryview):
            out.append(f"{name}=<{len(v)} bytes>")
        elif isinstance(v, tuple | list):
            out.append(f"{name}=[{len(v)} items]" if len(v) > MAX_LIST
                       else f"{name}=[{','.join(_short(x) for x in v)}]")
        elif v is not None:
            out.append(f"{name}={_short(v)}")
    return out


def _reports_fields(r: m.Reports) -> list[str]:
    """rank, batches, their step range, the last loss and LR among them."""
    batches = m.batches(r)
    lrs = [x.lr for x in r.items if isinstance(x, m.LrUpdate)]
    losses = [b.batch_loss for b in batches if b.batch_loss is not None]
    out = [f"rank={r.rank}", f"batches={len(batches)}"]
    if batches:
        out.append(f"steps={batches[0].step_count}..{batches[-1].step_count}")
        out.append(f"batch_ms={_short(sum(b.batch_ms for b in batches) / len(batches))}")
    if losses:
        out.append(f"loss={_short(losses[-1])}")
    if lrs:
        out.append(f"lr={_short(lrs[-1])}")
    return out


def _short(v: Any) -> str:
    if isinstance(v, enum.Enum):
        return v.name
    if isinstance(v, float):
        return f"{v:.6g}"
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return "{" + " ".join(key_fields(v)) + "}"
    return str(v)


def _stamp(when: dt.datetime | None) -> str:
    when = when or dt.datetime.now(dt.UTC)
    return when.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


@dataclass(frozen=True, slots=True)
class Line:
    """One message as ``ddpbus sub`` shows it."""

    when: dt.datetime | None
    seq: int | None
    subject: str
    msg_type: str | None
    rank: int | None
    sender: str | None
    generation: int | None
    msg_id: str | None
    body: Any = None  # the decoded message
    refused: str | None = None  # the reason it was refused, if it was
    detail: str = ""

    def text(self) -> str:
        seq = f"#{self.seq} " if self.seq is not None else ""
        head = f"{_stamp(self.when)} {seq}{self.subject}"
        if self.refused is not None:
            what = " ".join(x for x in (self.msg_type, self.generation is not None and
                                        f"g{self.generation}") if x)
            return f"{head} REFUSED {self.refused}{f' ({what})' if what else ''}: {self.detail}"
        who = f"{self.sender} g{self.generation}"
        fields = " ".join(key_fields(self.body)) if dataclasses.is_dataclass(self.body) \
            else f"<{type(self.body).__name__}>"
        return f"{head} {self.msg_type} [{who}] {fields}".rstrip()

    def json(self) -> str:
        doc: dict[str, Any] = {"time": _stamp(self.when), "seq": self.seq,
                               "subject": self.subject, "type": self.msg_type,
                               "rank": self.rank, "sender": self.sender,
                               "generation": self.generation, "msg_id": self.msg_id}
        if self.refused is not None:
            doc |= {"refused": self.refused, "detail": self.detail}
        else:
            doc["message"] = plain(self.body)
        return json.dumps(doc, sort_keys=True, allow_nan=False)


def describe(decoder: Decoder, msg: Msg, *, seq: int | None = None,
             when: dt.datetime | None = None) -> Line:
    """Verify and decode one message; a refusal is a Line too, never an exception."""
    headers = msg.headers or {}
    msg_type = headers.get(sj.H_TYPE)
    try:
        env = decoder.decode(msg.subject, headers, msg.data)
    except DecodeError as exc:
        gen = headers.get(sj.H_GEN)
        return Line(when, seq, msg.subject, msg_type, _rank_of(msg.subject), None,
                    int(gen) if gen and gen.isdigit() else None, headers.get(sj.H_MSG_ID),
                    refused=exc.reason, detail=exc.detail)
    return Line(when, seq, msg.subject, env.msg_type, env.rank, env.sender, env.generation,
                env.msg_id, body=env.message)


def _rank_of(subject: str) -> int | None:
    try:
        return sj.parse_subject(subject).rank
    except DecodeError:
        return None  # not even a ddpbus subject


# ----------------------------------------------------------------------- reading


@dataclass(kw_only=True)
class Sub:
    nats: Access
    job: str
    key: bytes
    subject: str | None = None
    keep: Filter = dataclasses.field(default_factory=Filter)
    as_json: bool = False
    since: Since | None = None
    follow: bool = False
    count: int | None = None  # stop after this many lines
    out: IO[str] = sys.stdout
    shown: int = 0

    def _show(self, line: Line) -> bool:
        """Print it if the filters keep it; False once ``count`` lines are out."""
        if self.keep.keeps(line.rank, line.msg_type):
            print(line.json() if self.as_json else line.text(), file=self.out, flush=True)
            self.shown += 1
        return self.count is None or self.shown < self.count

    async def run(self) -> int:
        decoder = Decoder(job=self.job, key=self.key)
        subject = self.subject or sj.job_wildcard(self.job)
        nc = await self.nats.connect(self.job, name=f"ddpbus-sub-{self.job}")
        try:
            if self.since is None:
                try:  # live traffic may come yet: say so, and listen anyway
                    await recording.stream_info(nc.jetstream(), self.job)
                except recording.NoSuchJob as exc:
                    print(f"ddpbus sub: {exc}; listening for its traffic anyway",
                          file=sys.stderr, flush=True)
                await self._live(nc, subject, decoder)
            else:
                await self._stored(nc, subject, decoder, self.since)
        finally:
            await nc.close()
        return 0

    async def _live(self, nc: Any, subject: str, decoder: Decoder) -> None:
        done = asyncio.Event()

        async def on(msg: Msg) -> None:
            if not done.is_set() and not self._show(describe(decoder, msg)):
                done.set()

        sub = await nc.subscribe(subject, cb=on)
        try:
            await done.wait()
        finally:
            await sub.unsubscribe()

    async def _stored(self, nc: Any, subject: str, decoder: Decoder, since: Since) -> None:
        js = nc.jetstream()
        stream = sj.stream_name(self.job)
        info = await recording.stream_info(js, self.job)
        last = info.state.last_seq
        config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                                opt_start_seq=since.seq) if since.seq is not None else \
            ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME,
                           opt_start_time=since.time)
        sub = await js.subscribe(subject, stream=stream, ordered_consumer=True, config=config)
        try:
            while self.follow or last > 0:
                try:
                    msg = await sub.next_msg(timeout=2.0 if not self.follow else None)
                except TimeoutError:
                    if not self.follow:
                        return  # nothing (more) at or after the start in this stream
                    continue
                meta = msg.metadata
                line = describe(decoder, msg, seq=meta.sequence.stream, when=meta.timestamp)
                if not self._show(line):
                    return
                if not self.follow and meta.sequence.stream >= last:
                    return
        finally:
            await sub.unsubscribe()


def from_args(args: Any, key: bytes, nats: Access) -> Sub:
    since = parse_since(args.since) if args.since is not None else None
    if args.follow and since is None:
        raise ConfigError("--follow goes with --since (live is always followed)")
    if args.type is not None and args.type not in KNOWN_TYPES:
        close = difflib.get_close_matches(args.type, KNOWN_TYPES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"--type {args.type!r} is no message type{hint}")
    if args.subject is not None and not args.subject.startswith(
            sj.job_wildcard(args.job).removesuffix(">")):
        raise ConfigError(f"SUBJECT {args.subject!r} is not in job {args.job!r} "
                          f"({sj.job_wildcard(args.job)})")
    return Sub(nats=nats, job=args.job, key=key, subject=args.subject,
               keep=Filter(rank=args.rank, msg_type=args.type), as_json=args.json,
               since=since, follow=args.follow, count=args.count)

