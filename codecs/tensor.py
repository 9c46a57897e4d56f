"""Tensor frames: dtype + shape + raw little-endian bytes, chunked below ``max_payload``.

A frame payload is ``u32 LE header length ‖ TensorFrameHeader (protobuf) ‖ raw bytes``.
The raw bytes are never parsed or copied by the decoder: :func:`decode_frame` hands back a
``memoryview`` into the received payload, ready for ``torch.frombuffer`` /
``numpy.frombuffer``. Building a frame copies the tensor bytes exactly once (into the
payload that goes on the wire). No pickle anywhere.
"""

from __future__ import annotations

import math
import struct
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Final

from google.protobuf.message import DecodeError as PbDecodeError

from ddpbus.codecs._pb import ddpbus_pb2 as pb
from ddpbus.codecs.errors import EncodeError, InvalidField, MalformedPayload

TYPE_NAME: Final = "TensorFrame"

DTYPE_SIZES: Final[dict[str, int]] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}

_LEN = struct.Struct("<I")
MAX_HEADER_BYTES: Final = 64 * 1024
MAX_DIMS: Final = 64
"""Most dimensions a shape may have (NumPy's limit). It also bounds the byte count a
shape can name, which a refusal prints: 64 u64 dimensions make at most a 1,300-digit
number, well inside Python's 4,300-digit limit on turning an int into text."""


def _require_little_endian() -> None:
    if sys.byteorder != "little":
        raise EncodeError("tensor frames are little-endian; this host is big-endian")


@dataclass(frozen=True, slots=True)
class TensorChunk:
    """One received chunk; ``data`` is a view into the payload (no copy)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    total_bytes: int
    chunk_offset: int
    chunk_index: int
    chunk_count: int
    version: int
    data: memoryview


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    size = DTYPE_SIZES.get(dtype)
    if size is None:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPE_SIZES)}")
    if len(shape) > MAX_DIMS:
        raise ValueError(f"shape has {len(shape)} dimensions, at most {MAX_DIMS} are allowed")
    return size * math.prod(shape)


def encode_frames(
    name: str,
    dtype: str,
    shape: tuple[int, ...],
    data: memoryview | bytes | bytearray,
    *,
    max_payload: int,
    version: int = 0,
) -> Iterator[bytes]:
    """Yield the payloads of one tensor, each at most ``max_payload`` bytes long.

    ``data`` is the tensor's contiguous little-endian storage (e.g.
    ``memoryview(tensor.numpy()).cast("B")``).
    """
    _require_little_endian()
    view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
    try:
        total = _nbytes(dtype, shape)
    except ValueError as exc:
        raise EncodeError(f"tensor {name!r}: {exc}") from None
    if total != view.nbytes:
        raise EncodeError(
            f"tensor {name!r}: {dtype}{list(shape)} needs {total} bytes, buffer has {view.nbytes}"
        )
    probe = pb.TensorFrameHeader(name=name, dtype=dtype, shape=shape, total_bytes=total,
                                 chunk_offset=total, chunk_index=2**32 - 1,
                                 chunk_count=2**32 - 1, version=version)
    overhead = _LEN.size + probe.ByteSize()
    room = max_payload - overhead
    if room <= 0:
        raise EncodeError(f"tensor {name!r}: max_payload={max_payload} leaves no room for data")
    count = max(1, -(-total // room))
    for index in range(count):
        start = index * room
        chunk = view[start : start + room]
        header = pb.TensorFrameHeader(
            name=name, dtype=dtype, shape=shape, total_bytes=total, chunk_offset=start,
            chunk_index=index, chunk_count=count, version=version,
        ).SerializeToString()
        yield b"".join((_LEN.pack(len(header)), header, chunk))


def decode_frame(payload: bytes | memoryview) -> TensorChunk:
    """Parse a frame's header and return a zero-copy view of its data."""
    _require_little_endian()
    view = memoryview(payload)
    if view.nbytes < _LEN.size:
        raise MalformedPayload("tensor frame shorter than its length prefix", msg_type=TYPE_NAME)
    (hlen,) = _LEN.unpack_from(view)
    if hlen > MAX_HEADER_BYTES or _LEN.size + hlen > view.nbytes:
        raise MalformedPayload(f"tensor frame header length {hlen} is out of bounds",
                               msg_type=TYPE_NAME)
    header = pb.TensorFrameHeader()
    try:
        header.ParseFromString(bytes(view[_LEN.size : _LEN.size + hlen]))
    except PbDecodeError as exc:
        raise MalformedPayload(f"tensor frame header: {exc}", msg_type=TYPE_NAME) from None
    data = view[_LEN.size + hlen :]
    shape = tuple(header.shape)
    try:
        total = _nbytes(header.dtype, shape)
    except ValueError as exc:
        raise InvalidField(str(exc), msg_type=TYPE_NAME) from None
    problems = [
        (total != header.total_bytes, f"shape needs {total} bytes, header says "
                                      f"{header.total_bytes}"),
        (header.chunk_index >= header.chunk_count, "chunk_index is not below chunk_count"),
        (header.chunk_offset + data.nbytes > total, "chunk runs past the end of the tensor"),
    ]
    for bad, text in problems:
        if bad:
            raise InvalidField(f"tensor {header.name!r}: {text}", msg_type=TYPE_NAME)
    return TensorChunk(
        name=header.name, dtype=header.dtype, shape=shape, total_bytes=total,
        chunk_offset=header.chunk_offset, chunk_index=header.chunk_index,
        chunk_count=header.chunk_count, version=header.version, data=data,
    )


class TensorAssembler:
    """Collects the chunks of one tensor into one buffer; refuses overlaps and mismatches."""

    def __init__(self, first: TensorChunk) -> None:
        self.name, self.dtype, self.shape = first.name, first.dtype, first.shape
        self.version, self.chunk_count = first.version, first.chunk_count
        self.buffer = bytearray(first.total_bytes)
        self._seen: set[int] = set()
        self._spans: list[tuple[int, int]] = []  # byte ranges written so far
        self._received = 0
        self.add(first)

    def add(self, chunk: TensorChunk) -> bool:
        """Copy ``chunk`` in place; True once every chunk has arrived."""
        same = (chunk.name, chunk.dtype, chunk.shape, chunk.version, chunk.chunk_count) == (
            self.name, self.dtype, self.shape, self.version, self.chunk_count)
        if not same:
            raise InvalidField(f"chunk of {chunk.name!r} v{chunk.version} does not belong to "
                               f"{self.name!r} v{self.version}", msg_type=TYPE_NAME)
        if chunk.chunk_index in self._seen:
            raise InvalidField(f"tensor {self.name!r}: chunk {chunk.chunk_index} arrived twice",
                               msg_type=TYPE_NAME)
        start, end = chunk.chunk_offset, chunk.chunk_offset + chunk.data.nbytes
        if any(start < e and s < end for s, e in self._spans):
            raise InvalidField(f"tensor {self.name!r}: chunk {chunk.chunk_index} overlaps "
                               "bytes already received", msg_type=TYPE_NAME)
        self._spans.append((start, end))
        self.buffer[start:end] = chunk.data
        self._seen.add(chunk.chunk_index)
        self._received += chunk.data.nbytes
        if self.complete and self._received != len(self.buffer):
            raise InvalidField(f"tensor {self.name!r}: chunks carry {self._received} bytes, "
                               f"the tensor has {len(self.buffer)}", msg_type=TYPE_NAME)
        return self.complete

    @property
    def complete(self) -> bool:
        return len(self._seen) == self.chunk_count


# ------------------------------------------------------------------ tensor blobs

ROUND_BUFFERS: Final = "buffers"  # a round blob's packed float buffers (unweighted)


def round_param(group: int) -> str:
    """A round blob's tensor of parameter group ``group`` (premultiplied by the mass)."""
    return f"param.{group}"


_FRAME_LEN = struct.Struct("<Q")
MAX_BLOB_TENSORS: Final = 4096


def pack_tensors(tensors: Sequence[tuple[str, str, tuple[int, ...], memoryview | bytes]], *,
                 version: int = 0) -> bytes:
    """Several tensors in one blob (an Object Store object): ``u64 LE length ‖ frame`` per
    tensor, each a whole single-chunk frame. ``tensors`` holds ``(name, dtype, shape,
    little-endian bytes)``. The bytes are copied once, into the blob."""
    parts: list[bytes] = []
    for name, dtype, shape, data in tensors:
        view = memoryview(data).cast("B")
        (frame,) = encode_frames(name, dtype, shape, view, version=version,
                                 max_payload=view.nbytes + MAX_HEADER_BYTES + _LEN.size)
        parts += (_FRAME_LEN.pack(len(frame)), frame)
    return b"".join(parts)


def unpack_tensors(blob: bytes | bytearray | memoryview) -> dict[str, TensorChunk]:
    """The tensors of a :func:`pack_tensors` blob by name, each a zero-copy view into it.
    Truncated, padded, split or repeated tensors are refused."""
    view = memoryview(blob).cast("B")
    out: dict[str, TensorChunk] = {}
    at = 0
    while at < view.nbytes:
        if at + _FRAME_LEN.size > view.nbytes or len(out) >= MAX_BLOB_TENSORS:
            raise MalformedPayload(f"tensor blob: trailing {view.nbytes - at} bytes or more "
                                   f"than {MAX_BLOB_TENSORS} tensors", msg_type=TYPE_NAME)
        (size,) = _FRAME_LEN.unpack_from(view, at)
        at += _FRAME_LEN.size
        if size > view.nbytes - at:
            raise MalformedPayload(f"tensor blob: a frame of {size} bytes runs past the end",
                                   msg_type=TYPE_NAME)
        chunk = decode_frame(view[at:at + size])
        at += size
        if chunk.chunk_count != 1 or chunk.data.nbytes != chunk.total_bytes:
            raise InvalidField(f"tensor blob: {chunk.name!r} is not one whole frame",
                               msg_type=TYPE_NAME)
        if chunk.name in out:
            raise InvalidField(f"tensor blob: {chunk.name!r} appears twice", msg_type=TYPE_NAME)
        out[chunk.name] = chunk
    return out
