"""Bad input: every refusal is exactly one DecodeError subclass and changes nothing.

:data:`CASES` is a table of ``(inbound message, expected class)`` whose classes must cover
:data:`ddpbus.codecs.errors.DECODE_ERRORS`. Each case runs between two decodes of a good
message on one :class:`Decoder` to show that a refusal leaves no trace, with a generation
floor that records its calls and can only be read. Hypothesis adds random, truncated and
tampered payloads and headers; the encoding side refuses out-of-range values and wrong
subjects with :class:`EncodeError`.

Cases are signed with the job key unless the point is the signature, so each one reaches
the check it is about (subjects.md's order: subject, size cap, headers, type, signature,
generation fence, payload).
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import pytest
from google.protobuf import json_format
from google.protobuf.message import DecodeError as PbDecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpbus.codecs import convert, errors, tensor
from ddpbus.codecs import messages as m
from ddpbus.codecs import subjects as sj
from ddpbus.codecs._pb import ddpbus_pb2 as pb
from ddpbus.codecs.envelope import (
    DEFAULT_FRAME_CAP,
    DEFAULT_MESSAGE_CAP,
    Decoder,
    Encoder,
    Envelope,
    Outbound,
    Signer,
)
from ddpbus.codecs.errors import (
    BadSignature,
    BadSubject,
    DecodeError,
    EncodeError,
    ForeignJob,
    InvalidField,
    MalformedPayload,
    MissingHeader,
    OversizeMessage,
    SchemaMismatch,
    StaleGeneration,
    UnknownType,
    UnsupportedContentType,
    WrongType,
)

JOB = "bad-job"
KEY = b"bad-input-test-key-0123456789abc"
OTHER_KEY = b"another-job-key-0123456789abcdef"
PROTO, JSON = sj.CONTENT_PROTOBUF, sj.CONTENT_JSON
U64_MAX = 2**64 - 1
SMALL_CAP = 64

T3 = f"ddpbus.{JOB}.timing.rank.3"
M3 = f"ddpbus.{JOB}.metrics.rank.3"
J3 = f"ddpbus.{JOB}.join.rank.3"
A3 = f"ddpbus.{JOB}.admit.rank.3"
C3 = f"ddpbus.{JOB}.control.rank.3"
CALL = f"ddpbus.{JOB}.control.all"
D3 = f"ddpbus.{JOB}.data.rank.3"

MODEL_SIG = b"\x07" * m.MODEL_SIGNATURE_BYTES
UID = bytes(range(m.NCCL_ID_BYTES))
BATCH = m.Batch(rank=3, batch_ms=12.5, data_ms=0.25, step_count=77, param_norm=3.0,
                batch_loss=0.5)
HELLO = m.Hello(rank=3, generation=5, host="h", device="cpu", model_signature=MODEL_SIG,
                world_size=4)
RUN = m.RunConfig(policy=m.Policy.CADENCE, backend=m.Backend.GLOO, batch_size=32, epochs=3,
                  seed=42, gamma=1.0, lr_scale_ratio=1.0, dataset_size=1000)


# --------------------------------------------------------------------------- helpers


def sign(subject: str, msg_type: str, payload: bytes | bytearray | memoryview, *,
         gen: str = "5", msg_id: str = "rank-3.g5.1", content_type: str = PROTO,
         job: str = JOB, rank_header: str | None = None, schema: str = "1",
         key: bytes = KEY) -> dict[str, str]:
    """Headers as a sender holding ``key`` would write them."""
    return {
        sj.H_TYPE: msg_type, sj.H_SCHEMA: schema, sj.H_JOB: job,
        sj.H_RANK: subject.rsplit(".", 1)[-1] if rank_header is None else rank_header,
        sj.H_GEN: gen, sj.H_MSG_ID: msg_id, sj.H_CONTENT_TYPE: content_type,
        sj.H_SIG: Signer(key).sign(subject, msg_type, gen, msg_id, content_type, payload),
    }


def edit(headers: Mapping[str, str], **changes: str | None) -> dict[str, str]:
    """A copy with headers replaced (``None`` removes one); keys use ``_`` for ``-``."""
    out = dict(headers)
    for name, value in changes.items():
        header = name.replace("_", "-")
        if value is None:
            out.pop(header, None)
        else:
            out[header] = value
    return out


def pb_bytes(wire: Any) -> bytes:
    data: bytes = wire.SerializeToString()
    return data


def rank3(sender: str = "rank-3", generation: int = 5, *, wire_json: bool = False
          ) -> Encoder:
    return Encoder(job=JOB, key=KEY, sender=sender, generation=generation, wire_json=wire_json)


def good_batch(*, wire_json: bool = False) -> Outbound:
    return rank3(wire_json=wire_json).encode(T3, BATCH, seq=1)


def frame(**fields: Any) -> bytes:
    """A tensor frame with a hand-written header (``fields`` override a valid one)."""
    head = {"name": "w", "dtype": "uint8", "shape": [4], "total_bytes": 4, "chunk_offset": 0,
            "chunk_index": 0, "chunk_count": 1, "version": 1}
    data = fields.pop("data", b"\x01\x02\x03\x04")
    head.update(fields)
    header = pb_bytes(pb.TensorFrameHeader(**head))
    return len(header).to_bytes(4, "little") + header + data


def _c(family: str, **variant: Any) -> bytes:
    return pb_bytes(getattr(pb, family)(**variant))


# ------------------------------------------------------------------------ the table


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    expected: type[DecodeError]
    subject: str
    headers: Mapping[str, str] | None
    payload: bytes
    floors: Mapping[str, int] = dataclasses.field(default_factory=dict)
    max_payload: int = DEFAULT_MESSAGE_CAP
    max_frame_payload: int = DEFAULT_FRAME_CAP
    match: str = ""


def _signed(id_: str, expected: type[DecodeError], subject: str, msg_type: str,
            payload: bytes, match: str = "", **sign_kw: Any) -> Case:
    return Case(id_, expected, subject, sign(subject, msg_type, payload, **sign_kw), payload,
                match=match)


def _malformed() -> list[Case]:
    sync_ack = pb_bytes(convert.to_wire(m.SyncAck(rank=3, step_count=1, divergence=0.0))[1])
    return [
        _signed("garbage", MalformedPayload, T3, "TimingMsg.Batch", b"\xff" * 11 + b"junk"),
        _signed("garbage-json", MalformedPayload, T3, "TimingMsg.Batch", b"\xff{",
                content_type=JSON),
        _signed("not-json-object", MalformedPayload, T3, "TimingMsg.Batch", b"[1]",
                content_type=JSON),
        _signed("deep-json", MalformedPayload, T3, "TimingMsg.Batch", b"[" * 100_000,
                content_type=JSON),
        _signed("empty", MalformedPayload, T3, "TimingMsg.Batch", b"", match="no variant"),
        _signed("says-batch-holds-sync-ack", MalformedPayload, T3, "TimingMsg.Batch",
                sync_ack, match="sync_ack"),
        _signed("says-hello-holds-rejoin", MalformedPayload, J3, "JoinMsg.Hello",
                pb_bytes(convert.to_wire(m.Rejoin(hello=HELLO, resume_stream_seq=1))[1])),
        _signed("protobuf-labelled-json", MalformedPayload, T3, "TimingMsg.Batch",
                good_batch().payload, content_type=JSON),
        _signed("tensor-garbage", MalformedPayload, D3, tensor.TYPE_NAME, b"\x01\x00"),
        _signed("tensor-header-too-long", MalformedPayload, D3, tensor.TYPE_NAME,
                b"\xff\xff\x00\x00" + b"\x00" * 16),
    ]


def _oversize() -> list[Case]:
    garbage = b"\xff" * (SMALL_CAP + 1)
    huge = b"\xff" * (DEFAULT_MESSAGE_CAP + 1)
    unsigned = edit(good_batch().headers, Ddpbus_Sig=None)
    return [
        # unsigned garbage: the size cap fires before the signature and before parsing
        Case("garbage-over-small-cap", OversizeMessage, T3, unsigned, garbage,
             max_payload=SMALL_CAP),
        Case("garbage-over-default-cap", OversizeMessage, T3, unsigned, huge),
        Case("signed-garbage-over-cap", OversizeMessage, T3,
             sign(T3, "TimingMsg.Batch", garbage), garbage, max_payload=SMALL_CAP),
        Case("frame-over-frame-cap", OversizeMessage, D3,
             sign(D3, tensor.TYPE_NAME, frame()), frame(), max_frame_payload=16),
    ]


def _missing_header() -> list[Case]:
    good = good_batch()
    cases = [
        Case(f"no-{name}", MissingHeader, T3, edit(good.headers, **{name.replace("-", "_"):
                                                                     None}), good.payload,
             match=name)
        for name in (sj.H_TYPE, sj.H_SCHEMA, sj.H_JOB, sj.H_RANK, sj.H_GEN)
    ]
    cases += [
        Case("no-headers", MissingHeader, T3, None, good.payload),
        Case("empty-type", MissingHeader, T3, edit(good.headers, Ddpbus_Type=""), good.payload),
        Case("empty-gen", MissingHeader, T3, edit(good.headers, Ddpbus_Gen=""), good.payload),
    ]
    for gen in ("-1", "x", "1.0", " 5", "\u0665"):  # the last: ARABIC-INDIC DIGIT FIVE
        cases.append(_signed(f"gen-{gen!r}", MissingHeader, T3, "TimingMsg.Batch",
                             good.payload, gen=gen, match="generation"))
    return cases


def _bad_signature() -> list[Case]:
    good = good_batch()
    good_json = good_batch(wire_json=True)
    ctl = rank3("coordinator").encode(f"ddpbus.{JOB}.control.rank.1", m.SyncNow(), seq=1)
    flipped = bytes([good.payload[0] ^ 1]) + good.payload[1:]
    sig = good.headers[sj.H_SIG]
    return [
        Case("no-sig", BadSignature, T3, edit(good.headers, Ddpbus_Sig=None), good.payload,
             match="missing"),
        Case("empty-sig", BadSignature, T3, edit(good.headers, Ddpbus_Sig=""), good.payload),
        Case("short-sig", BadSignature, T3, edit(good.headers, Ddpbus_Sig=sig[:-2]),
             good.payload),
        Case("wrong-key", BadSignature, T3,
             sign(T3, "TimingMsg.Batch", good.payload, key=OTHER_KEY), good.payload,
             match="verify"),
        Case("tampered-payload", BadSignature, T3, good.headers, flipped),
        Case("appended-payload", BadSignature, T3, good.headers, good.payload + b"\x00"),
        Case("tampered-subject", BadSignature, f"ddpbus.{JOB}.timing.rank.4",
             edit(good.headers, Ddpbus_Rank="4"), good.payload),
        Case("replayed-on-another-rank", BadSignature, f"ddpbus.{JOB}.control.rank.2",
             edit(ctl.headers, Ddpbus_Rank="2"), ctl.payload),
        Case("tampered-generation", BadSignature, T3, edit(good.headers, Ddpbus_Gen="6"),
             good.payload),
        Case("generation-leading-zero", BadSignature, T3, edit(good.headers, Ddpbus_Gen="05"),
             good.payload),
        Case("tampered-msg-id", BadSignature, T3,
             edit(good.headers, Nats_Msg_Id="rank-3.g5.2"), good.payload),
        Case("no-msg-id", BadSignature, T3, edit(good.headers, Nats_Msg_Id=None),
             good.payload),
        Case("swapped-content-type", BadSignature, T3,
             edit(good.headers, Content_Type=JSON), good.payload),
        Case("json-without-content-type", BadSignature, T3,
             edit(good_json.headers, Content_Type=None), good_json.payload),
        Case("newline-in-msg-id", BadSignature, T3,
             edit(good.headers, Nats_Msg_Id="rank-3.g5.1\n"), good.payload),
    ]


def _types() -> list[Case]:
    good = good_batch()
    live = f"ddpbus.{JOB}.live.rank.3"
    sync_now = _c("ControlMsg", sync_now=pb.ControlMsg.SyncNow())
    return [
        _signed("nope", UnknownType, T3, "TimingMsg.Nope", good.payload),
        _signed("bare-family", UnknownType, T3, "TimingMsg", good.payload),
        _signed("other-family-name", UnknownType, T3, "ControlMsg.Batch", good.payload),
        _signed("lower-case", UnknownType, T3, "timingmsg.batch", good.payload),
        _signed("control-on-timing", WrongType, T3, "ControlMsg.SyncNow", sync_now),
        _signed("frame-on-timing", WrongType, T3, tensor.TYPE_NAME, frame()),
        _signed("metrics-on-control", WrongType, CALL, "MetricsMsg", good.payload),
        _signed("batch-on-live", WrongType, live, "TimingMsg.Batch", good.payload),
        _signed("sync-now-on-live-coordinator", WrongType, f"ddpbus.{JOB}.live.coordinator",
                "ControlMsg.SyncNow", sync_now),
        _signed("hello-on-admit", WrongType, A3, "JoinMsg.Hello", good.payload),
        _signed("batch-on-data", WrongType, D3, "TimingMsg.Batch", good.payload),
    ]


_BAD_SUBJECTS = (
    "foo.bad-job.timing.rank.3", "ddpbus", "DDPBUS.bad-job.timing.rank.3", "",
    "ddpbus..timing.rank.3", "ddpbus.bad job.timing.rank.3", f"ddpbus.{'j' * 65}.control.all",
    f"ddpbus.{JOB}", f"ddpbus.{JOB}.timing", f"ddpbus.{JOB}.timing.rank",
    f"ddpbus.{JOB}.timing.rank.3.4", f"ddpbus.{JOB}.control.all.3", f"ddpbus.{JOB}.control",
    f"ddpbus.{JOB}.nope.rank.3", f"ddpbus.{JOB}.live.coordinator.3", f"ddpbus.{JOB}.timing.*",
    f"ddpbus.{JOB}.timing.>", f"ddpbus.{JOB}.data.all",
)
_BAD_TOKENS = ("01", "-1", "x", "", "+1", " 1", "1e3", "0x1", "\uff13", "18446744073709551616",
               "99999999999999999999")


def _bad_subject() -> list[Case]:
    good = good_batch()
    cases = [
        Case("rank-header-disagrees", BadSubject, T3, edit(good.headers, Ddpbus_Rank="4"),
             good.payload, match=sj.H_RANK),
        Case("rank-header-non-canonical", BadSubject, T3, edit(good.headers, Ddpbus_Rank="03"),
             good.payload),
        Case("rank-header-on-broadcast", BadSubject, CALL,
             sign(CALL, "ControlMsg.SyncNow", b"\x1a\x00", rank_header="3"), b"\x1a\x00"),
    ]
    cases += [_signed(f"subject-{subject!r}", BadSubject, subject, "TimingMsg.Batch",
                      good.payload) for subject in _BAD_SUBJECTS]
    cases += [_signed(f"token-{token!r}", BadSubject, f"ddpbus.{JOB}.timing.rank.{token}",
                      "TimingMsg.Batch", good.payload, match="rank token")
              for token in _BAD_TOKENS]
    return cases


def _fence_and_job() -> list[Case]:
    good = good_batch()
    ctl = rank3("coordinator", 2).encode(C3, m.Throttle(), seq=1)
    other = "ddpbus.other-job.timing.rank.3"
    return [
        _signed("schema-2", SchemaMismatch, T3, "TimingMsg.Batch", good.payload, schema="2"),
        _signed("schema-1.0", SchemaMismatch, T3, "TimingMsg.Batch", good.payload,
                schema="1.0"),
        _signed("foreign-subject", ForeignJob, other, "TimingMsg.Batch", good.payload,
                job="other-job", match="other-job"),
        _signed("foreign-header", ForeignJob, T3, "TimingMsg.Batch", good.payload,
                job="other-job", match="other-job"),
        _signed("foreign-subject-own-header", ForeignJob, other, "TimingMsg.Batch",
                good.payload),
        Case("stale-rank", StaleGeneration, T3, good.headers, good.payload,
             floors={"rank-3": 6}, match="rank-3 generation 5 < fence 6"),
        Case("stale-at-max-floor", StaleGeneration, T3, good.headers, good.payload,
             floors={"rank-3": U64_MAX}),
        Case("stale-coordinator", StaleGeneration, C3, ctl.headers, ctl.payload,
             floors={"coordinator": 3}),
    ]


def _invalid_field() -> list[Case]:
    c, j, t = pb.ControlMsg, pb.JoinMsg, pb.TimingMsg
    hello = convert.to_wire(HELLO)[1].hello  # type: ignore[attr-defined]
    bad_world = pb.JoinMsg.Hello()
    bad_world.CopyFrom(hello)
    bad_world.world_size = 3
    short_sig = pb.JoinMsg.Hello()
    short_sig.CopyFrom(hello)
    short_sig.model_signature = MODEL_SIG[:-1]
    return [
        _signed("payload-rank-4-on-rank-3", InvalidField, T3, "TimingMsg.Batch",
                pb_bytes(convert.to_wire(dataclasses.replace(BATCH, rank=4))[1]),
                match="rank=4"),
        _signed("metrics-rank-0-on-rank-3", InvalidField, M3, "MetricsMsg", b""),
        _signed("json-rank-4-on-rank-3", InvalidField, T3, "TimingMsg.Exiting",
                b'{"exiting": {"rank": "4"}}', content_type=JSON),
        _signed("accept-for-other-rank", InvalidField, A3, "AdmitMsg.Accept",
                _c("AdmitMsg", accept=pb.AdmitMsg.Accept(
                    rank=2, run=convert.run_config_to_wire(RUN)))),
        _signed("accept-without-run", InvalidField, A3, "AdmitMsg.Accept",
                _c("AdmitMsg", accept=pb.AdmitMsg.Accept(rank=3)), match="run is required"),
        _signed("accept-unknown-policy", InvalidField, A3, "AdmitMsg.Accept",
                _c("AdmitMsg", accept=pb.AdmitMsg.Accept(rank=3, run=pb.RunConfig(
                    backend=pb.BACKEND_GLOO, batch_size=1, coordinator_timeout_s=1.0))),
                match="policy"),
        _signed("accept-zero-batch", InvalidField, A3, "AdmitMsg.Accept",
                _c("AdmitMsg", accept=pb.AdmitMsg.Accept(rank=3, run=pb.RunConfig(
                    policy=pb.POLICY_SYNC, backend=pb.BACKEND_GLOO, batch_size=0,
                    coordinator_timeout_s=1.0))), match="batch_size"),
        _signed("accept-nan-collective-timeout", InvalidField, A3, "AdmitMsg.Accept",
                _c("AdmitMsg", accept=pb.AdmitMsg.Accept(rank=3, run=pb.RunConfig(
                    policy=pb.POLICY_SYNC, backend=pb.BACKEND_GLOO, batch_size=1,
                    coordinator_timeout_s=1.0, collective_timeout_s=float("nan")))),
                match="collective_timeout_s"),
        _signed("sync-ack-negative-average-ms", InvalidField, T3, "TimingMsg.SyncAck",
                _c("TimingMsg", sync_ack=pb.TimingMsg.SyncAck(rank=3, average_ms=-1.0)),
                match="average_ms"),
        _signed("sync-ack-nan-received-at", InvalidField, T3, "TimingMsg.SyncAck",
                _c("TimingMsg", sync_ack=pb.TimingMsg.SyncAck(
                    rank=3, received_at=float("nan"))), match="received_at"),
        _signed("rejoin-hello-other-rank", InvalidField, f"ddpbus.{JOB}.join.rank.2",
                "JoinMsg.Rejoin", _c("JoinMsg", rejoin=j.Rejoin(hello=hello))),
        _signed("reserved-target-rank", InvalidField, C3, "ControlMsg.Checkpoint",
                _c("ControlMsg", checkpoint=c.Checkpoint(target_rank=U64_MAX)),
                match="reserved"),
        _signed("uid-127-bytes", InvalidField, T3, "TimingMsg.NewNcclIdGenerated",
                _c("TimingMsg", new_nccl_id_generated=t.NewNcclIdGenerated(
                    rank=3, uid_bytes=UID[:-1])), match="128 bytes"),
        _signed("session-uid-129-bytes", InvalidField, C3, "ControlMsg.NewNcclSession",
                _c("ControlMsg", new_nccl_session=c.NewNcclSession(
                    uid_bytes=UID + b"\x00", new_rank=0, new_world_size=1))),
        _signed("session-rank-not-below-world", InvalidField, C3, "ControlMsg.NewNcclSession",
                _c("ControlMsg", new_nccl_session=c.NewNcclSession(
                    uid_bytes=UID, new_rank=2, new_world_size=2))),
        _signed("hello-rank-not-below-world", InvalidField, J3, "JoinMsg.Hello",
                _c("JoinMsg", hello=bad_world), match="world_size"),
        _signed("hello-signature-31-bytes", InvalidField, J3, "JoinMsg.Hello",
                _c("JoinMsg", hello=short_sig)),
        _signed("rejoin-without-hello", InvalidField, J3, "JoinMsg.Rejoin",
                _c("JoinMsg", rejoin=j.Rejoin(resume_stream_seq=1))),
        _signed("start-epoch-without-plan", InvalidField, C3, "ControlMsg.StartEpoch",
                _c("ControlMsg", start_epoch=c.StartEpoch())),
        _signed("global-step-plan-entry-without-plan", InvalidField, CALL,
                "ControlMsg.SetGlobalStep",
                _c("ControlMsg", set_global_step=c.SetGlobalStep(
                    global_step=1, plans=[pb.RankPlan(rank=3)])), match="rank 3"),
        _signed("aggregated-without-metrics", InvalidField, CALL, "ControlMsg.EpochAggregated",
                _c("ControlMsg", epoch_aggregated=c.EpochAggregated())),
        _signed("update-realized-without-digest", InvalidField, C3, "ControlMsg.Update",
                _c("ControlMsg", update=c.Update(version=1, realized=True)),
                match="digest"),
        _signed("update-unrealized-with-digest", InvalidField, C3, "ControlMsg.Update",
                _c("ControlMsg", update=c.Update(version=1, digest="SHA-256=x")),
                match="digest"),
        _signed("intent-unspecified", InvalidField, T3, "TimingMsg.Intent",
                _c("TimingMsg", intent=t.Intent(rank=3))),
        _signed("intent-unknown-number", InvalidField, T3, "TimingMsg.Intent",
                _c("TimingMsg", intent=t.Intent(rank=3, kind=9))),
        *_bad_reports(t),
        _signed("heartbeat-reason-not-a-slug", InvalidField, f"ddpbus.{JOB}.live.rank.3",
                "TimingMsg.Heartbeat", _c("TimingMsg", heartbeat=t.Heartbeat(
                    rank=3, rejections={"Bad Signature": 1})), match="rejections"),
        _signed("heartbeat-65-reasons", InvalidField, f"ddpbus.{JOB}.live.rank.3",
                "TimingMsg.Heartbeat", _c("TimingMsg", heartbeat=t.Heartbeat(
                    rank=3, rejections={f"r{i}": 1 for i in range(65)})), match="at most 64"),
        *(_signed(f"heartbeat-connection-{name}", InvalidField, f"ddpbus.{JOB}.live.rank.3",
                  "TimingMsg.Heartbeat", _c("TimingMsg", heartbeat=t.Heartbeat(
                      rank=3, connection=bad)), match="Heartbeat.connection")
          for name, bad in (("no-slash", "NSERVER"), ("lower-case", "nserver/3"),
                            ("cid-not-digits", "NSERVER/x"), ("too-long", "N" * 65 + "/1"),
                            ("trailing", "NSERVER/1\n"))),
        _signed("tensor-unknown-dtype", InvalidField, D3, tensor.TYPE_NAME,
                frame(dtype="complex64")),
        _signed("tensor-shape-disagrees", InvalidField, D3, tensor.TYPE_NAME,
                frame(shape=[5])),
        _signed("tensor-chunk-past-end", InvalidField, D3, tensor.TYPE_NAME,
                frame(chunk_offset=1)),
        _signed("tensor-index-not-below-count", InvalidField, D3, tensor.TYPE_NAME,
                frame(chunk_index=1)),
    ]


def _bad_reports(t: Any) -> list[Case]:
    """Coalesced reports: 1..256 items, all the sender's, Batch steps strictly rising."""
    def batch(rank: int = 3, step: int = 1) -> Any:
        return t.Reports.Item(batch=t.Batch(rank=rank, batch_ms=1.0, step_count=step))

    def reports(*items: Any) -> bytes:
        return _c("TimingMsg", reports=t.Reports(rank=3, items=items))

    lr = t.Reports.Item(lr_update=t.LrUpdate(rank=3, lr=0.1))
    return [
        _signed("reports-empty", InvalidField, T3, "TimingMsg.Reports", reports(),
                match="0 items"),
        _signed("reports-257-items", InvalidField, T3, "TimingMsg.Reports",
                reports(*(batch(step=i + 1) for i in range(m.MAX_REPORT_ITEMS + 1))),
                match="257 items"),
        _signed("reports-item-of-rank-4", InvalidField, T3, "TimingMsg.Reports",
                reports(batch(), batch(rank=4, step=2)), match="another rank"),
        _signed("reports-lr-of-rank-4", InvalidField, T3, "TimingMsg.Reports",
                reports(batch(), t.Reports.Item(lr_update=t.LrUpdate(rank=4, lr=0.1))),
                match="another rank"),
        _signed("reports-steps-not-rising", InvalidField, T3, "TimingMsg.Reports",
                reports(batch(step=5), lr, batch(step=5)), match="strictly rise"),
        _signed("reports-empty-item", InvalidField, T3, "TimingMsg.Reports",
                reports(batch(), t.Reports.Item()), match="no Batch or LrUpdate"),
        _signed("reports-of-rank-4-on-rank-3", InvalidField, T3, "TimingMsg.Reports",
                _c("TimingMsg", reports=t.Reports(rank=4, items=[batch(rank=4)])),
                match="rank=4"),
    ]


def _content_type() -> list[Case]:
    good = good_batch()
    return [
        _signed(f"content-{ct}", UnsupportedContentType, T3, "TimingMsg.Batch", good.payload,
                content_type=ct)
        for ct in ("text/plain", "application/x-protobuf", "application/json; charset=utf-8",
                   "APPLICATION/PROTOBUF")
    ] + [
        _signed("tensor-as-json", UnsupportedContentType, D3, tensor.TYPE_NAME, frame(),
                content_type=JSON),
    ]


CASES: tuple[Case, ...] = (
    *_malformed(), *_oversize(), *_missing_header(), *_bad_signature(), *_types(),
    *_bad_subject(), *_fence_and_job(), *_invalid_field(), *_content_type(),
)

#: Refused before the signature is checked, so the fence is never read for them.
_BEFORE_SIGNATURE = frozenset({BadSubject, ForeignJob, OversizeMessage, MissingHeader,
                               SchemaMismatch, UnknownType, WrongType, BadSignature})


class RecordingFloor:
    """A generation fence the decoder can only call: it reads the owner's dict through a
    read-only proxy (no copy, so a write would show there) and records every call."""

    __slots__ = ("_floors", "calls")

    def __init__(self, floors: dict[str, int]) -> None:
        self._floors = MappingProxyType(floors)
        self.calls: list[str] = []

    def __call__(self, sender: str) -> int:
        self.calls.append(sender)
        return self._floors.get(sender, 0)


def _state(obj: object) -> dict[str, Any]:
    names = vars(obj) if hasattr(obj, "__dict__") else obj.__slots__  # type: ignore[attr-defined]
    return {name: getattr(obj, name) for name in names}


#: The reference message each case runs between (fits every cap and fence in the table).
_REFERENCE = rank3("coordinator", 9).encode(CALL, m.SetGlobalStep(global_step=12345), seq=1)


def test_table_covers_every_decode_error() -> None:
    assert {c.expected for c in CASES} == set(errors.DECODE_ERRORS)
    assert len({c.id for c in CASES}) == len(CASES)


def test_decode_errors_are_listed_with_distinct_reasons() -> None:
    subclasses = {
        v for v in vars(errors).values()
        if isinstance(v, type) and issubclass(v, DecodeError) and v is not DecodeError
    }
    assert subclasses == set(errors.DECODE_ERRORS)
    reasons = [cls.reason for cls in errors.DECODE_ERRORS]
    assert all(reasons)
    assert len(set(reasons)) == len(reasons)
    assert DecodeError.reason not in reasons
    for cls in errors.DECODE_ERRORS:
        assert issubclass(cls, errors.DdpbusError)
        assert issubclass(cls, ValueError)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input_is_refused_with_its_reason_and_leaves_no_trace(case: Case) -> None:
    floors = dict(case.floors)
    floor = RecordingFloor(floors)
    dec = Decoder(job=JOB, key=KEY, max_payload=case.max_payload,
                  max_frame_payload=case.max_frame_payload, generation_floor=floor)
    before = dec.decode(_REFERENCE.subject, _REFERENCE.headers, _REFERENCE.payload)
    state = _state(dec)
    headers = None if case.headers is None else dict(case.headers)
    floor.calls.clear()

    with pytest.raises(DecodeError) as info:
        dec.decode(case.subject, headers, case.payload)

    err = info.value
    assert type(err) is case.expected, f"{type(err).__name__}: {err}"
    assert err.reason == case.expected.reason
    assert str(err).startswith(f"{err.reason}: ")
    assert case.match in str(err)
    # nothing moved: the decoder, the inputs and the fence are as they were
    assert _state(dec).keys() == state.keys()
    assert all(_state(dec)[k] is v for k, v in state.items())
    assert headers == (None if case.headers is None else dict(case.headers))
    assert floors == dict(case.floors)
    if case.expected in _BEFORE_SIGNATURE:
        assert floor.calls == []  # an unverified message never reads the fence
    else:
        assert floor.calls == [sj.parse_subject(case.subject, JOB).sender]
    after = dec.decode(_REFERENCE.subject, _REFERENCE.headers, _REFERENCE.payload)
    assert after == before


# --------------------------------------------------------------------------- fence


@pytest.mark.parametrize(("floor", "passes"), [(0, True), (4, True), (5, True), (6, False)])
def test_generation_floor_is_inclusive(floor: int, passes: bool) -> None:
    fence = RecordingFloor({"rank-3": floor, "coordinator": 99})
    dec = Decoder(job=JOB, key=KEY, generation_floor=fence)
    good = good_batch()
    if passes:
        assert dec.decode(good.subject, good.headers, good.payload).generation == 5
    else:
        with pytest.raises(StaleGeneration):
            dec.decode(good.subject, good.headers, good.payload)
    assert fence.calls == ["rank-3"]


def test_fence_is_asked_about_the_subjects_sender() -> None:
    fence = RecordingFloor({})
    dec = Decoder(job=JOB, key=KEY, generation_floor=fence)
    outs = [
        rank3().encode(T3, BATCH),
        rank3().encode(f"ddpbus.{JOB}.live.rank.3", m.Heartbeat(rank=3, step_count=1)),
        rank3("coordinator").encode(CALL, m.SyncNow()),
        rank3("coordinator").encode(A3, m.Reject(rank=3, generation=5, reason="no")),
        *rank3("reducer").encode_tensor(f"ddpbus.{JOB}.data.consensus", "w", "uint8", (2,),
                                        b"\x01\x02"),
    ]
    for out in outs:
        dec.decode(out.subject, out.headers, out.payload)
    assert fence.calls == ["rank-3", "rank-3", "coordinator", "coordinator", "reducer"]


def test_protobuf_is_the_default_content_type() -> None:
    good = good_batch()
    env = Decoder(job=JOB, key=KEY).decode(T3, edit(good.headers, Content_Type=None),
                                           good.payload)
    assert env.message == BATCH
    assert env.content_type == PROTO


# ---------------------------------------------------------------- random payloads

#: (subject, Ddpbus-Type) pairs that the subject allows; ranked ones are rank 3.
_TARGETS = (
    (T3, "TimingMsg.Batch"), (T3, "TimingMsg.Heartbeat"), (T3, "TimingMsg.EvalResult"),
    (M3, "MetricsMsg"), (J3, "JoinMsg.Hello"), (J3, "JoinMsg.Rejoin"),
    (A3, "AdmitMsg.Accept"), (CALL, "ControlMsg.SyncNow"), (C3, "ControlMsg.StageAdvisory"),
    (C3, "ControlMsg.Checkpoint"), (CALL, "ControlMsg.EpochAggregated"),
)


def _reference_parse(msg_type: str, content_type: str, payload: bytes) -> Any:
    """What protobuf itself makes of ``payload`` (None when it refuses it)."""
    variant = convert.BY_TYPE[msg_type]
    wire = variant.family()
    try:
        if content_type == PROTO:
            wire.ParseFromString(payload)
        else:
            json_format.Parse(payload.decode(), wire, ignore_unknown_fields=True)
    except (PbDecodeError, json_format.ParseError, ValueError, RecursionError):
        return None
    return wire


def _decode_or_error(dec: Decoder, subject: str, headers: Mapping[str, str] | None,
                     payload: bytes) -> Envelope | DecodeError:
    try:
        return dec.decode(subject, headers, payload)
    except DecodeError as exc:
        return exc


@settings(max_examples=150, deadline=None)
@given(target=st.sampled_from(_TARGETS), json_=st.booleans(),
       payload=st.one_of(st.binary(max_size=120),
                         st.sampled_from([b"", b"{}", b"null", b"\x0a\x00", b"\x1a\x00"])))
def test_random_signed_payload(target: tuple[str, str], json_: bool, payload: bytes) -> None:
    """A signed payload of random bytes: MalformedPayload, InvalidField, or (when the bytes
    happen to be a valid message) exactly what protobuf itself parses."""
    subject, msg_type = target
    content_type = JSON if json_ else PROTO
    headers = sign(subject, msg_type, payload, content_type=content_type)
    got = _decode_or_error(Decoder(job=JOB, key=KEY), subject, headers, payload)
    wire = _reference_parse(msg_type, content_type, payload)
    if wire is None:
        assert type(got) is MalformedPayload
    elif isinstance(got, DecodeError):
        assert type(got) in (MalformedPayload, InvalidField)  # e.g. no/other variant, rank
    else:
        expected = convert.from_wire(convert.BY_TYPE[msg_type], wire)
        assert repr(got.message) == repr(expected)  # repr: NaN-aware, sign-of-zero aware


@settings(max_examples=60, deadline=None)
@given(target=st.sampled_from(_TARGETS), json_=st.booleans(), tail=st.binary(max_size=60))
def test_unparseable_signed_payload_is_malformed(target: tuple[str, str], json_: bool,
                                                 tail: bytes) -> None:
    subject, msg_type = target
    # an 11-byte varint tag is never valid protobuf; 0xff never starts UTF-8 text
    payload = (b"\xff" if json_ else b"\xff" * 11) + tail
    content_type = JSON if json_ else PROTO
    headers = sign(subject, msg_type, payload, content_type=content_type)
    with pytest.raises(MalformedPayload) as info:
        Decoder(job=JOB, key=KEY).decode(subject, headers, payload)
    assert type(info.value) is MalformedPayload


@settings(max_examples=80, deadline=None)
@given(target=st.sampled_from(_TARGETS), json_=st.booleans(), payload=st.binary(max_size=200),
       sig=st.one_of(st.none(), st.text(alphabet="0123456789abcdef", min_size=64,
                                         max_size=64)))
def test_random_unsigned_payload_is_bad_signature(target: tuple[str, str], json_: bool,
                                                  payload: bytes, sig: str | None) -> None:
    subject, msg_type = target
    headers = sign(subject, msg_type, b"something else", content_type=JSON if json_ else PROTO)
    headers = edit(headers, Ddpbus_Sig=sig)
    with pytest.raises(BadSignature) as info:
        Decoder(job=JOB, key=KEY).decode(subject, headers, payload)
    assert type(info.value) is BadSignature


# ------------------------------------------------------------------ truncated payloads

_SAMPLES: tuple[tuple[str, str, m.Message], ...] = (
    (T3, "rank-3", BATCH),
    (T3, "rank-3", m.EvalResult(rank=3, schedule_id=1, epoch=2, metric=0.5, elapsed_ms=1.0,
                                error="boom")),
    (M3, "rank-3", m.MetricsMsg(
        rank=3, epoch=7, avg_loss=0.25, batches_processed=10, epoch_ms=100.0,
        samples_processed=320, scalars={"acc": m.ScalarSum(sum=9.0, count=10)},
        resources=m.ResourceSample(cpu_percent=50.0, ram_used_bytes=1, ram_total_bytes=2))),
    (J3, "rank-3", m.Rejoin(hello=HELLO, resume_stream_seq=99, checkpoint_version=3)),
    (A3, "coordinator", m.Accept(rank=3, generation=5, world_size=4, coordinator_generation=1,
                                       run=RUN)),
    (CALL, "coordinator", m.EpochAggregated(metrics=m.EpochMetrics(
        epoch=1, avg_loss=0.5, epoch_ms=3.0, scalars={"loss": 0.5}, per_rank=({"a": 1.0},),
        device_indices=(-1, 0)))),
    (C3, "coordinator", m.NewNcclSession(uid_bytes=UID, new_rank=1, new_world_size=2)),
    (C3, "coordinator", m.StageAdvisory(counts=(1, 2), segments=(
        m.Segment(epoch=1, spans=(m.Span(offset=0, size=5),)),))),
)


@settings(max_examples=120, deadline=None)
@given(sample=st.sampled_from(_SAMPLES), json_=st.booleans(), data=st.data())
def test_truncated_payload(sample: tuple[str, str, m.Message], json_: bool,
                           data: st.DataObject) -> None:
    subject, sender, msg = sample
    out = rank3(sender, wire_json=json_).encode(subject, msg, seq=1)
    cut = data.draw(st.integers(0, len(out.payload) - 1), label="cut")
    short = out.payload[:cut]
    dec = Decoder(job=JOB, key=KEY)

    # as captured: the signature no longer verifies
    with pytest.raises(BadSignature):
        dec.decode(subject, out.headers, short)

    # re-signed after truncation: the payload itself is refused
    msg_type = out.headers[sj.H_TYPE]
    content_type = out.headers[sj.H_CONTENT_TYPE]
    headers = sign(subject, msg_type, short, content_type=content_type)
    got = _decode_or_error(dec, subject, headers, short)
    if isinstance(got, DecodeError):
        assert type(got) in (MalformedPayload, InvalidField)
    else:
        # MetricsMsg is the one family without a oneof wrapper: a binary prefix ending on a
        # field boundary is a valid, shorter message (proto3 defaults for the rest)
        assert msg_type == "MetricsMsg"
        assert content_type == PROTO
        assert got.message == convert.from_wire(convert.BY_TYPE[msg_type],
                                                pb.MetricsMsg.FromString(short))


# ------------------------------------------------------------------ tampered headers

_PRINTABLE = st.text(alphabet=string.printable, max_size=24)


@settings(max_examples=150, deadline=None)
@given(changes=st.dictionaries(
    st.sampled_from([sj.H_TYPE, sj.H_SCHEMA, sj.H_JOB, sj.H_RANK, sj.H_GEN, sj.H_MSG_ID,
                     sj.H_CONTENT_TYPE, sj.H_SIG]),
    st.one_of(st.none(), _PRINTABLE), min_size=1),
    subject=st.one_of(st.just(T3), st.sampled_from([C3, J3, D3, "ddpbus.x.timing.rank.3"]),
                      _PRINTABLE))
def test_tampered_headers_are_refused(changes: dict[str, str | None], subject: str) -> None:
    """Any change to the subject or a header gives a DecodeError (never another exception)
    unless it left every checked value as it was."""
    good = good_batch()
    headers = dict(good.headers)
    for name, value in changes.items():
        if value is None:
            headers.pop(name, None)
        else:
            headers[name] = value
    got = _decode_or_error(Decoder(job=JOB, key=KEY), subject, headers, good.payload)
    if isinstance(got, Envelope):
        assert subject == T3
        assert got.message == BATCH
        # only a dropped (absent or empty) Content-Type is harmless: protobuf is the default
        assert {k: v for k, v in headers.items() if k != sj.H_CONTENT_TYPE} == {
            k: v for k, v in good.headers.items() if k != sj.H_CONTENT_TYPE}
        assert headers.get(sj.H_CONTENT_TYPE) in (None, "", PROTO)
    else:
        assert type(got) in errors.DECODE_ERRORS


# ------------------------------------------------------------------------ encoding


@pytest.mark.parametrize("msg", [
    dataclasses.replace(BATCH, rank=-1),
    dataclasses.replace(BATCH, rank=2**64),
    dataclasses.replace(BATCH, step_count=-5),
    m.Heartbeat(rank=3, step_count=2**70),
    dataclasses.replace(BATCH, batch_ms="fast"),  # type: ignore[arg-type]
    m.NewNcclIdGenerated(rank=3, uid_bytes=UID[:-1]),
    m.NewNcclIdGenerated(rank=3, uid_bytes=UID + b"\x00"),
    m.EpochAggregated(metrics=m.EpochMetrics(epoch=1, avg_loss=0.0, epoch_ms=0.0,
                                             device_indices=(2**63,))),
], ids=["rank=-1", "rank=2**64", "step=-5", "step=2**70", "float-is-str", "uid-127",
        "uid-129", "sint64-overflow"])
def test_out_of_range_values_are_encode_errors(msg: m.Message) -> None:
    with pytest.raises(EncodeError):
        convert.to_wire(msg)
    subject = CALL if isinstance(msg, m.EpochAggregated) else T3
    sender = "coordinator" if isinstance(msg, m.EpochAggregated) else "rank-3"
    for wire_json in (False, True):
        with pytest.raises(EncodeError):
            rank3(sender, wire_json=wire_json).encode(subject, msg)


@pytest.mark.parametrize("items", [
    (), tuple(dataclasses.replace(BATCH, step_count=i + 1) for i in range(257)),
    (BATCH, dataclasses.replace(BATCH, rank=4, step_count=78)),
    (BATCH, m.LrUpdate(rank=2, lr=0.1)),
    (BATCH, m.LrUpdate(rank=3, lr=0.1), BATCH),
], ids=["empty", "257-items", "batch-of-rank-4", "lr-of-rank-2", "steps-not-rising"])
def test_bad_reports_are_encode_errors(items: tuple[m.Batch | m.LrUpdate, ...]) -> None:
    with pytest.raises(EncodeError, match=r"TimingMsg\.Reports"):
        rank3().encode(T3, m.Reports(rank=3, items=items))


@pytest.mark.parametrize("msg", [
    m.Hello(rank=3, generation=5, host="h", device="cpu", model_signature=MODEL_SIG[:-1],
            world_size=4),
    m.Rejoin(hello=dataclasses.replace(HELLO, model_signature=b""), resume_stream_seq=1),
    m.NewNcclSession(uid_bytes=b"", new_rank=0, new_world_size=1),
], ids=["hello-short-signature", "rejoin-empty-signature", "session-empty-uid"])
def test_wrong_length_bytes_are_encode_errors(msg: m.Message) -> None:
    with pytest.raises(EncodeError, match="bytes"):
        convert.to_wire(msg)


def test_encoder_refuses_wrong_subjects_and_senders() -> None:
    rank = rank3()
    coord = rank3("coordinator")
    refusals: list[tuple[Encoder, str, Any, str]] = [
        (rank, CALL, BATCH, "does not belong"),  # a timing message on a control subject
        (rank, f"ddpbus.{JOB}.live.rank.3", BATCH, "does not belong"),
        (coord, T3, m.SyncNow(), "does not belong"),
        (coord, J3, m.Accept(rank=3, generation=1, world_size=4, coordinator_generation=1,
                             run=RUN),
         "does not belong"),
        (rank, f"ddpbus.{JOB}.timing.rank.4", dataclasses.replace(BATCH, rank=4),
         "may not publish"),  # rank-3 publishing on rank-4's subject
        (coord, T3, BATCH, "may not publish"),
        (rank, CALL, m.SyncNow(), "may not publish"),
        (rank3("reducer"), T3, m.Exiting(rank=3), "may not publish"),
        (rank3("reducer"), D3, m.Exiting(rank=3), "does not belong"),
        (rank, T3, dataclasses.replace(BATCH, rank=4), "subject is rank 3"),
        (rank, "ddpbus.other-job.timing.rank.3", BATCH, "other-job"),
        (rank, "nats.timing.rank.3", BATCH, "not a ddpbus subject"),
        (rank, f"ddpbus.{JOB}.timing.rank.03", BATCH, "rank token"),
    ]
    for enc, subject, msg, text in refusals:
        with pytest.raises(EncodeError, match=text):
            enc.encode(subject, msg)
    with pytest.raises(EncodeError, match="does not belong"):
        list(rank.encode_tensor(T3, "w", "uint8", (1,), b"\x00"))
    with pytest.raises(EncodeError, match="may not publish"):
        list(rank.encode_tensor(f"ddpbus.{JOB}.data.rank.4", "w", "uint8", (1,), b"\x00"))


def test_encoder_refuses_bad_setup_and_oversize() -> None:
    with pytest.raises(EncodeError, match="generation"):
        Encoder(job=JOB, key=KEY, sender="rank-3", generation=-1)
    with pytest.raises(EncodeError, match="16 bytes"):
        Encoder(job=JOB, key=b"short", sender="rank-3", generation=0)
    with pytest.raises(errors.ConfigError):
        Encoder(job="bad job", key=KEY, sender="rank-3", generation=0)
    with pytest.raises(EncodeError, match="not a ddpbus wire message"):
        rank3().encode(T3, m.EpochPlan(epoch=1, partition_offset=0,  # type: ignore[arg-type]
                                       partition_size=1))
    tiny = Encoder(job=JOB, key=KEY, sender="rank-3", generation=5, max_payload=8)
    with pytest.raises(EncodeError, match="cap"):
        tiny.encode(T3, BATCH)


# ------------------------------------------------------- defects found and fixed


def test_non_ascii_signature_is_bad_signature() -> None:
    good = good_batch()
    with pytest.raises(BadSignature):
        Decoder(job=JOB, key=KEY).decode(T3, edit(good.headers, Ddpbus_Sig="é" * 64),
                                         good.payload)


def test_assembler_refuses_overlap_with_a_hole() -> None:
    first = tensor.decode_frame(frame(shape=[10], total_bytes=10, chunk_count=2,
                                      data=b"A" * 6))
    second = tensor.decode_frame(frame(shape=[10], total_bytes=10, chunk_offset=2,
                                       chunk_index=1, chunk_count=2, data=b"B" * 4))
    assembler = tensor.TensorAssembler(first)
    with pytest.raises(InvalidField):
        assembler.add(second)  # once accepted, leaving b"AABBBB\0\0\0\0"


def test_size_cap_counts_bytes_of_a_memoryview() -> None:
    garbage = memoryview(b"\xff" * (SMALL_CAP * 8)).cast("Q")  # 512 bytes, len() == 64
    headers = edit(good_batch().headers, Ddpbus_Sig=None)
    with pytest.raises(OversizeMessage):
        Decoder(job=JOB, key=KEY, max_payload=SMALL_CAP).decode(T3, headers, garbage)


def test_defect_fixtures_are_otherwise_valid() -> None:
    """The fixtures of the regression tests above are valid on their own, so those tests
    fail on the defects and not on their inputs."""
    assert tensor.decode_frame(frame()).data.tobytes() == b"\x01\x02\x03\x04"
    first = tensor.decode_frame(frame(shape=[10], total_bytes=10, chunk_count=2,
                                      data=b"A" * 6))
    second = tensor.decode_frame(frame(shape=[10], total_bytes=10, chunk_offset=6,
                                       chunk_index=1, chunk_count=2, data=b"B" * 4))
    assembler = tensor.TensorAssembler(first)
    assert assembler.add(second)
    assert bytes(assembler.buffer) == b"AAAAAABBBB"
    good = good_batch()
    dec = Decoder(job=JOB, key=KEY)
    assert dec.decode(T3, good.headers, memoryview(good.payload)).message == BATCH
    with pytest.raises(BadSignature):
        dec.decode(T3, edit(good.headers, Ddpbus_Sig="0" * 64), good.payload)
