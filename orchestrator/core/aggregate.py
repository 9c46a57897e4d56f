"""Epoch metrics: fold every chunk's MetricsMsg of one epoch into one EpochMetrics (C.8).

Per rank first (chunks run one after another on a rank, so times add up), then across
ranks: the loss is batch-weighted, a scalar is the batch-weighted mean of the per-rank means,
throughput is samples per millisecond of the rank's own time, batch share is the rank's
fraction of the epoch's batches.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ddpbus.codecs import messages as m


@dataclass(slots=True)
class RankSum:
    """One rank's MetricsMsg of one epoch, summed (chunks run one after another on a rank,
    so times add up): what the aggregate is made of, and what a pool folds a settled
    chunk into (pools.py)."""

    batches: int = 0
    samples: int = 0
    loss_sum: float = 0.0
    time_ms: float = 0.0
    share_complete_ms: float = 0.0
    compute_only_ms: float = 0.0
    data_starve_ms: float = 0.0
    scalars: dict[str, list[float]] = field(default_factory=dict)  # name -> [sum, count]
    # batches of chunks whose loss was not finite (a diverged rank): out of the loss's
    # numerator and denominator both, so they neither dilute the mean nor look perfect
    lossless_batches: int = 0

    def add(self, msg: m.MetricsMsg) -> None:
        self.batches += msg.batches_processed
        self.samples += msg.samples_processed
        if math.isfinite(msg.avg_loss):
            self.loss_sum += msg.avg_loss * msg.batches_processed
        else:
            self.lossless_batches += msg.batches_processed
        self.time_ms += msg.epoch_ms
        self.share_complete_ms += msg.share_complete_ms
        self.compute_only_ms += msg.compute_only_ms
        self.data_starve_ms += msg.data_starve_ms
        for name, s in msg.scalars.items():
            acc = self.scalars.setdefault(name, [0.0, 0.0])
            acc[0] += s.sum
            acc[1] += s.count

    @property
    def loss_batches(self) -> int:
        """The batches the loss sum is over."""
        return self.batches - self.lossless_batches

    def loss(self) -> float:
        """The batch-weighted mean loss; NaN when no chunk had a finite one."""
        return self.loss_sum / self.loss_batches if self.loss_batches > 0 else math.nan

    def scalar_means(self) -> dict[str, float]:
        return {k: v[0] / v[1] for k, v in self.scalars.items() if v[1] > 0}

    def copy(self) -> RankSum:
        return RankSum(self.batches, self.samples, self.loss_sum, self.time_ms,
                       self.share_complete_ms, self.compute_only_ms, self.data_starve_ms,
                       {k: list(v) for k, v in self.scalars.items()}, self.lossless_batches)


def aggregate_epoch(epoch: int, chunks: Mapping[int, Sequence[m.MetricsMsg]], world_size: int,
                    *, pool_wall_ms: float | None = None, device_indices: Sequence[int] = (),
                    folded: Mapping[int, RankSum] | None = None) -> m.EpochMetrics:
    """``chunks[rank]`` are that rank's MetricsMsg for ``epoch``, ``folded[rank]`` the sum
    of those already folded out of the pool; ``pool_wall_ms`` is the progressive pool's
    wall time (first dispatch to completion), None when not progressive."""
    sums = [RankSum() for _ in range(world_size)]
    for rank, done in (folded or {}).items():
        sums[rank] = done.copy()
    for rank, msgs in chunks.items():
        for msg in msgs:
            sums[rank].add(msg)
    total_batches = sum(s.batches for s in sums)
    loss_batches = sum(s.loss_batches for s in sums)
    per_rank_means = [s.scalar_means() for s in sums]
    scalars: dict[str, float] = {}
    for name in sorted({k for means in per_rank_means for k in means}):
        weighted = [(means[name], s.batches) for means, s in zip(per_rank_means, sums,
                                                                 strict=True) if name in means]
        weight = sum(b for _, b in weighted)
        scalars[name] = (sum(v * b for v, b in weighted) / weight if weight
                         else sum(v for v, _ in weighted) / len(weighted))
    epoch_ms = pool_wall_ms if pool_wall_ms is not None else max(
        (s.time_ms for s in sums), default=0.0)
    # one loss per rank, or none: the schema's "empty when unknown" (a NaN hole would read
    # as a loss on the wire); a rank with no finite loss leaves avg_loss to the others
    losses = tuple(s.loss() for s in sums)
    per_rank_loss = losses if all(math.isfinite(x) for x in losses) else ()
    return m.EpochMetrics(
        epoch=epoch,
        avg_loss=(sum(s.loss_sum for s in sums) / loss_batches) if loss_batches else math.nan,
        epoch_ms=epoch_ms,
        scalars=scalars,
        per_rank=tuple(per_rank_means),
        per_rank_throughput=tuple(s.samples / s.time_ms if s.time_ms > 0 else 0.0
                                  for s in sums),
        per_rank_batch_share=tuple(s.batches / total_batches if total_batches else 0.0
                                   for s in sums),
        per_rank_share_complete_ms=tuple(s.share_complete_ms for s in sums),
        per_rank_compute_only_ms=tuple(s.compute_only_ms for s in sums),
        per_rank_data_starve_ms=tuple(s.data_starve_ms for s in sums),
        device_indices=tuple(device_indices),
        per_rank_loss=per_rank_loss,
        per_rank_samples=tuple(s.samples for s in sums),
    )
