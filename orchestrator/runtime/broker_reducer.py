"""The broker backend's reducer: sums the accepted snapshots and stores the consensus.

It runs in the coordinator process, off the decision loop: the core decides *which*
contributions a round accepts (:class:`~ddpbus.orchestrator.core.state.Reduce`), this module
does the tensor work and answers :class:`~ddpbus.orchestrator.core.state.Reduced`. numpy only:
the coordinator never imports torch.

Storage: one Object Store bucket per job (``ddpbus_<job>_rounds``, memory-backed: round
data is transient and a broker restart only costs the round in flight, which the core
retries). Objects:

- ``v<V>.rank<N>``: rank N's contribution to round V, a tensor blob
  (:func:`~ddpbus.codecs.tensor.pack_tensors`) of ``param.<i>`` (each parameter group's
  flat tensor times the rank's mass ``n^gamma``) and, when the model has float buffers,
  ``buffers`` (packed, unweighted: only movers contribute);
- ``v<V>.consensus``: the same names, divided once: parameters by the summed mass of the
  accepted contributions, buffers by their count.

The Object Store was chosen over raw frames on data subjects (measured by
``bench/averaging.py``, docs/performance.md): chunks are acknowledged and digest-checked,
so a contribution is either whole or refused, a slow consumer can never drop part of one,
and a reducer that
restarts (coordinator fail-over) reads the same contributions again. Each contribution's
SHA-256 digest also travels in its signed SnapshotReady and is compared here, so an
object replaced on the broker is refused.

Accumulators are float32 (float64 for float64 parameters) whatever the wire dtype; with
``bf16`` the float32 parameters travel as bfloat16 both ways (half the bytes per hop);
buffers (running statistics, small) stay float32.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Final

import numpy as np
from nats.errors import Error as NatsError
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError
from nats.js.object_store import ObjectStore

from ddpbus.codecs import subjects as sj
from ddpbus.codecs.errors import DdpbusError, DecodeError
from ddpbus.codecs.tensor import (
    ROUND_BUFFERS,
    TensorChunk,
    pack_tensors,
    round_param,
    unpack_tensors,
)
from ddpbus.orchestrator.core.state import Contribution, Reduce, Reduced
from ddpbus.orchestrator.transport import bus

log = logging.getLogger(__name__)

PARALLEL_READS: Final = 4  # contributions downloaded at once by the reducer
KEEP_CONSENSUS: Final = 2  # consensus versions kept (a rank may still be reading the last)
class ReduceError(DdpbusError):
    """A round's contributions cannot be reduced (missing, altered or mismatched)."""


# ----------------------------------------------------------------------- math


def bf16_to_f32(raw: memoryview | bytes) -> np.ndarray:
    """bfloat16 bits (little-endian) to float32: the upper half of each float32."""
    bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
    return bits.view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 to bfloat16 bits, rounding to nearest even (NaN stays NaN)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))
    out = (rounded >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = np.uint16(0x7FC0)
    return out


def _values(chunk: TensorChunk) -> np.ndarray:
    if chunk.dtype == "bfloat16":
        return bf16_to_f32(chunk.data)
    if chunk.dtype not in ("float32", "float64", "float16"):
        raise ReduceError(f"tensor {chunk.name!r} has dtype {chunk.dtype}; only floating "
                          "point tensors are averaged")
    return np.frombuffer(chunk.data, dtype=np.dtype(chunk.dtype).newbyteorder("<"))


@dataclass
class Accumulator:
    """Sums contributions in f32/f64; divides once, by exactly what was summed."""

    layout: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    sums: dict[str, np.ndarray] = field(default_factory=dict)
    mass: float = 0.0
    movers: int = 0

    def add(self, c: Contribution, blob: bytes | memoryview) -> None:
        try:
            tensors = unpack_tensors(blob)
        except DecodeError as exc:  # stored as announced (the digest), but not a blob
            raise ReduceError(f"rank {c.rank}'s contribution does not unpack: {exc}") from None
        layout = {n: (t.dtype, t.shape) for n, t in tensors.items()}
        if self.layout and layout != self.layout:
            raise ReduceError(f"rank {c.rank}'s contribution has another layout than the "
                              f"round's first: {sorted(layout)} vs {sorted(self.layout)}")
        if round_param(0) not in layout:
            raise ReduceError(f"rank {c.rank}'s contribution has no parameters")
        self.layout = layout
        for name, chunk in tensors.items():
            values = _values(chunk)
            acc = self.sums.get(name)
            if acc is None:
                wide = np.float64 if values.dtype == np.float64 else np.float32
                self.sums[name] = values.astype(wide, copy=True)
            else:
                np.add(acc, values, out=acc)
        self.mass += c.mass
        self.movers += 1

    def consensus(self, *, version: int, bf16: bool) -> bytes:
        if self.mass <= 0 or not self.movers:
            raise ReduceError("no mass to divide by")
        out: list[tuple[str, str, tuple[int, ...], memoryview]] = []
        for name, acc in self.sums.items():
            np.divide(acc, self.movers if name == ROUND_BUFFERS else self.mass, out=acc)
            wire_dtype, shape = self.layout[name]
            narrow = bf16 and acc.dtype == np.float32 and name != ROUND_BUFFERS
            if wire_dtype == "bfloat16" or narrow:
                out.append((name, "bfloat16", shape, f32_to_bf16(acc).data))
            elif wire_dtype == "float16":
                out.append((name, "float16", shape, acc.astype("<f2").data))
            else:
                out.append((name, str(acc.dtype), shape, acc.data))
        return pack_tensors(out, version=version)


# --------------------------------------------------------------------- runner


class Reducer:
    """Runs :class:`Reduce` commands against the job's round bucket."""

    def __init__(self, js: JetStreamContext, job: str, max_payload: int) -> None:
        self.js, self.job = js, job
        self.chunk = bus.object_chunk(max_payload)
        self._store: ObjectStore | None = None

    async def run(self, cmd: Reduce) -> Reduced:
        started = time.monotonic()
        try:
            nbytes, digest = await self._reduce(cmd)
        except (ReduceError, *_TRANSPORT_ERRORS) as exc:
            log.warning("round %d: reduce failed: %s", cmd.version, exc)
            return Reduced(version=cmd.version, ok=False, detail=f"{type(exc).__name__}: {exc}")
        log.info("round %d: reduced %d contributions (%.1f MiB) in %.3f s", cmd.version,
                 len(cmd.contributions), nbytes / 2**20, time.monotonic() - started)
        return Reduced(version=cmd.version, ok=True, digest=digest)

    async def _reduce(self, cmd: Reduce) -> tuple[int, str]:
        """The bytes read and written, and the stored consensus object's digest."""
        if self._store is None:
            self._store = await bus.rounds_store(self.js, self.job)
        store = self._store
        acc = Accumulator()
        gate = asyncio.Semaphore(PARALLEL_READS)

        async def fetch(c: Contribution) -> bytes:
            await gate.acquire()  # released once this blob is summed: a few blobs in memory
            try:
                blob, digest = await _read_announced(store, cmd.version, c)
            except BaseException:
                gate.release()
                raise
            if digest != c.digest or len(blob) != c.nbytes:
                gate.release()
                raise ReduceError(f"rank {c.rank}'s stored contribution ({len(blob)} bytes, "
                                  f"{digest}) is not the one it announced ({c.nbytes} bytes, "
                                  f"{c.digest})")
            return blob

        fetches = [asyncio.ensure_future(fetch(c)) for c in cmd.contributions]
        nbytes = 0
        try:
            for c, pending in zip(cmd.contributions, fetches, strict=True):
                blob = await pending  # summed in rank order: the same consensus every time
                try:
                    await asyncio.to_thread(acc.add, c, blob)
                finally:
                    gate.release()
                nbytes += len(blob)
        finally:
            for f in fetches:
                f.cancel()
        blob = await asyncio.to_thread(acc.consensus, version=cmd.version, bf16=cmd.bf16)
        digest = await bus.put_object(store, sj.round_consensus(cmd.version), blob, self.chunk)
        if not digest:
            raise ReduceError(f"round {cmd.version}: the store returned no digest for the "
                              "consensus")
        await self._prune(store, cmd.version)
        return nbytes + len(blob), digest

    async def _prune(self, store: ObjectStore, version: int) -> None:
        """Drop this round's contributions, late ones of earlier rounds and old consensus."""
        with contextlib.suppress(NotFoundError):
            for info in await store.list(ignore_deletes=True):
                parsed = sj.round_version(info.name)
                if parsed is None:
                    continue
                v, kind = parsed
                old = v <= version - KEEP_CONSENSUS if kind == "consensus" else v <= version
                if old:
                    with contextlib.suppress(NotFoundError):
                        await store.delete(info.name)


async def _read_announced(store: ObjectStore, version: int, c: Contribution
                          ) -> tuple[bytes, str]:
    """Rank ``c.rank``'s stored contribution, read only if its size is the announced one
    (a rank cannot make the coordinator read more than it said)."""
    name = sj.round_contribution(version, c.rank)
    try:
        info = await store.get_info(name)
        if info.size != c.nbytes:
            raise ReduceError(f"rank {c.rank}'s stored contribution to round {version} is "
                              f"{info.size} bytes, not the {c.nbytes} it announced")
        return await bus.read_object(store, name)
    except NotFoundError:
        raise ReduceError(f"rank {c.rank}'s contribution to round {version} is not in the "
                          "store (lost with a broker restart?)") from None


_TRANSPORT_ERRORS: Final = (NatsError, OSError, TimeoutError)
