"""Work-weighted parameter averaging with torch.distributed.

On SyncNow every rank contributes, in ONE all-reduce-sum per parameter dtype group:

    [ n^gamma * params | mover * float buffers | n^gamma | mover ]

(``n`` = optimizer steps since the last average, ``mover = 1`` if ``n > 0``; an idle rank has
mass 0 for any gamma). Then ``params = sum / sum(n^gamma)`` and
``buffers = sum / sum(mover)``: the sum and its divisor come from exactly the same
contributions, and the division happens once. When the summed mass is 0 the round is not
realised and nothing changes (the live parameters were never touched: contributions are
built in a separate, persistent buffer). Integer buffers are left alone.

Why one collective instead of the reference's count all-reduce followed by the parameter
and buffer all-reduces: the reference's 1-3 collectives per round are a known desync hazard
(every rank must take the same branch), and on a small model the round trip of each
collective dominates; fused, every rank always runs the same single collective per group.

Parameters live in one flat buffer per dtype and device (each ``Parameter.data`` is a view
into it). The divergence ``|pre - post| / |post|`` and both norms go back in SyncAck.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ddpbus.codecs.tensor import ROUND_BUFFERS, pack_tensors, round_param, unpack_tensors

log = logging.getLogger(__name__)



@dataclass(frozen=True, slots=True)
class AverageResult:
    realized: bool  # False: the whole cohort was idle, nothing changed
    divergence: float
    pre_norm: float | None
    post_norm: float | None
    movers: int
    # milliseconds from entering the collective to holding its result on the host (on
    # CUDA the read of the total mass waits for the kernel): the collective alone
    collective_ms: float = 0.0


class FlatModel:
    """A model whose parameters are views into flat buffers, grouped by (device, dtype)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.params = [p for p in model.parameters()]
        if not self.params:
            raise ValueError("the model has no parameters to average")
        self.flats: list[torch.Tensor] = []
        self._slots: list[list[tuple[torch.nn.Parameter, int, int]]] = []
        self._flatten()
        self._warned = False

    def _flatten(self) -> None:
        groups: dict[tuple[torch.device, torch.dtype], list[torch.nn.Parameter]] = {}
        for p in self.params:
            groups.setdefault((p.device, p.dtype), []).append(p)
        self.flats, self._slots = [], []
        for (device, dtype), params in groups.items():
            flat = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=device)
            slots, offset = [], 0
            with torch.no_grad():
                for p in params:
                    n = p.numel()
                    flat[offset:offset + n].copy_(p.detach().reshape(-1))
                    p.data = flat[offset:offset + n].view_as(p)
                    slots.append((p, offset, n))
                    offset += n
            self.flats.append(flat)
            self._slots.append(slots)

    def ensure_flat(self) -> None:
        """Re-flatten if user code replaced a parameter's storage (logged once)."""
        for flat, slots in zip(self.flats, self._slots, strict=True):
            base = flat.data_ptr()
            size = flat.element_size()
            for p, offset, _ in slots:
                if p.data_ptr() != base + offset * size:
                    if not self._warned:
                        log.warning("a parameter's storage was replaced; re-flattening")
                        self._warned = True
                    self._flatten()
                    return

    def buffers(self) -> list[torch.Tensor]:
        return [b for b in self.model.buffers() if b.is_floating_point()]

    def numel(self) -> int:
        return sum(f.numel() for f in self.flats)


def _mass(steps: int, gamma: float) -> float:
    return float(steps) ** gamma if steps > 0 else 0.0  # idle: 0 for any gamma


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t))


def _wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulate in float32 at least (float64 parameters stay float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class _Wire:
    """Persistent all-reduce buffers, one per parameter group (allocated once)."""

    def __init__(self, flat: FlatModel, buffer_numel: int) -> None:
        self.buffers: list[torch.Tensor] = []
        for i, f in enumerate(flat.flats):
            extra = buffer_numel + 2 if i == 0 else 0
            self.buffers.append(torch.empty(f.numel() + extra, dtype=_wire_dtype(f.dtype),
                                            device=f.device))
        self.buffer_numel = buffer_numel


def wire_numel(flat: FlatModel) -> int:
    """The elements an average all-reduces for ``flat`` (every group's wire buffer: the
    parameters, the floating-point buffers and the mass and mover count)."""
    flat.ensure_flat()
    return sum(b.numel() for b in _wire(flat, flat.buffers()).buffers)


def _wire(flat: FlatModel, buffers: list[torch.Tensor]) -> _Wire:
    numel = sum(b.numel() for b in buffers)
    wire: _Wire | None = getattr(flat, "_wire", None)
    if wire is None or wire.buffer_numel != numel or len(wire.buffers) != len(flat.flats):
        wire = _Wire(flat, numel)
        flat._wire = wire  # type: ignore[attr-defined]
    return wire


class CollectiveReleased(RuntimeError):
    """A collective's wait was ended from outside (a peer was declared dead): its result is
    abandoned, the parameters are untouched."""


def _all_reduce(buffers: list[torch.Tensor], group: dist.ProcessGroup | None,
                wake: threading.Event | None) -> None:
    """Sum ``buffers`` across the group. With ``wake``, the collectives run asynchronously
    and the wait ends when they complete (their future's callback sets it) or when another
    thread sets it first: then :class:`CollectiveReleased`, the buffers left to the
    collective still in flight (it fails or times out on its own)."""
    if wake is None:
        for w in buffers:
            dist.all_reduce(w, group=group)
        return
    works = [w for w in (dist.all_reduce(b, group=group, async_op=True) for b in buffers)
             if w is not None]  # (None only for a rank outside the group)
    every = torch.futures.collect_all([w.get_future() for w in works])
    every.add_done_callback(lambda _: wake.set())
    wake.wait()
    if not every.done():
        raise CollectiveReleased("released: a peer of this collective was declared dead")
    for w in works:
        w.wait()  # the collective's own error, if it failed


def abandon_buffers(flat: FlatModel) -> None:
    """A released collective may still write into this model's wire buffers: the next
    average gets new ones."""
    if getattr(flat, "_wire", None) is not None:
        flat._wire = None  # type: ignore[attr-defined]


def average(flat: FlatModel, steps: int, *, gamma: float, measure: bool,
            device: torch.device, group: dist.ProcessGroup | None = None,
            wake: threading.Event | None = None) -> AverageResult:
    """One averaging round; every rank of ``group`` must call it for the same SyncNow.
    ``wake``: set by another thread, it ends the wait for the collectives at once
    (:class:`CollectiveReleased`; see :func:`_all_reduce`)."""
    del device  # the wire buffers live where the parameters live
    flat.ensure_flat()
    mass = _mass(steps, gamma)
    mover = 1.0 if steps > 0 else 0.0
    buffers = flat.buffers()
    wire = _wire(flat, buffers)
    with torch.no_grad():
        for f, w in zip(flat.flats, wire.buffers, strict=True):
            torch.mul(f, mass, out=w[:f.numel()])
        head = wire.buffers[0]
        n0 = flat.flats[0].numel()
        if buffers:
            packed = head[n0:n0 + wire.buffer_numel]
            torch.cat([b.reshape(-1).to(head.dtype) for b in buffers], out=packed)
            packed.mul_(mover)
        head[-2], head[-1] = mass, mover
        began = time.perf_counter()
        _all_reduce(wire.buffers, group, wake)
        total_mass, movers = float(head[-2]), float(head[-1])
        collective_ms = (time.perf_counter() - began) * 1000.0
        if total_mass <= 0.0:
            return AverageResult(realized=False, divergence=0.0, pre_norm=None,
                                 post_norm=None, movers=0, collective_ms=collective_ms)
        pre_sq = post_sq = diff_sq = 0.0
        for f, w in zip(flat.flats, wire.buffers, strict=True):
            post = w[:f.numel()].div_(total_mass)
            if measure:
                pre_sq += _norm(f) ** 2
                post_sq += _norm(post) ** 2
                diff_sq += _norm(f.sub_(post)) ** 2
            f.copy_(post)
        if buffers and movers > 0:
            offset = n0
            for b in buffers:
                n = b.numel()
                b.copy_(head[offset:offset + n].div_(movers).view_as(b))
                offset += n
    if not measure:
        return AverageResult(realized=True, divergence=0.0, pre_norm=None, post_norm=None,
                             movers=round(movers), collective_ms=collective_ms)
    post_norm = math.sqrt(post_sq)
    return AverageResult(realized=True,
                         divergence=math.sqrt(diff_sq) / post_norm if post_norm > 1e-10 else 0.0,
                         pre_norm=math.sqrt(pre_sq), post_norm=post_norm, movers=round(movers),
                         collective_ms=collective_ms)


def broadcast_from_root(flat: FlatModel, group: dist.ProcessGroup | None = None) -> None:
    """Everyone starts from rank 0's parameters and floating-point buffers."""
    flat.ensure_flat()
    with torch.no_grad():
        for f in flat.flats:
            dist.broadcast(f, src=0, group=group)
        for b in flat.buffers():
            dist.broadcast(b, src=0, group=group)


# ------------------------------------------------------------ the broker backend
#
# Reference C.3, CPU path: on RequestParams a rank snapshots its parameters, ships them
# premultiplied by its mass ``n^gamma`` (float buffers unweighted: only movers ship), and
# trains on; the reducer sums exactly the accepted contributions and divides once; on
# Update the rank moves by ``alpha * (consensus - snapshot)``: alpha 1 lands on the
# consensus plus the steps it trained while the round was in flight (none under sync),
# alpha < 1 is the EASGD blend. Tensor names are shared with
# ddpbus.orchestrator.runtime.broker_reducer.

@dataclass(slots=True)
class Snapshot:
    """A rank's parameters at RequestParams{version} (kept until the Update)."""

    version: int
    steps: int  # optimizer steps in this contribution (mass n^gamma)
    mass: float
    step: int  # the rank's local step at the snapshot
    flats: list[torch.Tensor]  # unscaled copies, one per parameter group


def _wire_name(dtype: torch.dtype, bf16: bool) -> tuple[str, torch.dtype]:
    acc = _wire_dtype(dtype)
    if bf16 and acc == torch.float32:
        return "bfloat16", torch.bfloat16
    return str(acc).removeprefix("torch."), acc


def _raw(t: torch.Tensor) -> memoryview:
    """Little-endian bytes of a contiguous CPU tensor (bfloat16 through its int16 bits)."""
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().data.cast("B")


def snapshot(flat: FlatModel, *, version: int, steps: int, step: int, gamma: float,
             bf16: bool) -> tuple[Snapshot, bytes | None]:
    """The rank's snapshot and its contribution blob (None for mass 0: declared, not
    encoded)."""
    flat.ensure_flat()
    mass = _mass(steps, gamma)
    with torch.no_grad():
        copies = [f.detach().clone() for f in flat.flats]
        snap = Snapshot(version=version, steps=steps, mass=mass, step=step, flats=copies)
        if mass == 0.0:
            return snap, None
        tensors: list[tuple[str, str, tuple[int, ...], memoryview]] = []
        for i, c in enumerate(copies):
            name, dtype = _wire_name(c.dtype, bf16)
            scaled = torch.mul(c.to(_wire_dtype(c.dtype)), mass).to(dtype)  # c stays unscaled
            tensors.append((round_param(i), name, tuple(c.shape), _raw(scaled)))
        buffers = flat.buffers()
        if buffers:
            packed = torch.cat([b.detach().reshape(-1).to("cpu", torch.float32)
                                for b in buffers])
            tensors.append((ROUND_BUFFERS, "float32", tuple(packed.shape), _raw(packed)))
    return snap, pack_tensors(tensors, version=version)


def _tensor(chunk: Any, like: torch.Tensor) -> torch.Tensor:
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16,
             "float32": torch.float32, "float64": torch.float64}.get(chunk.dtype)
    if dtype is None or tuple(chunk.shape) != tuple(like.shape):
        raise ValueError(f"consensus tensor {chunk.name!r} is {chunk.dtype}{list(chunk.shape)}, "
                         f"this rank's is {like.dtype}{list(like.shape)}")
    raw = torch.frombuffer(bytearray(chunk.data), dtype=torch.int16 if dtype ==
                           torch.bfloat16 else dtype)
    if dtype == torch.bfloat16:
        raw = raw.view(torch.bfloat16)
    return raw.to(like.device, like.dtype).view_as(like)


def apply_consensus(flat: FlatModel, snap: Snapshot, blob: bytes, *, alpha: float,
                    measure: bool) -> tuple[AverageResult, list[torch.Tensor]]:
    """``W += alpha * (C - W_snapshot)`` per parameter group, float buffers overwritten;
    returns the divergence triple (snapshot vs consensus) and the consensus tensors."""
    flat.ensure_flat()
    tensors = unpack_tensors(blob)
    consensus: list[torch.Tensor] = []
    pre_sq = post_sq = diff_sq = 0.0
    with torch.no_grad():
        for i, (f, s) in enumerate(zip(flat.flats, snap.flats, strict=True)):
            chunk = tensors.get(round_param(i))
            if chunk is None:
                raise ValueError(f"the consensus has no {round_param(i)}")
            c = _tensor(chunk, f)
            if measure:
                pre_sq += _norm(s) ** 2
                post_sq += _norm(c) ** 2
                diff_sq += _norm(s - c) ** 2
            if alpha == 1.0:  # C + (W - W_snapshot): exactly C when nothing was trained since
                f.sub_(s).add_(c)
            else:
                f.add_(c - s, alpha=alpha)
            consensus.append(c)
        buffers = flat.buffers()
        packed_chunk = tensors.get(ROUND_BUFFERS)
        if packed_chunk is not None and buffers:
            if packed_chunk.dtype != "float32":
                raise ValueError(f"consensus buffers are {packed_chunk.dtype}, not float32")
            packed = torch.frombuffer(bytearray(packed_chunk.data), dtype=torch.float32)
            if packed.numel() != sum(b.numel() for b in buffers):
                raise ValueError("the consensus buffers do not match this rank's")
            offset = 0
            for b in buffers:
                n = b.numel()
                b.copy_(packed[offset:offset + n].view_as(b))
                offset += n
    post = math.sqrt(post_sq)
    result = AverageResult(realized=True,
                           divergence=math.sqrt(diff_sq) / post if measure and post > 1e-10
                           else 0.0, pre_norm=math.sqrt(pre_sq) if measure else None,
                           post_norm=post if measure else None, movers=0)
    return result, consensus
