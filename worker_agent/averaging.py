"""Work-weighted parameter averaging with torch.distributed (reference C.3, NCCL arm).

On SyncNow every rank runs the same collectives, in the same order, on the same branch:

1. COUNT: all-reduce-sum of ``[n^gamma, mover]`` (``n`` = optimizer steps since the last
   average, ``mover = 1`` if ``n > 0``; an idle rank has mass 0 for any gamma);
2. if the summed mass is 0 the round is not realised: nothing else runs, nothing changes;
3. PARAMS: each rank scales its parameters by ``n^gamma / sum`` and all-reduce-sums them
   (the normalisation is fused into the collective; no divide afterwards);
4. BUFFERS (floating-point only, e.g. BatchNorm statistics): scaled by
   ``mover / sum(mover)``, all-reduce-summed. Integer buffers are left alone.

Parameters live in one flat buffer per dtype and device (each ``Parameter.data`` is a view
into it), so an average is one collective per dtype with no gather/scatter copies. The
divergence ``|pre - post| / |post|`` and both norms go back in SyncAck.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass(frozen=True, slots=True)
class AverageResult:
    realized: bool  # False: the whole cohort was idle, nothing changed
    divergence: float
    pre_norm: float | None
    post_norm: float | None
    movers: int


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


def _norm(tensors: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


def _all_reduce(t: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    if t.dtype in _LOW_PRECISION:  # accumulate low-precision parameters in float32
        wide = t.float()
        dist.all_reduce(wide, group=group)
        t.copy_(wide)
    else:
        dist.all_reduce(t, group=group)


def average(flat: FlatModel, steps: int, *, gamma: float, measure: bool,
            device: torch.device, group: dist.ProcessGroup | None = None) -> AverageResult:
    """One averaging round; every rank of ``group`` must call it for the same SyncNow."""
    flat.ensure_flat()
    mass = float(steps) ** gamma if steps > 0 else 0.0
    counts = torch.tensor([mass, 1.0 if steps > 0 else 0.0], dtype=torch.float64,
                          device=device)
    dist.all_reduce(counts, group=group)
    total_mass, movers = float(counts[0]), float(counts[1])
    if total_mass <= 0.0:
        return AverageResult(realized=False, divergence=0.0, pre_norm=None, post_norm=None,
                             movers=0)
    with torch.no_grad():
        pre = [f.clone() for f in flat.flats] if measure else []
        factor = mass / total_mass
        for f in flat.flats:
            f.mul_(factor)
            _all_reduce(f, group)
        buffers = flat.buffers()
        if buffers:
            share = (1.0 if steps > 0 else 0.0) / movers
            packed = torch.cat([b.reshape(-1).to(torch.float64) for b in buffers]).to(device)
            packed.mul_(share)
            dist.all_reduce(packed, group=group)
            offset = 0
            for b in buffers:
                n = b.numel()
                b.copy_(packed[offset:offset + n].view_as(b))
                offset += n
        if not measure:
            return AverageResult(realized=True, divergence=0.0, pre_norm=None, post_norm=None,
                                 movers=round(movers))
        post_norm = _norm(flat.flats)
        pre_norm = _norm(pre)
        diff = _norm([p.sub_(f) for p, f in zip(pre, flat.flats, strict=True)])
    divergence = diff / post_norm if post_norm > 1e-10 else 0.0
    return AverageResult(realized=True, divergence=divergence, pre_norm=pre_norm,
                         post_norm=post_norm, movers=round(movers))


def broadcast_from_root(flat: FlatModel, group: dist.ProcessGroup | None = None) -> None:
    """Everyone starts from rank 0's parameters and floating-point buffers."""
    flat.ensure_flat()
    with torch.no_grad():
        for f in flat.flats:
            dist.broadcast(f, src=0, group=group)
        for b in flat.buffers():
            dist.broadcast(b, src=0, group=group)
