"""The fuzz campaign's seeds, budget and tally (shared by the hypothesis tests and atheris).

Seeds are valid, signed messages of every family and variant, built from realistic domain
values (ranks below the world size, the job's generations, plausible counters, floats that
include NaN and the infinities) so a mutation starts one step away from something the
receivers act on. :func:`decode` is the one probe: it returns the :class:`Envelope` or the
:class:`DecodeError`, checks that a refusal is one of the reasons the codec documents, and
turns any other exception into a :class:`Crash` that names the payload.

The budget is ``DDPTEST_FUZZ_EXAMPLES`` mutated payloads per test (per message family and
kind); unset, it is the small, derandomized CI run.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import types
import typing
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any, Final

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from ddpbus.codecs import convert, tensor
from ddpbus.codecs import messages as m
from ddpbus.codecs import subjects as sj
from ddpbus.codecs.envelope import Decoder, Encoder, Envelope, Outbound
from ddpbus.codecs.errors import DECODE_ERRORS, DecodeError

JOB: Final = "fuzz-job"
KEY: Final = b"fuzz-campaign-key-0123456789abcdef"
OTHER_KEY: Final = b"another-job-key-0123456789abcdef"
WORLD: Final = 4
RANK_GEN: Final = 5
COORD_GEN: Final = 3
FLOOR: Final = 2  # the decoder's fence for every rank and the coordinator: gen 0-1 is stale

FAMILIES: Final = ("ControlMsg", "TimingMsg", "MetricsMsg", "JoinMsg", "AdmitMsg",
                   tensor.TYPE_NAME)
REASONS: Final = frozenset(cls.reason for cls in DECODE_ERRORS)
#: What a message that still carries its old signature may be refused for: every check up
#: to and including the signature (subjects.md's order), none that reads the payload.
BEFORE_PAYLOAD: Final = frozenset({"bad-subject", "foreign-job", "oversize", "missing-header",
                                   "schema", "unknown-type", "wrong-type", "bad-signature"})


# ------------------------------------------------------------------------- budget


@dataclass(frozen=True, slots=True)
class Budget:
    payloads: int  # mutated payloads per test, at least
    per_example: int  # decoded per hypothesis example (a seeded mutation loop)
    full: bool  # DDPTEST_FUZZ_EXAMPLES was given: random, not derandomized

    @property
    def examples(self) -> int:
        return -(-self.payloads // self.per_example)

    def settings(self, examples: int | None = None) -> settings:
        """Hypothesis settings for :attr:`examples` examples (or as many as given)."""
        return settings(max_examples=max(1, examples or self.examples), deadline=None,
                        derandomize=not self.full, database=None, print_blob=True,
                        suppress_health_check=[HealthCheck.too_slow,
                                               HealthCheck.data_too_large])


CI_PAYLOADS: Final = 5000  # about 15 s for all of tests/fuzz on the 2-core CI machine
PER_EXAMPLE: Final = 40


def budget(environ: Mapping[str, str] = os.environ) -> Budget:
    raw = environ.get("DDPTEST_FUZZ_EXAMPLES", "")
    payloads = int(raw) if raw else CI_PAYLOADS
    return Budget(payloads=payloads, per_example=min(PER_EXAMPLE, payloads), full=bool(raw))


BUDGET: Final = budget()


# -------------------------------------------------------------------------- tally


class Tally:
    """Outcomes per family and kind: ``accepted`` or the refusal's reason."""

    def __init__(self) -> None:
        self.counts: defaultdict[str, defaultdict[str, Counter[str]]] = defaultdict(
            lambda: defaultdict(Counter))

    def add(self, family: str, kind: str, outcomes: Counter[str]) -> None:
        self.counts[family][kind].update(outcomes)

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for family, kinds in sorted(self.counts.items()):
            total: Counter[str] = Counter()
            rows = {}
            for kind, c in sorted(kinds.items()):
                total.update(c)
                rows[kind] = _row(c)
            out[family] = {"total": _row(total), "kinds": rows}
        return out


def _row(c: Counter[str]) -> dict[str, Any]:
    return {"payloads": sum(c.values()), "accepted": c["accepted"],
            "rejections": {k: v for k, v in sorted(c.items()) if k != "accepted"}}


TALLY: Final = Tally()


# -------------------------------------------------------------------------- probe


@dataclass(frozen=True, slots=True)
class Inbound:
    """What the bus hands the decoder: subject, headers, payload."""

    subject: str
    headers: dict[str, str]
    payload: bytes

    @classmethod
    def of(cls, out: Outbound) -> Inbound:
        return cls(out.subject, dict(out.headers), bytes(out.payload))


class Crash(AssertionError):
    """A decoder raised something other than a reasoned DecodeError."""


def shown(x: object, limit: int = 600) -> str:
    text = repr(x)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def floor(_sender: str) -> int:
    return FLOOR


def decoder(key: bytes = KEY) -> Decoder:
    return Decoder(job=JOB, key=key, generation_floor=floor)


def check_refusal(exc: DecodeError, what: object) -> None:
    if type(exc) not in DECODE_ERRORS or exc.reason not in REASONS or not exc.detail:
        raise Crash(f"an unreasoned refusal {exc!r} of {shown(what)}")


def decode(dec: Decoder, x: Inbound) -> Envelope | DecodeError:
    try:
        return dec.decode(x.subject, x.headers, x.payload)
    except DecodeError as exc:
        check_refusal(exc, x)
        return exc
    except Exception as exc:
        raise Crash(f"{type(exc).__name__}: {exc} decoding {shown(x)}") from exc


def reached(seen: Counter[str], *outcomes: str) -> None:
    """The campaign got each of ``outcomes`` at least once (its mutations reach them)."""
    missing = [o for o in outcomes if not seen[o]]
    if missing:
        raise AssertionError(f"no payload was {missing}; outcomes: {dict(seen)}")


def outcome(got: object) -> str:
    return got.reason if isinstance(got, DecodeError) else "accepted"


def fingerprint(env: Envelope) -> tuple[Any, ...]:
    """What an envelope means (a tensor chunk's bytes instead of its view's address)."""
    msg = env.message
    body: Any = msg
    if isinstance(msg, tensor.TensorChunk):
        body = [getattr(msg, f.name) for f in dataclasses.fields(msg) if f.name != "data"]
        body.append(bytes(msg.data))
    return (env.subject, env.kind, env.rank, env.sender, env.msg_type, env.generation,
            env.msg_id, env.content_type, repr(body))


# ------------------------------------------------------------ realistic messages

_NAN, _INF = math.nan, math.inf
_FLOATS = st.one_of(st.floats(-1e6, 1e6), st.sampled_from(
    [0.0, -0.0, 1.0, _NAN, _INF, -_INF, 5e-324, 1.7e308]))
_COUNTS = st.one_of(st.integers(0, 5000), st.sampled_from([2**32 - 1, 2**32, 2**63,
                                                           2**64 - 2]))
_TEXT = st.text(max_size=12)
RANKS: Final = st.integers(0, WORLD - 1)

_BY_NAME: dict[str, st.SearchStrategy[Any]] = {
    "rank": RANKS, "target_rank": RANKS, "new_rank": RANKS,
    "world_size": st.just(WORLD), "new_world_size": st.just(WORLD),
    "generation": st.just(RANK_GEN), "coordinator_generation": st.just(COORD_GEN),
    "uid_bytes": st.binary(min_size=m.NCCL_ID_BYTES, max_size=m.NCCL_ID_BYTES),
    "model_signature": st.binary(min_size=m.MODEL_SIGNATURE_BYTES,
                                 max_size=m.MODEL_SIGNATURE_BYTES),
    "device_indices": st.lists(st.integers(-1, 7), max_size=WORLD).map(tuple),
    "dataset_size": st.integers(0, 10_000), "batch_size": st.integers(1, 256),
    "epochs": st.integers(1, 20),
}


def _of_type(tp: Any) -> st.SearchStrategy[Any]:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        return st.one_of(st.none(), *(_of_type(a) for a in args if a is not type(None)))
    if origin is tuple:
        return st.lists(_of_type(args[0]), max_size=WORLD).map(tuple)
    if origin is Mapping:
        return st.dictionaries(_TEXT, _of_type(args[1]), max_size=3)
    simple: dict[Any, st.SearchStrategy[Any]] = {
        bool: st.booleans(), int: _COUNTS, float: _FLOATS, str: _TEXT,
        bytes: st.binary(max_size=16)}
    if tp in simple:
        return simple[tp]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return st.sampled_from(list(tp))
    if tp in SPECIAL:
        return SPECIAL[tp]
    return builds(tp)


def builds(cls: type[Any], **fixed: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    hints = typing.get_type_hints(cls)
    return st.builds(cls, **{f.name: _field(f.name, hints[f.name], fixed)
                             for f in dataclasses.fields(cls)})


def _field(name: str, tp: Any, fixed: Mapping[str, st.SearchStrategy[Any]]
           ) -> st.SearchStrategy[Any]:
    if name in fixed:
        return fixed[name]
    return _BY_NAME[name] if name in _BY_NAME else _of_type(tp)


SPECIAL: dict[Any, st.SearchStrategy[Any]] = {}
SPECIAL |= {
    # the decoder's own rules: a stored snapshot has mass and a digest, an unrealized Update
    # accepts nobody, a run config has a batch size, a positive timeout, alpha in [0, 1] and
    # a finite report interval
    m.SnapshotReady: st.one_of(
        builds(m.SnapshotReady, mass=st.just(0.0), digest=st.just("")),
        builds(m.SnapshotReady, mass=st.floats(1e-6, 1e6),
               digest=st.one_of(st.just("SHA-256=q83vEjRWeJA="), _TEXT.filter(bool)))),
    m.Update: st.one_of(builds(m.Update, realized=st.just(True),
                               digest=st.just("SHA-256=q83vEjRWeJA=")),
                        builds(m.Update, realized=st.just(False), accepted=st.just(()),
                               digest=st.just(""))),
    m.RunConfig: st.deferred(lambda: builds(
        m.RunConfig, coordinator_timeout_s=st.floats(0.1, 600.0),
        collective_timeout_s=st.floats(0.0, 600.0), easgd_alpha=st.floats(0.01, 1.0),
        report_interval_ms=st.floats(0.0, 10_000.0))),
    # a SyncAck's times are finite and >= 0, or absent
    m.SyncAck: builds(m.SyncAck, **dict.fromkeys(
        ("received_at", "average_ms", "collective_ms"), st.none() | st.floats(0.0, 1e12))),
    # a heartbeat's refusal counts are keyed by the codec's own reasons
    # and its connection is the broker's "<server id>/<client id>" or empty
    m.Heartbeat: st.deferred(lambda: builds(
        m.Heartbeat, rejections=st.dictionaries(st.sampled_from(sorted(REASONS)),
                                                st.integers(0, 10**6), max_size=3),
        connection=st.just("") | st.from_regex(convert.CONNECTION, fullmatch=True))),
}



@st.composite
def _reports(draw: st.DrawFn) -> m.Reports:
    """Coalesced reports as the decoder takes them: one rank's, Batch steps rising."""
    rank = draw(RANKS)
    steps = sorted(draw(st.sets(st.integers(0, 10**6), min_size=1, max_size=6)))
    return m.Reports(rank=rank, items=tuple(
        draw(builds(m.Batch, rank=st.just(rank), step_count=st.just(s))) if draw(st.booleans())
        else draw(builds(m.LrUpdate, rank=st.just(rank))) for s in steps))


SPECIAL[m.Reports] = _reports()

CLASSES: Final[Mapping[str, tuple[type[Any], ...]]] = {
    "TimingMsg": typing.get_args(m.TimingMsg), "ControlMsg": typing.get_args(m.ControlMsg),
    "MetricsMsg": (m.MetricsMsg,), "JoinMsg": (m.Hello, m.Rejoin),
    "AdmitMsg": (m.Accept, m.Reject),
}


def _rank_of(msg: Any) -> int:
    return int(msg.hello.rank if isinstance(msg, m.Rejoin) else msg.rank)


@cache
def encoder(sender: str, *, wire_json: bool = False, frame_cap: int = 0,
            generation: int | None = None, key: bytes = KEY) -> Encoder:
    if generation is None:
        generation = COORD_GEN if sender == sj.COORDINATOR else RANK_GEN
    extra = {"max_frame_payload": frame_cap} if frame_cap else {}
    return Encoder(job=JOB, key=key, sender=sender, generation=generation,
                   wire_json=wire_json, **extra)


def subject_of(family: str, msg: Any, *, broadcast: bool = False, live: bool = False) -> str:
    if family == "ControlMsg":
        if isinstance(msg, m.CoordHeartbeat) and live:
            return sj.LIVE_COORDINATOR.subject(JOB)
        return sj.CONTROL_ALL.subject(JOB) if broadcast else sj.CONTROL_RANK.subject(JOB, 1)
    if isinstance(msg, m.Heartbeat) and live:
        return sj.LIVE_RANK.subject(JOB, msg.rank)
    spec = {"TimingMsg": sj.TIMING_RANK, "MetricsMsg": sj.METRICS_RANK,
            "JoinMsg": sj.JOIN_RANK, "AdmitMsg": sj.ADMIT_RANK}[family]
    return spec.subject(JOB, _rank_of(msg))


def sign_message(family: str, msg: Any, *, wire_json: bool = False, broadcast: bool = False,
                 live: bool = False, seq: int = 1, generation: int | None = None,
                 key: bytes = KEY) -> Inbound:
    subject = subject_of(family, msg, broadcast=broadcast, live=live)
    sender = sj.parse_subject(subject, JOB).sender
    out = encoder(sender, wire_json=wire_json, generation=generation, key=key).encode(
        subject, msg, seq=seq)
    return Inbound.of(out)


def sign_frame(rank: int | None, name: str, dtype: str, shape: tuple[int, ...], data: bytes,
               *, chunk: int = 0, frame_cap: int = 0, version: int = 0) -> Inbound:
    """One frame of a tensor, from a rank (data.rank.N) or the reducer (data.consensus)."""
    if rank is None:
        subject, sender = sj.DATA_CONSENSUS.subject(JOB), "reducer"
    else:
        subject, sender = sj.DATA_RANK.subject(JOB, rank), f"rank-{rank}"
    frames = list(encoder(sender, frame_cap=frame_cap).encode_tensor(
        subject, name, dtype, shape, data, version=version))
    return Inbound.of(frames[chunk % len(frames)])


@st.composite
def _frame(draw: st.DrawFn) -> Inbound:
    dtype = draw(st.sampled_from(sorted(tensor.DTYPE_SIZES)))
    shape = tuple(draw(st.lists(st.integers(0, 6), max_size=3)))
    size = tensor.DTYPE_SIZES[dtype] * math.prod(shape)
    data = draw(st.binary(min_size=size, max_size=size))
    cap = draw(st.sampled_from([0, 0, 96, 160]))  # small caps: a tensor in several chunks
    return sign_frame(draw(st.none() | RANKS), draw(st.sampled_from(["param.0", "buffers",
                                                                     "w", ""])),
                      dtype, shape, data, chunk=draw(st.integers(0, 50)), frame_cap=cap,
                      version=draw(_COUNTS))


@cache
def _variants(family: str) -> st.SearchStrategy[Any]:
    return st.one_of(*(SPECIAL[c] if c in SPECIAL else builds(c) for c in CLASSES[family]))


@st.composite
def _message(draw: st.DrawFn, family: str) -> Inbound:
    msg = draw(_variants(family))
    return sign_message(family, msg, wire_json=draw(st.booleans()), broadcast=draw(
        st.booleans()), live=draw(st.booleans()), seq=draw(st.integers(1, 10**6)))


def inbound(family: str) -> st.SearchStrategy[Inbound]:
    """A valid signed message of ``family``, any variant, either content type."""
    return _frame() if family == tensor.TYPE_NAME else _message(family)


# ------------------------------------------------- a fixed corpus (atheris, splices)


def _fixed(tp: Any, name: str = "") -> Any:
    """One plain, valid value of a type hint (every optional present, every tuple filled)."""
    if name in ("uid_bytes", "model_signature"):
        return bytes(range(m.NCCL_ID_BYTES if name == "uid_bytes" else
                           m.MODEL_SIGNATURE_BYTES))
    if name in ("world_size", "new_world_size"):
        return WORLD
    if name == "connection":
        return "NDDPBUSFUZZ/7"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        return _fixed(next(a for a in args if a is not type(None)), name)
    if origin is tuple:
        return (_fixed(args[0]), _fixed(args[0]))
    if origin is Mapping:
        return {"loss": _fixed(args[1])}
    plain = {bool: True, int: 1, float: 0.5, str: "x", bytes: b"\x01"}
    if tp in plain:
        return plain[tp]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return list(tp)[-1]
    hints = typing.get_type_hints(tp)
    return tp(**{f.name: _fixed(hints[f.name], f.name) for f in dataclasses.fields(tp)})


def _fixed_message(cls: type[Any]) -> Any:
    if cls is m.Reports:
        return m.Reports(rank=1, items=(
            m.Batch(rank=1, batch_ms=2.5, data_ms=0.5, step_count=7, param_norm=3.0,
                    batch_loss=0.25), m.LrUpdate(rank=1, lr=0.05),
            m.Batch(rank=1, batch_ms=2.0, data_ms=0.25, step_count=8, batch_loss=0.125)))
    if cls is m.SnapshotReady:
        return m.SnapshotReady(rank=1, version=3, mass=2.0, step_count=7,
                               digest="SHA-256=q83vEjRWeJA=", nbytes=64)
    return _fixed(cls)


@cache
def seeds(family: str) -> tuple[Inbound, ...]:
    """One valid message per variant of ``family`` in each content type (frames: several
    dtypes, one split in chunks): the atheris seeds and the splice donors."""
    if family == tensor.TYPE_NAME:
        return (sign_frame(1, "param.0", "float32", (2, 3), bytes(range(24))),
                sign_frame(None, "buffers", "bfloat16", (5,), bytes(10), version=4),
                sign_frame(2, "w", "int8", (40,), bytes(range(40)), chunk=1, frame_cap=96))
    return tuple(sign_message(family, _fixed_message(cls), wire_json=wire_json)
                 for cls in CLASSES[family] for wire_json in (False, True))


def every_seed() -> Iterable[tuple[str, Inbound]]:
    for family in FAMILIES:
        for x in seeds(family):
            yield family, x
