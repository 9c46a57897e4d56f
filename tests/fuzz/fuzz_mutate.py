"""Mutators for the fuzz campaign: bytes, headers, subjects, protobuf fields, JSON documents.

A :class:`Mutator` is driven by one seeded :class:`random.Random`, so an example of the
hypothesis tests (which draws the seed) replays exactly. Each mutated message stacks one
to three of:

- payload bytes: bit flips, overwritten, inserted, deleted or duplicated runs, truncation,
  extension, a splice with (or the whole payload of) another family's valid message, a
  payload at the size cap;
- protobuf fields, written on the wire by hand so that values no Python setter accepts get
  through: varints past 64 bits, negative and 2**64-1 counters, unknown enum numbers, NaN
  and infinity bit patterns, invalid UTF-8, wrong-length bytes, huge packed or repeated
  fields, unknown field numbers, wrong wire types, a second oneof member (the payload then
  holds another variant than its header names), a rank that disagrees with the subject;
- JSON documents (for ``application/json`` payloads): any value replaced by an out-of-range
  number, a NaN/Infinity token, a string, null, a container or a deep nest; unknown keys;
- headers: removed, emptied, swapped for another header's value, non-ASCII, a newline,
  other types / schemas / jobs / generations / content types, a damaged signature;
- subjects: another family's subject, other or non-canonical rank tokens, another job,
  missing or extra tokens, wildcards.

`resigned` signs a mutated message again with the job key (over whatever headers it now
has), so that it gets past the HMAC and reaches the payload parser and the field rules.
"""

from __future__ import annotations

import json
import random
import struct
from collections.abc import Sequence
from typing import Any, Final

from fuzz_corpus import JOB, KEY, Inbound
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from ddpbus.codecs import convert, tensor
from ddpbus.codecs import subjects as sj
from ddpbus.codecs._pb import ddpbus_pb2 as pb
from ddpbus.codecs.envelope import DEFAULT_MESSAGE_CAP, Signer
from ddpbus.codecs.errors import BadSignature

FD = FieldDescriptor
_SIGNER: Final = Signer(KEY)

# ----------------------------------------------------------------- wire writing


def varint(n: int) -> bytes:
    """Any integer as a protobuf varint: negative ones as 64-bit two's complement, values
    past 2**64 as the over-long varints a parser must refuse."""
    if n < 0:
        n &= 2**64 - 1
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if not n:
            out.append(low)
            return bytes(out)
        out.append(low | 0x80)


def key(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def delimited(number: int, body: bytes) -> bytes:
    return key(number, 2) + varint(len(body)) + body


def _zigzag(n: int) -> int:
    return (n << 1) ^ (n >> 63) if n < 0 else n << 1


_VARINTS: Final = (0, 1, 2, 3, 4, 5, 7, 99, 127, 128, 255, 2**31 - 1, 2**31, 2**32 - 1,
                   2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1, 2**64, 2**70, -1,
                   -(2**31), -(2**63))
_DOUBLES: Final = (*(struct.pack("<d", v) for v in (
    float("nan"), -float("nan"), float("inf"), -float("inf"), -0.0, 5e-324, 1.7e308,
    -1.0, 1e-300, 2.0**64)), struct.pack("<Q", 0x7FF0_0000_0000_0001), b"\xff" * 8)
_FLOATS32: Final = (*(struct.pack("<f", v) for v in (
    float("nan"), float("inf"), -float("inf"), -0.0, 1e-45)), b"\xff" * 4)
_STRINGS: Final = (b"", b"\xff\xfe", b"\xed\xa0\x80", b"a\nb", b"\x00", "é日本🦀".encode(),
                   b"rank-1.g5.1", b"SHA-256=", b"x" * 5000)
_BYTE_LENGTHS: Final = (0, 1, 31, 32, 33, 127, 128, 129, 4096)
_VARINT_TYPES: Final = frozenset({FD.TYPE_INT32, FD.TYPE_INT64, FD.TYPE_UINT32,
                                  FD.TYPE_UINT64, FD.TYPE_BOOL, FD.TYPE_ENUM})
_WIRE_TYPE: Final = {FD.TYPE_DOUBLE: 1, FD.TYPE_FIXED64: 1, FD.TYPE_SFIXED64: 1,
                     FD.TYPE_FLOAT: 5, FD.TYPE_FIXED32: 5, FD.TYPE_SFIXED32: 5,
                     FD.TYPE_STRING: 2, FD.TYPE_BYTES: 2, FD.TYPE_MESSAGE: 2}


PATCH_BYTES: Final = 2 * DEFAULT_MESSAGE_CAP
"""The most a repeated field may grow to: past the size cap (oversize is a refusal worth
reaching), but repeats of repeats can never multiply into gigabytes."""


def _repeat(unit: bytes, count: int) -> bytes:
    return unit * min(count, PATCH_BYTES // max(1, len(unit)))


class _Fields:
    """Hostile values of protobuf fields, encoded by hand."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def scalar(self, f: FieldDescriptor) -> bytes:
        """The value bytes of one element of ``f`` (no key)."""
        rng = self.rng
        if f.type in _VARINT_TYPES:
            return varint(rng.choice(_VARINTS) if rng.random() < 0.8 else rng.getrandbits(64))
        if f.type in (FD.TYPE_SINT32, FD.TYPE_SINT64):
            return varint(_zigzag(rng.choice((-1, 1, -(2**63), 2**63 - 1, -(2**31), 0))))
        if _WIRE_TYPE.get(f.type) == 1:
            return rng.choice(_DOUBLES) if rng.random() < 0.8 else rng.randbytes(8)
        if _WIRE_TYPE.get(f.type) == 5:
            return rng.choice(_FLOATS32)
        if f.type == FD.TYPE_STRING:
            text = rng.choice(_STRINGS)
            return varint(len(text)) + text
        body = rng.randbytes(rng.choice(_BYTE_LENGTHS))
        return varint(len(body)) + body

    def one(self, f: FieldDescriptor) -> bytes:
        """``f`` set once (or, repeated, many times) to a hostile value, keys included."""
        rng = self.rng
        if rng.random() < 0.08:  # the wrong wire type for this field
            return key(f.number, rng.choice((0, 1, 2, 3, 4, 5, 6, 7))) + rng.randbytes(
                rng.randrange(12))
        if f.type == FD.TYPE_MESSAGE:
            inner = self.message(f.message_type) if rng.random() < 0.85 else rng.randbytes(
                rng.randrange(24))
            count = rng.choice((1, 1, 1, 2, 1000, 20_000)) if f.is_repeated else 1
            return _repeat(delimited(f.number, inner), count)
        if f.is_repeated and rng.random() < 0.6:
            count = rng.choice((0, 1, 3, 1000, 100_000))
            if _WIRE_TYPE.get(f.type, 0) == 2:
                return b"".join(key(f.number, 2) + self.scalar(f) for _ in range(min(count,
                                                                                     2000)))
            return delimited(f.number, _repeat(self.scalar(f), count))  # packed
        return key(f.number, _WIRE_TYPE.get(f.type, 0)) + self.scalar(f)

    def message(self, desc: Descriptor, depth: int = 0) -> bytes:
        """One or two hostile fields of a message of type ``desc``."""
        rng = self.rng
        if rng.random() < 0.05 or not desc.fields:  # a field this schema does not know
            return key(rng.choice((15, 16, 999, 2**29 - 1)), 0) + varint(rng.getrandbits(20))
        out = b""
        for _ in range(rng.choice((1, 1, 2))):
            if len(out) > PATCH_BYTES:
                break
            f = rng.choice(desc.fields)
            if f.type == FD.TYPE_MESSAGE and depth < 4 and rng.random() < 0.7:
                out += _repeat(delimited(f.number, self.message(f.message_type, depth + 1)),
                               rng.choice((1, 1, 3, 500)) if f.is_repeated else 1)
            else:
                out += self.one(f)
        return out


# ---------------------------------------------------------------------- headers

_HEADERS: Final = (sj.H_TYPE, sj.H_SCHEMA, sj.H_JOB, sj.H_RANK, sj.H_GEN, sj.H_MSG_ID,
                   sj.H_CONTENT_TYPE, sj.H_SIG)
_TYPES: Final = (*convert.BY_TYPE, tensor.TYPE_NAME, "TimingMsg", "TimingMsg.Nope",
                 "ControlMsg.", "timingmsg.batch", "")
_VALUES: Final[dict[str, tuple[str, ...]]] = {
    sj.H_SCHEMA: ("2", "0", "1 ", "01", ""),
    sj.H_JOB: ("other-job", JOB.upper(), JOB + " ", ""),
    sj.H_RANK: ("all", "coordinator", "0", "1", "3", "7", "01", "-1", ""),
    sj.H_GEN: ("0", "1", "2", "4", "6", "05", "-1", " 5", "5.0", "1_0", "٣", "9" * 30, ""),
    sj.H_MSG_ID: ("", "rank-1.g5.1", "rank-1.g5.999999", "coordinator.g3.1", "x" * 300),
    sj.H_CONTENT_TYPE: (sj.CONTENT_JSON, sj.CONTENT_PROTOBUF, "text/plain", "",
                        "application/protobuf; charset=x", "APPLICATION/JSON"),
}
_ODD: Final = ("é", "a\nb", "\x00", " ", "x" * 2000)


def _damaged(sig: str, rng: random.Random) -> str:
    if not sig:
        return "0" * 64
    choice = rng.randrange(6)
    if choice == 0:
        at = rng.randrange(len(sig))
        return sig[:at] + ("0" if sig[at] != "0" else "1") + sig[at + 1:]
    return (sig.upper(), sig[:-1], sig + "0", "g" * 64, "é" * 64)[choice - 1]


def _header(x: Inbound, rng: random.Random) -> Inbound:
    headers = dict(x.headers)
    name = rng.choice(_HEADERS)
    roll = rng.random()
    if roll < 0.15:
        headers.pop(name, None)
    elif roll < 0.25:
        headers[name] = rng.choice(_ODD)
    elif roll < 0.32:
        headers[name] = headers.get(rng.choice(_HEADERS), "")
    elif roll < 0.36:
        headers[rng.choice(("X-Junk", "ddpbus-type", "Ddpbus-Sender"))] = "1"
    elif name == sj.H_SIG:
        headers[name] = _damaged(headers.get(name, ""), rng)
    elif name == sj.H_TYPE:
        headers[name] = rng.choice(_TYPES)
    else:
        headers[name] = rng.choice(_VALUES[name])
    return Inbound(x.subject, headers, x.payload)


# --------------------------------------------------------------------- subjects

_KINDS: Final = tuple(s.kind for s in sj.SUBJECTS)
_TOKENS: Final = ("0", "1", "2", "3", "4", "7", "01", "-1", "18446744073709551615",
                  "18446744073709551616", "all", "coordinator", "*", ">", "")


def _subject(x: Inbound, rng: random.Random, resign: bool) -> Inbound:
    tokens = x.subject.split(".")
    roll = rng.random()
    if roll < 0.4:  # another subject template, keeping the rank
        spec = rng.choice(sj.SUBJECTS)
        rank = tokens[-1] if tokens[-1].isdigit() else rng.choice(("0", "1", "3"))
        subject = f"{sj.PREFIX}.{JOB}.{spec.kind}" + (f".{rank}" if spec.per_rank else "")
    elif roll < 0.75:
        subject = ".".join([*tokens[:-1], rng.choice(_TOKENS)])
    else:
        subject = rng.choice((
            x.subject.replace(JOB, "other-job"), x.subject + ".extra",
            ".".join(tokens[:-1]), "", "ddpbus", f"ddpbus..{rng.choice(_KINDS)}",
            x.subject.replace("ddpbus", "DDPBUS"), x.subject.replace(".", ". "),
            f"ddpbus.{JOB}.{rng.choice(_KINDS)}.é"))
    headers = dict(x.headers)
    if resign and rng.random() < 0.7:  # a consistent forger updates the rank header too
        headers[sj.H_RANK] = subject.rsplit(".", 1)[-1]
    return Inbound(subject, headers, x.payload)


# ---------------------------------------------------------------------- payloads


def _flip(data: bytes, rng: random.Random, _d: Sequence[Inbound]) -> bytes:
    buf = bytearray(data or b"\x00")
    for _ in range(rng.choice((1, 1, 2, 8))):
        buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
    return bytes(buf)


def _overwrite(data: bytes, rng: random.Random, _d: Sequence[Inbound]) -> bytes:
    buf = bytearray(data or b"\x00")
    buf[rng.randrange(len(buf))] = rng.choice((0, 0x7F, 0x80, 0xFF, rng.randrange(256)))
    return bytes(buf)


def _cut(data: bytes, rng: random.Random, _d: Sequence[Inbound]) -> bytes:
    at = rng.randrange(len(data) + 1)
    roll = rng.randrange(3)
    if roll == 0:  # truncated
        return data[:at]
    if roll == 1:  # a run deleted
        return data[:at] + data[at + rng.randrange(1, 16):]
    return data[:at] + data[at:at + 24] * rng.choice((2, 3, 50)) + data[at:]  # repeated


def _grow(data: bytes, rng: random.Random, _d: Sequence[Inbound]) -> bytes:
    at = rng.randrange(len(data) + 1)
    roll = rng.randrange(3)
    if roll == 0:  # extended
        return data + rng.randbytes(rng.choice((1, 2, 9, 100)))
    if roll == 1:  # random bytes inserted
        return data[:at] + rng.randbytes(rng.choice((1, 3, 10))) + data[at:]
    return data[:at] + varint(rng.choice(_VARINTS)) + data[at:]  # a varint inserted


def _splice(data: bytes, rng: random.Random, donors: Sequence[Inbound]) -> bytes:
    if not donors:
        return data[::-1]
    other = rng.choice(donors).payload
    if rng.random() < 0.3:
        return other  # another message's payload, whole
    return data[:rng.randrange(len(data) + 1)] + other[rng.randrange(len(other) + 1):]


def _replace(data: bytes, rng: random.Random, _d: Sequence[Inbound]) -> bytes:
    if rng.random() < 0.05:  # at, or one past, the size cap
        size = DEFAULT_MESSAGE_CAP + rng.choice((0, 1))
        unit = data or b"\x00"
        return (unit * (size // len(unit) + 1))[:size]
    return rng.choice((b"", b"\x00", b"{}", b"[]", b"null", rng.randbytes(64)))


_BYTE_MUTATIONS: Final = (_flip, _flip, _overwrite, _cut, _cut, _grow, _grow, _splice,
                          _replace)


def _bytes(data: bytes, rng: random.Random, donors: Sequence[Inbound]) -> bytes:
    return rng.choice(_BYTE_MUTATIONS)(data, rng, donors)


def _patch(x: Inbound, fields: _Fields) -> bytes:
    """A protobuf payload with hostile fields appended (merged into the named variant)."""
    rng = fields.rng
    variant = convert.BY_TYPE.get(x.headers.get(sj.H_TYPE, ""))
    if variant is None:
        return x.payload + fields.message(pb.TimingMsg.DESCRIPTOR)
    family = variant.family.DESCRIPTOR
    if variant.field is None or rng.random() < 0.15:  # the family itself (maybe another
        patch = fields.message(family)                # oneof member: a variant switch)
    else:
        member = family.fields_by_name[variant.field]
        patch = delimited(member.number, fields.message(member.message_type))
    return patch if rng.random() < 0.1 else x.payload + patch


def _frame(data: bytes, fields: _Fields) -> bytes:
    """A tensor frame with a hostile header field or length prefix."""
    rng = fields.rng
    if len(data) < 4:
        return data + varint(7)
    size = int.from_bytes(data[:4], "little")
    header, rest = data[4:4 + size], data[4 + size:]
    if rng.random() < 0.3:
        size = rng.choice((0, 1, size - 1, size + 1, len(data), 2**16, 2**32 - 1))
        return (size % 2**32).to_bytes(4, "little") + header + rest
    header += fields.message(pb.TensorFrameHeader.DESCRIPTOR)
    return len(header).to_bytes(4, "little") + header + rest


_JSON_VALUES: Final[tuple[Any, ...]] = (
    2**64, 2**64 - 1, 2**70, -1, -(2**63) - 1, 1.5, 1e308, "1e400", "NaN", "Infinity",
    "-Infinity", "1", "0x10", "", "é", "\ud800", True, False, None, [], {}, [1] * 1000,
    "A" * 5000, "POLICY_NOPE", "BACKEND_BROKER", 3, "!!!", "AAAA")


def _leaves(doc: Any, out: list[tuple[Any, Any]]) -> None:
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(
        doc, list) else ()
    for k, v in items:
        out.append((doc, k))
        if isinstance(v, dict | list) and len(out) < 400:
            _leaves(v, out)


def _json(data: bytes, rng: random.Random) -> bytes:
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return data + b"}"
    spots: list[tuple[Any, Any]] = []
    _leaves(doc, spots)
    roll = rng.random()
    if roll < 0.1 and isinstance(doc, dict):
        doc[rng.choice(("unknown", "rank", "__proto__", "batch"))] = rng.choice(_JSON_VALUES)
    elif roll < 0.15:
        depth = rng.choice((50, 200, 5000))
        nest = "[" * depth + "]" * depth
        return data.replace(b":", b":" + nest.encode() + b",", 1)
    elif spots:
        parent, k = rng.choice(spots)
        parent[k] = rng.choice(_JSON_VALUES)
    text = json.dumps(doc)
    return text.replace('"1e400"', "1e400").encode()


# ------------------------------------------------------------------------ driver


def resigned(x: Inbound, key_bytes: bytes = KEY) -> Inbound:
    """``x`` with a signature that verifies with ``key_bytes`` over its current fields."""
    h = x.headers
    content = h.get(sj.H_CONTENT_TYPE) or sj.CONTENT_PROTOBUF
    try:
        sig = (_SIGNER if key_bytes == KEY else Signer(key_bytes)).sign(
            x.subject, h.get(sj.H_TYPE, ""), h.get(sj.H_GEN, ""), h.get(sj.H_MSG_ID, ""),
            content, x.payload)
    except BadSignature:  # a field holds a newline: nothing can sign it
        return x
    return Inbound(x.subject, {**h, sj.H_SIG: sig}, x.payload)


class Mutator:
    def __init__(self, rng: random.Random, donors: Sequence[Inbound] = ()) -> None:
        self.rng = rng
        self.donors = donors
        self.fields = _Fields(rng)

    def bytes(self, data: bytes) -> bytes:
        """``data`` with its bytes mutated (any format)."""
        return _bytes(data, self.rng, self.donors)

    def json(self, data: bytes) -> bytes:
        """A JSON document with one value, key or nest changed."""
        return _json(data, self.rng)

    def frame(self, data: bytes) -> bytes:
        """A tensor frame with a hostile header field or length prefix."""
        return _frame(data, self.fields)

    def payload(self, x: Inbound) -> bytes:
        roll = self.rng.random()
        if x.headers.get(sj.H_TYPE) == tensor.TYPE_NAME and roll < 0.5:
            return self.frame(x.payload)
        if x.headers.get(sj.H_CONTENT_TYPE) == sj.CONTENT_JSON:
            if roll < 0.6:
                return self.json(x.payload)
        elif roll < 0.55:
            return _patch(x, self.fields)
        return self.bytes(x.payload)

    def one(self, x: Inbound, *, resign: bool) -> Inbound:
        roll = self.rng.random()
        if roll < 0.6:
            return Inbound(x.subject, x.headers, self.payload(x))
        if roll < 0.85:
            return _header(x, self.rng)
        return _subject(x, self.rng, resign)

    def mutate(self, x: Inbound, *, resign: bool) -> Inbound:
        """One to three stacked mutations of ``x``; with ``resign``, signed again after."""
        for _ in range(self.rng.choice((1, 1, 1, 2, 3))):
            x = self.one(x, resign=resign)
        if resign and self.rng.random() < 0.95:
            x = resigned(x)
        return x

