"""Hypothesis round trips: every wire message through convert and the signed envelope.

Each domain class in :data:`ddpbus.codecs.convert.VARIANTS` has a strategy below (a test
fails when a new variant arrives without one). Values run to the extremes of their wire
types: u64 ``0 .. 2**64-1``, sint64, NaN, +/-inf, -0.0, subnormals, unicode, empty and
non-empty collections, optionals absent and present. Both payload encodings (protobuf and
the proto3 JSON mapping) must give back an equal message; see :func:`assert_same` for what
"equal" means for floats.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import struct
import sys
import types
import typing
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpbus.codecs import convert, tensor
from ddpbus.codecs import messages as m
from ddpbus.codecs import subjects as sj
from ddpbus.codecs._pb import ddpbus_pb2 as pb
from ddpbus.codecs.envelope import Decoder, Encoder, Signer, to_json
from ddpbus.codecs.errors import EncodeError, InvalidField

JOB = "rt-job_1"
KEY = b"roundtrip-test-key-0123456789abc"
U64_MAX = 2**64 - 1
S64_MIN, S64_MAX = -(2**63), 2**63 - 1

# ---------------------------------------------------------------------- strategies

_FLOAT_EXTREMES = (
    math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0,
    5e-324, -5e-324,  # smallest subnormal
    2.225073858507201e-308,  # largest subnormal
    sys.float_info.min, sys.float_info.max, -sys.float_info.max, sys.float_info.epsilon,
    struct.unpack("<d", struct.pack("<Q", 0x7FF0_0000_0000_0001))[0],  # a signalling NaN
)


def u64s(*, reserved_ok: bool = True) -> st.SearchStrategy[int]:
    top = U64_MAX if reserved_ok else U64_MAX - 1
    edges = [v for v in (0, 1, 127, 128, 2**32 - 1, 2**32, 2**63 - 1, 2**63, U64_MAX - 1, U64_MAX)
             if v <= top]
    return st.one_of(st.sampled_from(edges), st.integers(0, top))


def s64s() -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from([-1, 0, 1, S64_MIN, S64_MAX]), st.integers(S64_MIN, S64_MAX))


def doubles() -> st.SearchStrategy[float]:
    return st.one_of(st.sampled_from(_FLOAT_EXTREMES), st.floats())


def texts() -> st.SearchStrategy[str]:
    # hypothesis' text() never produces lone surrogates (not encodable as UTF-8)
    return st.one_of(st.sampled_from(["", "é", "\x00", "日本語", "🦀\u200d", "a.b*>"]),
                     st.text(max_size=12))


def _tuples(elem: st.SearchStrategy[Any]) -> st.SearchStrategy[tuple[Any, ...]]:
    return st.lists(elem, max_size=4).map(tuple)


#: Fields whose wire rule is narrower than their Python type (by field name, any class).
_FIELD_OVERRIDES: dict[str, st.SearchStrategy[Any]] = {
    "target_rank": u64s(reserved_ok=False),  # 2**64-1 is reserved, tested separately
    "uid_bytes": st.binary(min_size=m.NCCL_ID_BYTES, max_size=m.NCCL_ID_BYTES),
    "model_signature": st.binary(min_size=m.MODEL_SIGNATURE_BYTES,
                                 max_size=m.MODEL_SIGNATURE_BYTES),
    "device_indices": _tuples(s64s()),  # sint64 on the wire, -1 for CPU
}


def _rank_below(world: int) -> st.SearchStrategy[int]:
    return st.one_of(st.just(0), st.just(world - 1), st.integers(0, world - 1))


_WORLD = st.one_of(st.sampled_from([1, 2, U64_MAX]), st.integers(1, U64_MAX))


def _from_type(tp: Any) -> st.SearchStrategy[Any]:
    """A strategy for one resolved type hint of the messages module."""
    if tp in _TYPE_OVERRIDES:
        return _TYPE_OVERRIDES[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        inner = [a for a in args if a is not type(None)]
        return st.one_of(st.none(), *(_from_type(a) for a in inner))
    if origin is tuple:
        assert args[1] is Ellipsis, tp
        return _tuples(_from_type(args[0]))
    if origin is Mapping:
        return st.dictionaries(texts(), _from_type(args[1]), max_size=4)
    simple: dict[Any, st.SearchStrategy[Any]] = {
        bool: st.booleans(), int: u64s(), float: doubles(), str: texts(), bytes: st.binary(),
    }
    if tp in simple:
        return simple[tp]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return st.sampled_from(list(tp))
    if dataclasses.is_dataclass(tp):
        return builds(tp)
    raise TypeError(f"no strategy for {tp!r}")


def builds(cls: type[Any], **fixed: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``cls`` with every field drawn from its type hint (or an override)."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in fixed:
            kwargs[f.name] = fixed[f.name]
        elif f.name in _FIELD_OVERRIDES:
            kwargs[f.name] = _FIELD_OVERRIDES[f.name]
        else:
            kwargs[f.name] = _from_type(hints[f.name])
    return st.builds(cls, **kwargs)


@st.composite
def _hello(draw: st.DrawFn) -> m.Hello:
    world = draw(_WORLD)
    return draw(builds(m.Hello, world_size=st.just(world), rank=_rank_below(world)))


@st.composite
def _new_session(draw: st.DrawFn) -> m.NewNcclSession:
    world = draw(_WORLD)
    return draw(builds(m.NewNcclSession, new_world_size=st.just(world),
                       new_rank=_rank_below(world)))


_TYPE_OVERRIDES: dict[Any, st.SearchStrategy[Any]] = {
    m.Hello: _hello(),
    # the decoder refuses a zero batch size, a non-positive coordinator timeout and a
    # negative or non-finite collective timeout or report interval
    m.RunConfig: st.deferred(lambda: builds(
        m.RunConfig, batch_size=st.integers(1, U64_MAX),
        coordinator_timeout_s=st.floats(min_value=1e-3, max_value=1e12),
        collective_timeout_s=st.floats(min_value=0, max_value=1e12),
        easgd_alpha=st.floats(min_value=1e-6, max_value=1.0),
        report_interval_ms=st.floats(min_value=0, max_value=1e12))),
}

TIMING_CLASSES = (
    m.Batch, m.SyncAck, m.Exiting, m.LrUpdate, m.Heartbeat, m.Intent, m.SnapshotReady,
    m.NewNcclIdGenerated, m.EvalResult, m.CheckpointResult, m.EpochFnElapsed, m.Reports,
)
CONTROL_CLASSES = (
    m.RequestParams, m.Update, m.SyncNow, m.StartEpoch, m.ExtendPartition, m.DeclareDead,
    m.NewNcclSession, m.RequestNewNcclId, m.StageAdvisory, m.Throttle, m.SetGlobalStep,
    m.Checkpoint, m.ExecuteEvalCallback, m.SetEpochCallbackRole, m.Shutdown,
    m.ShutdownWithSave, m.EpochAggregated, m.EvalBroadcast, m.SaveConsensusModel,
    m.CoordHeartbeat,
)
OTHER_CLASSES = (m.MetricsMsg, m.Hello, m.Rejoin, m.Accept, m.Reject)

#: One strategy per wire message class, listed by hand so that a new variant fails
#: :func:`test_every_variant_has_a_strategy` until someone writes (or approves) one.
STRATEGIES: dict[type[Any], st.SearchStrategy[Any]] = {
    cls: builds(cls) for cls in TIMING_CLASSES + CONTROL_CLASSES + OTHER_CLASSES
}
STRATEGIES[m.Hello] = _hello()
# the decoder refuses a stored snapshot without mass and a mass without a stored object,
# and an Update that accepts contributions of a round it says was not realized (or
# names a consensus digest for one, or none for a realized one)
STRATEGIES[m.SnapshotReady] = st.one_of(
    builds(m.SnapshotReady, mass=st.just(0.0), digest=st.just("")),
    builds(m.SnapshotReady, mass=st.floats(min_value=1e-12, max_value=1e12),
           digest=st.text(min_size=1, max_size=60)))
# a SyncAck's times are finite and >= 0, or absent
_ACK_TIME = st.none() | st.floats(min_value=0.0, max_value=1e12)
STRATEGIES[m.SyncAck] = builds(m.SyncAck, received_at=_ACK_TIME, average_ms=_ACK_TIME,
                               collective_ms=_ACK_TIME)
STRATEGIES[m.Update] = st.one_of(builds(m.Update, realized=st.just(True),
                                        digest=st.text(min_size=1, max_size=60)),
                                 builds(m.Update, realized=st.just(False),
                                        accepted=st.just(()), digest=st.just("")))
STRATEGIES[m.NewNcclSession] = _new_session()


@st.composite
def _reports(draw: st.DrawFn) -> m.Reports:
    """1..MAX_REPORT_ITEMS items of one rank, Batch step counts strictly rising (the
    decoder refuses anything else)."""
    rank = draw(u64s())
    n = draw(st.one_of(st.integers(1, 6), st.just(m.MAX_REPORT_ITEMS)))
    steps = sorted(draw(st.sets(u64s(), min_size=n, max_size=n)))
    items: list[m.Batch | m.LrUpdate] = []
    for step in steps:
        if draw(st.booleans()):
            items.append(draw(builds(m.Batch, rank=st.just(rank), step_count=st.just(step))))
        else:
            items.append(draw(builds(m.LrUpdate, rank=st.just(rank))))
    return m.Reports(rank=rank, items=tuple(items))


STRATEGIES[m.Reports] = _reports()
# refusal reasons are DecodeError reasons: lower-case slugs (at most 64 of them)
# and the connection is "<server id>/<client id>" or empty
STRATEGIES[m.Heartbeat] = builds(m.Heartbeat, rejections=st.dictionaries(
    st.from_regex(r"[a-z][a-z0-9-]{0,39}", fullmatch=True), u64s(), max_size=4),
    connection=st.one_of(st.just(""), st.from_regex(r"[A-Z0-9]{1,64}/[0-9]{1,20}",
                                                    fullmatch=True)))

ALL_CLASSES = tuple(STRATEGIES)


# ------------------------------------------------------------------ equality helper


def _same_float(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    # both encodings keep the sign of zero (test_signed_zero_and_non_finite_on_the_wire)
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


def assert_same(got: Any, want: Any, path: str = "msg") -> None:
    """Structural equality with NaN == NaN, -0.0 != 0.0 and exact types (bool is not int,
    a decoded sequence must be a real tuple, a map a real dict, an enum its enum class)."""
    assert type(got) is type(want), f"{path}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, float):
        assert _same_float(got, want), f"{path}: {got!r} != {want!r}"
    elif dataclasses.is_dataclass(want):
        for f in dataclasses.fields(want):
            assert_same(getattr(got, f.name), getattr(want, f.name), f"{path}.{f.name}")
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), f"{path}: keys {set(got)} != {set(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, tuple):
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{path}[{i}]")
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def test_assert_same_is_nan_aware_and_sign_aware() -> None:
    assert_same(m.LrUpdate(rank=1, lr=math.nan), m.LrUpdate(rank=1, lr=math.nan))
    with pytest.raises(AssertionError, match="lr"):
        assert_same(m.LrUpdate(rank=1, lr=0.0), m.LrUpdate(rank=1, lr=-0.0))
    with pytest.raises(AssertionError, match="nan"):
        assert_same(m.LrUpdate(rank=1, lr=1.0), m.LrUpdate(rank=1, lr=math.nan))
    with pytest.raises(AssertionError, match="bool"):
        assert_same(m.ExecuteEvalCallback(schedule_id=0, epoch=0, target_rank=0,
                                          adopt_consensus=1),  # type: ignore[arg-type]
                    m.ExecuteEvalCallback(schedule_id=0, epoch=0, target_rank=0,
                                          adopt_consensus=True))
    with pytest.raises(AssertionError, match="list"):
        assert_same(m.StageAdvisory(counts=[1]),  # type: ignore[arg-type]
                    m.StageAdvisory(counts=(1,)))


# ------------------------------------------------------------------------- coverage


def test_every_variant_has_a_strategy() -> None:
    assert set(STRATEGIES) == {v.cls for v in convert.VARIANTS}
    assert len(CONTROL_CLASSES) == 20
    assert len(convert.VARIANTS) == len(ALL_CLASSES)


# ------------------------------------------------------------------------- routing


@dataclasses.dataclass(frozen=True)
class Route:
    subject: str
    sender: str
    rank: int | None
    kind: str


def _msg_rank(msg: Any) -> int:
    return int(msg.hello.rank if isinstance(msg, m.Rejoin) else msg.rank)


def routes(msg: Any) -> st.SearchStrategy[Route]:
    """Every subject that may carry ``msg``, with the sender that publishes there."""
    family = convert.BY_CLASS[type(msg)].family.DESCRIPTOR.name
    if family == "ControlMsg":
        options = [st.just(Route(f"ddpbus.{JOB}.control.all", "coordinator", None,
                                 "control.all")),
                   u64s().map(lambda n: Route(f"ddpbus.{JOB}.control.rank.{n}", "coordinator",
                                              n, "control.rank"))]
        if isinstance(msg, m.CoordHeartbeat):
            options.append(st.just(Route(f"ddpbus.{JOB}.live.coordinator", "coordinator",
                                         None, "live.coordinator")))
        return st.one_of(options)
    n = _msg_rank(msg)
    kind = {"TimingMsg": "timing.rank", "MetricsMsg": "metrics.rank",
            "JoinMsg": "join.rank", "AdmitMsg": "admit.rank"}[family]
    sender = "coordinator" if family == "AdmitMsg" else f"rank-{n}"
    options = [st.just(Route(f"ddpbus.{JOB}.{kind}.{n}", sender, n, kind))]
    if isinstance(msg, m.Heartbeat):
        options.append(st.just(Route(f"ddpbus.{JOB}.live.rank.{n}", sender, n, "live.rank")))
    return st.one_of(options)


# --------------------------------------------------------------------- round trips


@pytest.mark.parametrize("wire_json", [False, True], ids=["protobuf", "json"])
@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_envelope_round_trip(cls: type[Any], wire_json: bool, data: st.DataObject) -> None:
    msg = data.draw(STRATEGIES[cls], label="msg")
    route = data.draw(routes(msg), label="route")
    generation = data.draw(u64s(), label="generation")
    seq = data.draw(u64s(), label="seq")
    enc = Encoder(job=JOB, key=KEY, sender=route.sender, generation=generation,
                  wire_json=wire_json)
    out = enc.encode(route.subject, msg, seq=seq)

    variant = convert.BY_CLASS[cls]
    content_type = sj.CONTENT_JSON if wire_json else sj.CONTENT_PROTOBUF
    stored = sj.parse_subject(route.subject, JOB).spec.storage == "stream"
    msg_id = f"{route.sender}.g{generation}.{'' if stored else 'c'}{seq}"
    assert out.subject == route.subject
    assert out.headers == {
        sj.H_TYPE: variant.type_name, sj.H_SCHEMA: "1", sj.H_JOB: JOB,
        sj.H_RANK: route.subject.rsplit(".", 1)[1], sj.H_GEN: str(generation),
        sj.H_MSG_ID: msg_id, sj.H_CONTENT_TYPE: content_type,
        sj.H_SIG: out.headers[sj.H_SIG],
    }
    assert len(out.headers[sj.H_SIG]) == 64
    if wire_json:
        assert out.payload.decode() == to_json(variant.to_wire(msg))

    env = Decoder(job=JOB, key=KEY).decode(out.subject, out.headers, out.payload)
    assert_same(env.message, msg)
    assert env.msg_type == variant.type_name
    assert env.generation == generation
    assert env.rank == route.rank
    assert env.sender == route.sender
    assert env.msg_id == msg_id
    assert env.content_type == content_type
    assert (env.subject, env.job, env.kind) == (route.subject, JOB, route.kind)


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_convert_round_trip(cls: type[Any], data: st.DataObject) -> None:
    msg = data.draw(STRATEGIES[cls], label="msg")
    variant, wire = convert.to_wire(msg)
    assert variant is convert.BY_CLASS[cls]
    assert isinstance(wire, variant.family)
    if variant.field is not None:
        assert wire.WhichOneof("variant") == variant.field
    assert_same(convert.from_wire(variant, wire), msg)
    reparsed = variant.family.FromString(wire.SerializeToString())
    assert_same(convert.from_wire(variant, reparsed), msg)
    assert convert.BY_TYPE[variant.type_name] is variant


def test_encoder_numbers_messages_from_first_seq() -> None:
    enc = Encoder(job=JOB, key=KEY, sender="rank-7", generation=3, first_seq=41)
    subject = f"ddpbus.{JOB}.timing.rank.7"
    ids = [enc.encode(subject, m.Exiting(rank=7)).headers[sj.H_MSG_ID] for _ in range(2)]
    fixed = enc.encode(subject, m.Exiting(rank=7), seq=5).headers[sj.H_MSG_ID]
    following = enc.encode(subject, m.Exiting(rank=7)).headers[sj.H_MSG_ID]
    assert ids == ["rank-7.g3.41", "rank-7.g3.42"]
    assert (fixed, following) == ("rank-7.g3.5", "rank-7.g3.43")


def test_core_subjects_count_apart_from_the_stream() -> None:
    """Beacons and tensor frames (core NATS, never stored) leave no gap in the stream's
    ids, which the coordinator's deduplication would remember (core.first_delivery)."""
    enc = Encoder(job=JOB, key=KEY, sender="rank-7", generation=3)
    timing, live = f"ddpbus.{JOB}.timing.rank.7", f"ddpbus.{JOB}.live.rank.7"
    ids = []
    for _ in range(2):
        ids.append(enc.encode(timing, m.Exiting(rank=7)).headers[sj.H_MSG_ID])
        ids.append(enc.encode(live, m.Heartbeat(rank=7, step_count=1)).headers[sj.H_MSG_ID])
    ids += [out.headers[sj.H_MSG_ID] for out in enc.encode_tensor(
        f"ddpbus.{JOB}.data.rank.7", "w", "float32", (2,), b"\0" * 8)]
    ids.append(enc.encode(timing, m.Exiting(rank=7)).headers[sj.H_MSG_ID])
    assert ids == ["rank-7.g3.1", "rank-7.g3.c1", "rank-7.g3.2", "rank-7.g3.c2",
                   "rank-7.g3.c3", "rank-7.g3.3"]
    beat = enc.encode(live, m.Heartbeat(rank=7, step_count=1))
    env = Decoder(job=JOB, key=KEY).decode(beat.subject, beat.headers, beat.payload)
    assert env.msg_id == "rank-7.g3.c4"  # signed and verified like any other id


def test_identical_inputs_give_identical_envelopes() -> None:
    msg = m.Batch(rank=2, batch_ms=1.5, data_ms=-0.0, step_count=U64_MAX, param_norm=math.nan)
    subject = f"ddpbus.{JOB}.timing.rank.2"
    for wire_json in (False, True):
        a, b = (Encoder(job=JOB, key=KEY, sender="rank-2", generation=9, wire_json=wire_json)
                .encode(subject, msg, seq=1) for _ in range(2))
        assert a == b


@pytest.mark.parametrize("wire_json", [False, True], ids=["protobuf", "json"])
def test_signed_zero_and_non_finite_on_the_wire(wire_json: bool) -> None:
    """-0.0, NaN and +/-inf survive both encodings; u64 extremes stay exact in JSON."""
    metrics = m.EpochMetrics(
        epoch=U64_MAX, avg_loss=-0.0, epoch_ms=math.inf, scalars={"": -math.inf, "é": -0.0},
        per_rank_loss=(math.nan, -0.0, 5e-324), device_indices=(-1, S64_MIN, S64_MAX),
        per_rank_samples=(U64_MAX, 0),
    )
    msg = m.EpochAggregated(metrics=metrics)
    enc = Encoder(job=JOB, key=KEY, sender="coordinator", generation=0, wire_json=wire_json)
    out = enc.encode(f"ddpbus.{JOB}.control.all", msg)
    if wire_json:
        text = out.payload.decode()
        for token in ('"avg_loss": -0.0', '"Infinity"', '"-Infinity"', '"NaN"',
                      '"18446744073709551615"', '"-9223372036854775808"', "5e-324"):
            assert token in text
    got = Decoder(job=JOB, key=KEY).decode(out.subject, out.headers, out.payload).message
    assert isinstance(got, m.EpochAggregated)
    assert math.copysign(1.0, got.metrics.avg_loss) == -1.0
    assert math.copysign(1.0, got.metrics.scalars["é"]) == -1.0
    assert math.copysign(1.0, got.metrics.per_rank_loss[1]) == -1.0
    assert_same(got, msg)


# ------------------------------------------------------------------ protocol rules


def _signed_headers(subject: str, msg_type: str, payload: bytes, *,
                    content_type: str = sj.CONTENT_PROTOBUF) -> dict[str, str]:
    gen, msg_id = "4", "coordinator.g4.1"
    return {
        sj.H_TYPE: msg_type, sj.H_SCHEMA: "1", sj.H_JOB: JOB,
        sj.H_RANK: subject.rsplit(".", 1)[1], sj.H_GEN: gen, sj.H_MSG_ID: msg_id,
        sj.H_CONTENT_TYPE: content_type,
        sj.H_SIG: Signer(KEY).sign(subject, msg_type, gen, msg_id, content_type, payload),
    }


_RESERVED = [
    (m.Checkpoint(version=3, target_rank=U64_MAX),
     pb.ControlMsg(checkpoint=pb.ControlMsg.Checkpoint(version=3, target_rank=U64_MAX))),
    (m.ExecuteEvalCallback(schedule_id=1, epoch=2, target_rank=U64_MAX),
     pb.ControlMsg(execute_eval_callback=pb.ControlMsg.ExecuteEvalCallback(
         schedule_id=1, epoch=2, target_rank=U64_MAX))),
    (m.SaveConsensusModel(target_rank=U64_MAX),
     pb.ControlMsg(save_consensus_model=pb.ControlMsg.SaveConsensusModel(
         target_rank=U64_MAX))),
]


@pytest.mark.parametrize(("msg", "wire"), _RESERVED, ids=lambda x: type(x).__name__)
def test_reserved_target_rank_refused_both_ways(msg: Any, wire: pb.ControlMsg) -> None:
    subject = f"ddpbus.{JOB}.control.rank.0"
    with pytest.raises(EncodeError, match="reserved"):
        convert.to_wire(msg)
    with pytest.raises(EncodeError, match="reserved"):
        Encoder(job=JOB, key=KEY, sender="coordinator", generation=4).encode(subject, msg)
    # just below the reserved value is an ordinary rank
    ok = dataclasses.replace(msg, target_rank=U64_MAX - 1)
    assert convert.from_wire(*convert.to_wire(ok)) == ok

    type_name = convert.BY_CLASS[type(msg)].type_name
    for content_type, payload in ((sj.CONTENT_PROTOBUF, wire.SerializeToString()),
                                  (sj.CONTENT_JSON, to_json(wire).encode())):
        headers = _signed_headers(subject, type_name, payload, content_type=content_type)
        with pytest.raises(InvalidField, match="reserved") as info:
            Decoder(job=JOB, key=KEY).decode(subject, headers, payload)
        assert type(info.value) is InvalidField
        assert info.value.reason == "invalid-field"


@pytest.mark.parametrize("number", [6, 77, 2**31 - 1, -1])
def test_unknown_save_reason_decodes_as_graceful_shutdown(number: int) -> None:
    wire = pb.ControlMsg(shutdown_with_save=pb.ControlMsg.ShutdownWithSave(reason=number))
    subject = f"ddpbus.{JOB}.control.all"
    for content_type, payload in ((sj.CONTENT_PROTOBUF, wire.SerializeToString()),
                                  (sj.CONTENT_JSON, to_json(wire).encode())):
        headers = _signed_headers(subject, "ControlMsg.ShutdownWithSave", payload,
                                  content_type=content_type)
        got = Decoder(job=JOB, key=KEY).decode(subject, headers, payload).message
        assert got == m.ShutdownWithSave(reason=m.SaveReason.GRACEFUL_SHUTDOWN)
        assert type(got.reason) is m.SaveReason  # type: ignore[union-attr]


@pytest.mark.parametrize("reason", list(m.SaveReason), ids=lambda r: r.name)
def test_known_save_reasons_keep_their_wire_number(reason: m.SaveReason) -> None:
    _, wire = convert.to_wire(m.ShutdownWithSave(reason=reason))
    assert wire.shutdown_with_save.reason == reason.value  # type: ignore[attr-defined]
    assert pb.SaveReason.Name(reason.value) == f"SAVE_REASON_{reason.name}"
    assert convert.save_reason_from_wire(reason.value) is reason


@pytest.mark.parametrize("cls", CONTROL_CLASSES, ids=lambda c: c.__name__)
@settings(max_examples=3, deadline=None)
@given(data=st.data())
def test_inner_dispatch(cls: type[Any], data: st.DataObject) -> None:
    msg = data.draw(STRATEGIES[cls])
    if cls in (m.Update, m.CoordHeartbeat):
        assert convert.inner_dispatch(msg) is None
    else:
        assert convert.inner_dispatch(msg) is msg


# -------------------------------------------------------------------- tensor frames


def _overhead(name: str, dtype: str, shape: tuple[int, ...], version: int) -> int:
    """Length prefix + the largest header a chunk of this tensor can have."""
    total = tensor.DTYPE_SIZES[dtype] * math.prod(shape)
    biggest = pb.TensorFrameHeader(name=name, dtype=dtype, shape=shape, total_bytes=total,
                                   chunk_offset=total, chunk_index=2**32 - 1,
                                   chunk_count=2**32 - 1, version=version)
    return 4 + biggest.ByteSize()


_SHAPES = st.lists(st.integers(0, 5), max_size=3).map(tuple)
_DTYPES = st.sampled_from(sorted(tensor.DTYPE_SIZES))


def _tensor_bytes(seed: int, dtype: str, shape: tuple[int, ...]) -> bytes:
    size = tensor.DTYPE_SIZES[dtype] * math.prod(shape)
    return np.random.default_rng(seed).bytes(size)


def _assert_zero_copy(chunk: tensor.TensorChunk, payload: bytes) -> None:
    assert isinstance(chunk.data, memoryview)
    assert chunk.data.obj is payload
    if chunk.data.nbytes:
        assert np.shares_memory(np.frombuffer(chunk.data, dtype=np.uint8),
                                np.frombuffer(payload, dtype=np.uint8))


@settings(max_examples=60, deadline=None)
@given(name=texts(), dtype=_DTYPES, shape=_SHAPES, version=u64s(),
       room=st.integers(1, 97), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_frames_round_trip(name: str, dtype: str, shape: tuple[int, ...], version: int,
                           room: int, seed: int, data: st.DataObject) -> None:
    raw = _tensor_bytes(seed, dtype, shape)
    max_payload = _overhead(name, dtype, shape, version) + room
    frames = list(tensor.encode_frames(name, dtype, shape, raw, max_payload=max_payload,
                                       version=version))
    assert all(len(f) <= max_payload for f in frames)
    assert len(frames) == max(1, -(-len(raw) // room))
    chunks = [tensor.decode_frame(f) for f in frames]
    for index, (chunk, frame) in enumerate(zip(chunks, frames, strict=True)):
        _assert_zero_copy(chunk, frame)
        assert (chunk.name, chunk.dtype, chunk.shape, chunk.version) == (
            name, dtype, shape, version)
        assert (chunk.chunk_index, chunk.chunk_count, chunk.total_bytes) == (
            index, len(frames), len(raw))
        assert bytes(chunk.data) == raw[chunk.chunk_offset:chunk.chunk_offset
                                        + chunk.data.nbytes]
    assert sum(c.data.nbytes for c in chunks) == len(raw)
    chunks = data.draw(st.permutations(chunks), label="arrival order")
    assembler = tensor.TensorAssembler(chunks[0])
    done = [assembler.complete] + [assembler.add(c) for c in chunks[1:]]
    assert done == [False] * (len(chunks) - 1) + [True]
    assert bytes(assembler.buffer) == raw
    assert (assembler.name, assembler.dtype, assembler.shape) == (name, dtype, shape)


def test_frames_accept_every_buffer_kind_and_refuse_no_room() -> None:
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    for data in (arr.tobytes(), bytearray(arr.tobytes()), memoryview(arr)):
        (frame,) = tensor.encode_frames("w", "float32", (3, 4), data, max_payload=1024)
        chunk = tensor.decode_frame(frame)
        view = np.frombuffer(chunk.data, dtype=np.float32).reshape(chunk.shape)
        assert np.array_equal(view, arr)
        assert np.shares_memory(view, np.frombuffer(frame, dtype=np.uint8))
    with pytest.raises(EncodeError, match="no room"):
        list(tensor.encode_frames("w", "float32", (3, 4), arr.tobytes(), max_payload=10))
    with pytest.raises(EncodeError, match="needs 48 bytes"):
        list(tensor.encode_frames("w", "float32", (3, 4), b"\0" * 47, max_payload=1024))
    with pytest.raises(EncodeError, match="dtype"):
        list(tensor.encode_frames("w", "complex64", (1,), b"\0" * 8, max_payload=1024))


@pytest.mark.parametrize("target", ["rank", "consensus"])
@settings(max_examples=25, deadline=None)
@given(rank=u64s(), dtype=_DTYPES, shape=_SHAPES, version=u64s(), room=st.integers(1, 200),
       seed=st.integers(0, 2**32 - 1), generation=u64s())
def test_tensor_envelope_round_trip(target: str, rank: int, dtype: str, shape: tuple[int, ...],
                                    version: int, room: int, seed: int,
                                    generation: int) -> None:
    raw = _tensor_bytes(seed, dtype, shape)
    if target == "rank":
        subject, sender, env_rank = f"ddpbus.{JOB}.data.rank.{rank}", f"rank-{rank}", rank
    else:
        subject, sender, env_rank = f"ddpbus.{JOB}.data.consensus", "reducer", None
    cap = _overhead("layer.0.weight", dtype, shape, version) + room
    enc = Encoder(job=JOB, key=KEY, sender=sender, generation=generation,
                  max_frame_payload=cap, wire_json=True)  # frames stay binary regardless
    outs = list(enc.encode_tensor(subject, "layer.0.weight", dtype, shape, raw,
                                  version=version))
    dec = Decoder(job=JOB, key=KEY, max_frame_payload=cap)
    assembler = None
    for seq, out in enumerate(outs, start=1):
        assert len(out.payload) <= cap
        assert out.headers[sj.H_CONTENT_TYPE] == sj.CONTENT_PROTOBUF
        env = dec.decode(out.subject, out.headers, out.payload)
        assert (env.msg_type, env.rank, env.sender, env.generation) == (
            tensor.TYPE_NAME, env_rank, sender, generation)
        assert env.msg_id == f"{sender}.g{generation}.c{seq}"  # core NATS: counted apart
        chunk = env.message
        assert isinstance(chunk, tensor.TensorChunk)
        _assert_zero_copy(chunk, out.payload)
        if assembler is None:
            assembler = tensor.TensorAssembler(chunk)
        else:
            assembler.add(chunk)
    assert assembler is not None
    assert assembler.complete
    assert bytes(assembler.buffer) == raw
    assert assembler.version == version


def test_tensor_decode_is_zero_copy_through_the_decoder() -> None:
    arr = np.linspace(-1.0, 1.0, 64, dtype=np.float64)
    enc = Encoder(job=JOB, key=KEY, sender="rank-3", generation=1)
    (out,) = enc.encode_tensor(f"ddpbus.{JOB}.data.rank.3", "p", "float64", (64,),
                               memoryview(arr))
    payload = bytearray(out.payload)  # a writable receive buffer
    chunk = Decoder(job=JOB, key=KEY).decode(out.subject, out.headers, payload).message
    assert isinstance(chunk, tensor.TensorChunk)
    assert chunk.data.obj is payload
    view = np.frombuffer(chunk.data, dtype=np.float64)
    assert np.array_equal(view, arr)
    payload[-8:] = struct.pack("<d", 42.0)  # the view sees writes to the receive buffer
    assert view[-1] == 42.0
