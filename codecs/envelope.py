"""The envelope: NATS headers, signing, fencing, size caps, protobuf or JSON payloads.

:class:`Encoder` turns a domain message into ``(subject, headers, payload)``;
:class:`Decoder` turns those three back into an :class:`Envelope` or raises one
:class:`~ddpbus.codecs.errors.DecodeError` with a precise reason. Neither touches the
network: the bus layer hands in the subject, the header mapping and the payload bytes
(NATS message parsing stays apart from payload decoding).

Signature: ``Ddpbus-Sig`` is the hex HMAC-SHA256, keyed by the job key, over
``subject \n type \n generation \n Nats-Msg-Id \n Content-Type \n len(payload) \n payload``
(none of those fields can hold a newline, so the framing is unambiguous; the id and content
type are covered too, so neither can be swapped on a captured message).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Final

from google.protobuf import json_format
from google.protobuf.message import DecodeError as PbDecodeError
from google.protobuf.message import Message as PbMessage

from ddpbus.codecs import convert, tensor
from ddpbus.codecs import subjects as sj
from ddpbus.codecs.errors import (
    BadSignature,
    BadSubject,
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
from ddpbus.codecs.messages import Message, Rejoin

DEFAULT_MESSAGE_CAP: Final = 1024 * 1024 - 8 * 1024
"""Largest control/timing/metrics payload: below nats-server's default 1 MiB max_payload,
leaving room for the headers."""

DEFAULT_FRAME_CAP: Final = 8 * 1024 * 1024 - 8 * 1024
"""Largest tensor-frame payload; the bus lowers it to the server's announced max_payload."""

MIN_KEY_BYTES: Final = 16
_HEAD_LINES: Final = 6

#: The message families whose ``rank`` field must equal the subject's rank token.
_RANKED_FAMILIES: Final = frozenset({"TimingMsg", "MetricsMsg", "JoinMsg", "AdmitMsg"})


def _nbytes(payload: bytes | memoryview) -> int:
    return payload.nbytes if isinstance(payload, memoryview) else len(payload)


class Signer:
    """HMAC-SHA256 with the job key over the envelope fields (see module doc).

    RFC 2104 HMAC computed from pre-keyed inner and outer SHA-256 states that are copied
    per message: the same digest as ``hmac.new(key, data, "sha256")`` at a third of the
    cost for small messages (tests/unit check the equality).
    """

    __slots__ = ("_inner", "_outer")

    def __init__(self, key: bytes) -> None:
        if len(key) < MIN_KEY_BYTES:
            raise EncodeError(f"the job key must be at least {MIN_KEY_BYTES} bytes")
        block = hashlib.sha256().block_size
        padded = (hashlib.sha256(key).digest() if len(key) > block else key).ljust(block, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in padded))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in padded))

    def sign(self, subject: str, msg_type: str, generation: str, msg_id: str,
             content_type: str, payload: bytes | memoryview) -> str:
        head = (f"{subject}\n{msg_type}\n{generation}\n{msg_id}\n{content_type}\n"
                f"{_nbytes(payload)}\n")
        if head.count("\n") != _HEAD_LINES:
            # NATS subjects and header values never hold a newline; refuse to sign one
            raise BadSignature("an envelope field contains a newline", subject=subject)
        inner = self._inner.copy()
        inner.update(head.encode())
        inner.update(payload)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.hexdigest()


@dataclass(frozen=True, slots=True)
class Outbound:
    """A message ready to publish: hand these three to the NATS client as they are."""

    subject: str
    headers: dict[str, str]
    payload: bytes


@dataclass(frozen=True, slots=True)
class Envelope:
    """A verified inbound message."""

    subject: str
    job: str
    kind: str  # "timing.rank", "control.all", ...
    rank: int | None  # the subject's rank, None for control.all / live.coordinator / ...
    sender: str  # "coordinator", "reducer" or "rank-N"
    msg_type: str
    generation: int
    msg_id: str
    content_type: str
    message: Message | tensor.TensorChunk


class Encoder:
    """Builds signed envelopes for one sender incarnation (``sender`` at ``generation``).

    ``Nats-Msg-Id`` is ``<sender>.g<generation>.<seq>`` with ``seq`` counting up from
    ``first_seq`` over the messages for the job's stream only; pass ``seq=`` to re-create a
    message deterministically (a retried or replayed publish then carries the same id and
    JetStream drops the duplicate). Messages on core subjects (never stored: the live
    beacons, tensor frames) count apart, as ``<sender>.g<generation>.c<n>``: the stream's
    ids stay dense, so a gap in them means a stream message not stored (yet), which is what
    the coordinator's deduplication remembers (a beacon a second would otherwise leave one
    such gap per rank per second, and fill its 256-id memory within minutes).
    """

    def __init__(self, *, job: str, key: bytes, sender: str, generation: int,
                 wire_json: bool = False, max_payload: int = DEFAULT_MESSAGE_CAP,
                 max_frame_payload: int = DEFAULT_FRAME_CAP, first_seq: int = 1) -> None:
        self.job = sj.check_job(job)
        if generation < 0:
            raise EncodeError(f"generation must be >= 0, got {generation}")
        self.sender = sender
        self.generation = generation
        self.wire_json = wire_json
        self.max_payload = max_payload
        self.max_frame_payload = max_frame_payload
        self._signer = Signer(key)
        self._gen = str(generation)
        self._next_seq = first_seq  # stream subjects
        self._next_core = 1  # core subjects

    def _msg_id(self, stored: bool, seq: int | None) -> str:
        if stored:
            if seq is None:
                seq, self._next_seq = self._next_seq, self._next_seq + 1
            return f"{self.sender}.g{self._gen}.{seq}"
        if seq is None:
            seq, self._next_core = self._next_core, self._next_core + 1
        return f"{self.sender}.g{self._gen}.c{seq}"

    def _check_subject(self, subject: str, msg_type: str) -> sj.ParsedSubject:
        try:
            parsed = sj.parse_subject(subject, self.job)
        except (BadSubject, ForeignJob) as exc:
            raise EncodeError(str(exc)) from None
        if not parsed.spec.allows(msg_type):
            raise EncodeError(f"{msg_type} does not belong on {subject} "
                              f"(subjects.md: {parsed.spec.message})")
        if parsed.sender != self.sender:
            raise EncodeError(f"{self.sender} may not publish on {subject} "
                              f"(sent by {parsed.sender})")
        return parsed

    def _envelope(self, parsed: sj.ParsedSubject, subject: str, msg_type: str,
                  content_type: str, payload: bytes, seq: int | None) -> Outbound:
        msg_id = self._msg_id(parsed.spec.storage == "stream", seq)
        sig = self._signer.sign(subject, msg_type, self._gen, msg_id, content_type, payload)
        headers = {
            sj.H_TYPE: msg_type,
            sj.H_SCHEMA: sj.SCHEMA_VERSION,
            sj.H_JOB: self.job,
            sj.H_RANK: parsed.token,
            sj.H_GEN: self._gen,
            sj.H_MSG_ID: msg_id,
            sj.H_CONTENT_TYPE: content_type,
            sj.H_SIG: sig,
        }
        return Outbound(subject, headers, payload)

    def encode(self, subject: str, msg: Message, *, seq: int | None = None) -> Outbound:
        variant, wire = convert.to_wire(msg)
        parsed = self._check_subject(subject, variant.type_name)
        if variant.family.DESCRIPTOR.name in _RANKED_FAMILIES:
            _check_rank(parsed, msg, variant.type_name, EncodeError)
        if self.wire_json:
            payload = to_json(wire).encode()
            content_type = sj.CONTENT_JSON
        else:
            payload = wire.SerializeToString()
            content_type = sj.CONTENT_PROTOBUF
        if len(payload) > self.max_payload:
            raise EncodeError(f"{variant.type_name} payload is {len(payload)} bytes, above the "
                              f"{self.max_payload}-byte cap")
        return self._envelope(parsed, subject, variant.type_name, content_type, payload, seq)

    def encode_tensor(self, subject: str, name: str, dtype: str, shape: tuple[int, ...],
                      data: memoryview | bytes | bytearray, *, version: int = 0
                      ) -> Iterator[Outbound]:
        """One signed envelope per chunk of the tensor (always binary, never JSON)."""
        parsed = self._check_subject(subject, tensor.TYPE_NAME)
        for payload in tensor.encode_frames(name, dtype, shape, data,
                                            max_payload=self.max_frame_payload,
                                            version=version):
            yield self._envelope(parsed, subject, tensor.TYPE_NAME, sj.CONTENT_PROTOBUF,
                                 payload, None)


def to_json(wire: PbMessage) -> str:
    """The proto3 JSON mapping, with the schema's field names, compact."""
    return json_format.MessageToJson(
        wire, preserving_proto_field_name=True, indent=None,
        always_print_fields_with_no_presence=True,
    )


def _check_rank(parsed: sj.ParsedSubject, msg: Message | tensor.TensorChunk, msg_type: str,
                error: type[EncodeError] | type[InvalidField]) -> None:
    inner = msg.hello if isinstance(msg, Rejoin) else msg
    rank = getattr(inner, "rank", None)
    if rank != parsed.rank:
        text = f"{msg_type}.rank={rank} but the subject is rank {parsed.rank}"
        if error is EncodeError:
            raise EncodeError(text)
        raise InvalidField(text, subject=parsed.spec.template, msg_type=msg_type)


def _header(headers: Mapping[str, str], name: str, subject: str) -> str:
    value = headers.get(name)
    if not value:
        raise MissingHeader(f"{name} is missing", subject=subject)
    return value


class Decoder:
    """Verifies and decodes inbound messages of one job.

    ``generation_floor(sender)`` returns the lowest generation accepted from ``sender``
    (``coordinator``, ``reducer`` or ``rank-N``); the decoder only reads it, the membership
    logic that owns the fence raises it.
    """

    def __init__(self, *, job: str, key: bytes, max_payload: int = DEFAULT_MESSAGE_CAP,
                 max_frame_payload: int = DEFAULT_FRAME_CAP,
                 generation_floor: Callable[[str], int] | None = None) -> None:
        self.job = sj.check_job(job)
        self.max_payload = max_payload
        self.max_frame_payload = max_frame_payload
        self._signer = Signer(key)
        self._floor = generation_floor or (lambda _sender: 0)

    def decode(self, subject: str, headers: Mapping[str, str] | None,
               payload: bytes | memoryview) -> Envelope:
        headers = headers or {}
        parsed = sj.parse_subject(subject, self.job)
        frames = parsed.spec.message == tensor.TYPE_NAME
        cap = self.max_frame_payload if frames else self.max_payload
        size = _nbytes(payload)
        if size > cap:
            raise OversizeMessage(f"{size} bytes, cap {cap}", subject=subject)
        msg_type = _header(headers, sj.H_TYPE, subject)
        self._check_headers(parsed, headers, subject, msg_type)
        gen_text = _header(headers, sj.H_GEN, subject)
        if not gen_text.isdigit() or not gen_text.isascii():
            raise MissingHeader(f"{sj.H_GEN}={gen_text!r} is not a decimal generation",
                                subject=subject)
        msg_id = headers.get(sj.H_MSG_ID, "")
        content_type = headers.get(sj.H_CONTENT_TYPE) or sj.CONTENT_PROTOBUF
        sig = headers.get(sj.H_SIG, "")
        expected = self._signer.sign(subject, msg_type, gen_text, msg_id, content_type, payload)
        if not sig or not sig.isascii() or not hmac.compare_digest(sig, expected):
            raise BadSignature("missing" if not sig else "does not verify with the job key",
                               subject=subject, msg_type=msg_type)
        generation = int(gen_text)
        floor = self._floor(parsed.sender)
        if generation < floor:
            raise StaleGeneration(f"{parsed.sender} generation {generation} < fence {floor}",
                                  subject=subject, msg_type=msg_type)
        message = self._payload(parsed, msg_type, content_type, payload, subject)
        return Envelope(subject, parsed.job, parsed.spec.kind, parsed.rank, parsed.sender,
                        msg_type, generation, msg_id, content_type, message)

    def _check_headers(self, parsed: sj.ParsedSubject, headers: Mapping[str, str],
                       subject: str, msg_type: str) -> None:
        schema = _header(headers, sj.H_SCHEMA, subject)
        if schema != sj.SCHEMA_VERSION:
            raise SchemaMismatch(f"schema {schema!r}, this build speaks {sj.SCHEMA_VERSION!r}",
                                 subject=subject, msg_type=msg_type)
        job = _header(headers, sj.H_JOB, subject)
        if job != self.job:
            raise ForeignJob(f"header job {job!r}, expected {self.job!r}", subject=subject)
        rank = _header(headers, sj.H_RANK, subject)
        if rank != parsed.token:
            raise BadSubject(f"{sj.H_RANK}={rank!r} disagrees with the subject", subject=subject)
        if msg_type != tensor.TYPE_NAME and msg_type not in convert.BY_TYPE:
            raise UnknownType(f"no message {msg_type!r} in schema {sj.SCHEMA_VERSION}",
                              subject=subject)
        if not parsed.spec.allows(msg_type):
            raise WrongType(f"{msg_type} does not belong on this subject "
                            f"({parsed.spec.message})", subject=subject, msg_type=msg_type)

    def _payload(self, parsed: sj.ParsedSubject, msg_type: str, content_type: str,
                 payload: bytes | memoryview, subject: str) -> Message | tensor.TensorChunk:
        if msg_type == tensor.TYPE_NAME:
            if content_type != sj.CONTENT_PROTOBUF:
                raise UnsupportedContentType("tensor frames are binary only", subject=subject)
            return tensor.decode_frame(payload)
        variant = convert.BY_TYPE[msg_type]
        wire = variant.family()
        try:
            if content_type == sj.CONTENT_PROTOBUF:
                wire.ParseFromString(payload if isinstance(payload, bytes) else bytes(payload))
            elif content_type == sj.CONTENT_JSON:
                json_format.Parse(bytes(payload), wire, ignore_unknown_fields=True)
            else:
                raise UnsupportedContentType(f"{content_type!r}", subject=subject,
                                             msg_type=msg_type)
        except (PbDecodeError, json_format.ParseError, UnicodeDecodeError, ValueError) as exc:
            if isinstance(exc, UnsupportedContentType):
                raise
            raise MalformedPayload(str(exc) or type(exc).__name__, subject=subject,
                                   msg_type=msg_type) from None
        message = convert.from_wire(variant, wire)
        if variant.family.DESCRIPTOR.name in _RANKED_FAMILIES:
            _check_rank(parsed, message, msg_type, InvalidField)
        return message
