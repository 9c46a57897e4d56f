"""The trend guard (C.4), epoch aggregation (C.8) and the work pools and splits (C.5, C.7)."""

from __future__ import annotations

import math

import pytest

from ddpbus.codecs import messages as m
from ddpbus.codecs.convert import epoch_metrics_from_wire, epoch_metrics_to_wire
from ddpbus.orchestrator.core.aggregate import RankSum, aggregate_epoch
from ddpbus.orchestrator.core.elche import STABLE, Verdict
from ddpbus.orchestrator.core.guard import TrendGuard, cosine
from ddpbus.orchestrator.core.pools import Assignment, Pool, equal_split, proportional_split

# ----------------------------------------------------------------------- guard


def verdicts(guard: TrendGuard, values: list[float]) -> list[Verdict]:
    return [guard.observe([v]).verdict for v in values]


def test_three_strict_rises_above_threshold_suppress_growth() -> None:
    g = TrendGuard(threshold=0.05)
    assert verdicts(g, [0.06, 0.07, 0.08]) == [Verdict.STABLE, Verdict.STABLE,
                                               Verdict.SUPPRESS_GROWTH]


def test_guard_uses_the_max_over_ranks() -> None:
    g = TrendGuard(threshold=0.05)
    g.observe([0.06, 0.01])
    g.observe([0.02, 0.07])
    assert g.observe([0.08, 0.0]).verdict is Verdict.SUPPRESS_GROWTH


def test_equal_values_are_not_a_rise() -> None:
    g = TrendGuard(threshold=0.05)
    assert verdicts(g, [0.06, 0.06, 0.07])[-1] is Verdict.STABLE


def test_rises_below_threshold_are_stable() -> None:
    g = TrendGuard(threshold=0.05)
    assert verdicts(g, [0.01, 0.02, 0.03]) == [Verdict.STABLE] * 3


def test_latest_equal_to_threshold_is_stable() -> None:
    g = TrendGuard(threshold=0.05)
    assert verdicts(g, [0.03, 0.04, 0.05])[-1] is Verdict.STABLE


def test_only_the_last_three_values_count() -> None:
    g = TrendGuard(threshold=0.05)
    assert verdicts(g, [0.2, 0.06, 0.07, 0.08])[-1] is Verdict.SUPPRESS_GROWTH
    assert verdicts(g, [0.07])[-1] is Verdict.STABLE


def test_disabled_guard_is_always_stable() -> None:
    g = TrendGuard(threshold=0.05, enabled=False)
    assert verdicts(g, [0.1, 0.2, 0.3, 0.4]) == [Verdict.STABLE] * 4


def test_sync_guard_is_always_stable() -> None:
    g = TrendGuard(threshold=0.05, sync=True)
    assert verdicts(g, [0.1, 0.2, 0.3, 0.4]) == [Verdict.STABLE] * 4
    assert not g.history


def test_non_finite_divergences_are_ignored() -> None:
    g = TrendGuard(threshold=0.05)
    assert g.observe([math.nan]) is STABLE
    assert g.observe([]) is STABLE
    assert not g.history
    g.observe([0.06, math.inf])
    assert list(g.history) == [0.06]


def test_cosine_from_norms() -> None:
    assert cosine(0.0, 2.0, 2.0) == pytest.approx(1.0)
    assert cosine(0.5, 0.0, 1.0) == 1.0
    assert -1.0 <= cosine(10.0, 1.0, 1.0) <= 1.0


# ------------------------------------------------------------------ aggregate


def chunk(rank: int, *, loss: float, batches: int, ms: float, samples: int,
          acc: tuple[float, int] | None = None) -> m.MetricsMsg:
    scalars = {} if acc is None else {"acc": m.ScalarSum(sum=acc[0], count=acc[1])}
    return m.MetricsMsg(rank=rank, epoch=3, avg_loss=loss, batches_processed=batches,
                        epoch_ms=ms, samples_processed=samples, share_complete_ms=ms,
                        compute_only_ms=ms / 2, data_starve_ms=1.0, scalars=scalars)


CHUNKS = {
    0: [chunk(0, loss=1.0, batches=10, ms=100.0, samples=80, acc=(5.0, 10)),
        chunk(0, loss=2.0, batches=10, ms=100.0, samples=80, acc=(10.0, 10))],
    1: [chunk(1, loss=4.0, batches=5, ms=250.0, samples=40, acc=(0.8, 1))],
}


def test_loss_is_batch_weighted() -> None:
    e = aggregate_epoch(3, CHUNKS, 2)
    assert e.epoch == 3
    assert e.avg_loss == pytest.approx((10 * 1.0 + 10 * 2.0 + 5 * 4.0) / 25)
    assert e.per_rank_loss == pytest.approx((1.5, 4.0))


def test_scalars_are_batch_weighted_mean_of_per_rank_means() -> None:
    e = aggregate_epoch(3, CHUNKS, 2)
    assert e.per_rank[0] == pytest.approx({"acc": 0.75})
    assert e.per_rank[1] == pytest.approx({"acc": 0.8})
    assert e.scalars["acc"] == pytest.approx((0.75 * 20 + 0.8 * 5) / 25)


def test_throughput_is_samples_per_ms_of_the_ranks_own_time() -> None:
    e = aggregate_epoch(3, CHUNKS, 2)
    assert e.per_rank_throughput == pytest.approx((160 / 200, 40 / 250))
    assert e.per_rank_samples == (160, 40)


def test_batch_share_is_fraction_of_epoch_batches() -> None:
    e = aggregate_epoch(3, CHUNKS, 2)
    assert e.per_rank_batch_share == pytest.approx((0.8, 0.2))


def test_epoch_ms_is_max_rank_time() -> None:
    assert aggregate_epoch(3, CHUNKS, 2).epoch_ms == pytest.approx(250.0)


def test_epoch_ms_is_pool_wall_time_when_given() -> None:
    assert aggregate_epoch(3, CHUNKS, 2, pool_wall_ms=123.0).epoch_ms == 123.0


def test_per_rank_breakdowns_add_up_over_chunks() -> None:
    e = aggregate_epoch(3, CHUNKS, 2, device_indices=(0, -1))
    assert e.per_rank_share_complete_ms == pytest.approx((200.0, 250.0))
    assert e.per_rank_compute_only_ms == pytest.approx((100.0, 125.0))
    assert e.per_rank_data_starve_ms == pytest.approx((2.0, 1.0))
    assert e.device_indices == (0, -1)


def test_rank_without_chunks_has_zero_share_and_nan_loss() -> None:
    e = aggregate_epoch(3, {0: CHUNKS[0]}, 2)
    assert e.per_rank_batch_share == (1.0, 0.0)
    assert e.per_rank_throughput[1] == 0.0
    assert e.per_rank_loss == ()  # rank 1's is unknown: none, as the schema says
    assert e.per_rank[1] == {}


def test_a_diverged_rank_neither_dilutes_the_loss_nor_looks_perfect() -> None:
    chunks = {0: [chunk(0, loss=1.0, batches=10, ms=100.0, samples=80)],
              1: [chunk(1, loss=math.nan, batches=10, ms=100.0, samples=80),
                  chunk(1, loss=math.inf, batches=5, ms=50.0, samples=40)]}
    e = aggregate_epoch(3, chunks, 2)
    assert e.avg_loss == pytest.approx(1.0)
    assert e.per_rank_loss == ()  # rank 1's is unknown: empty, never a NaN on the wire
    assert e.per_rank_batch_share == pytest.approx((10 / 25, 15 / 25))  # it did the work
    wire = epoch_metrics_from_wire(epoch_metrics_to_wire(e))
    assert wire.per_rank_loss == ()
    assert math.isfinite(wire.avg_loss)


def test_a_non_finite_chunk_leaves_the_ranks_finite_ones_their_mean() -> None:
    chunks = {0: [chunk(0, loss=2.0, batches=10, ms=100.0, samples=80),
                  chunk(0, loss=math.nan, batches=30, ms=100.0, samples=240)]}
    folded = RankSum()
    folded.add(chunk(0, loss=math.nan, batches=20, ms=100.0, samples=160))
    folded.add(chunk(0, loss=4.0, batches=10, ms=100.0, samples=80))
    e = aggregate_epoch(3, chunks, 1, folded={0: folded})
    assert e.avg_loss == pytest.approx(3.0)
    assert e.per_rank_loss == pytest.approx((3.0,))


def test_no_batches_gives_nan_loss() -> None:
    e = aggregate_epoch(0, {}, 2)
    assert math.isnan(e.avg_loss)
    assert e.epoch_ms == 0.0
    assert e.per_rank_batch_share == (0.0, 0.0)


# ---------------------------------------------------------------------- splits


def test_equal_split_remainder_to_first_ranks() -> None:
    assert equal_split(10, [2, 0, 1]) == {0: 4, 1: 3, 2: 3}
    assert equal_split(9, [0, 1, 2]) == {0: 3, 1: 3, 2: 3}


def test_proportional_split_follows_throughput_remainder_to_fastest() -> None:
    assert proportional_split(100, {0: 2.0, 1: 5.0}) == {0: 72, 1: 28}


def test_proportional_split_remainder_goes_fastest_first() -> None:
    out = proportional_split(10, {0: 3.0, 1: 1.0, 2: 3.0})
    assert sum(out.values()) == 10
    assert out == {0: 2, 1: 6, 2: 2}


def test_unmeasured_rank_counts_as_the_slowest_measured() -> None:
    assert proportional_split(100, {0: 2.0, 1: None}) == {0: 50, 1: 50}
    assert proportional_split(90, {0: 2.0, 1: 4.0, 2: None}) == {0: 46, 1: 22, 2: 22}


def test_proportional_split_with_nothing_measured_is_equal() -> None:
    assert proportional_split(11, {0: None, 1: None}) == {0: 6, 1: 5}


def test_proportional_split_clamps_zero_ms() -> None:
    out = proportional_split(10, {0: 0.0, 1: 1.0})
    assert sum(out.values()) == 10
    assert out[0] > out[1]


# ----------------------------------------------------------------------- pools


def test_pool_take_cursor_is_monotonic_and_never_overlaps() -> None:
    pool = Pool(epoch=2, total=10)
    a = pool.take(0, 4, now=1.0)
    b = pool.take(1, 4, now=2.0)
    c = pool.take(0, 4, now=3.0)
    assert a is not None
    assert b is not None
    assert c is not None
    assert [(x.offset, x.size) for x in (a, b, c)] == [(0, 4), (4, 4), (8, 2)]
    assert pool.cursor == 10
    assert pool.exhausted
    assert pool.take(1, 4, now=4.0) is None
    assert pool.first_dispatch_at == 1.0
    assert [r for r, _ in pool.assignments] == [0, 1, 0]


def test_pool_take_of_nothing_is_none() -> None:
    pool = Pool(epoch=0, total=5)
    assert pool.take(0, 0, now=0.0) is None
    assert pool.cursor == 0
    assert pool.first_dispatch_at is None


def test_pool_trained_then_reported() -> None:
    pool = Pool(epoch=0, total=6)
    a = pool.take(0, 3, now=0.0)
    assert a is not None
    a.done = 3
    assert not pool.trained  # cursor not at the end
    b = pool.take(1, 3, now=0.0)
    assert b is not None
    b.done = 2
    assert not pool.trained
    b.done = 3
    assert pool.trained
    assert not pool.reported
    a.metrics = b.metrics = m.MetricsMsg(rank=0, epoch=0, avg_loss=1.0, batches_processed=3,
                                         epoch_ms=1.0, samples_processed=3)
    assert pool.reported
    assert set(pool.chunks()) == {0, 1}


def _report(a: Assignment) -> None:
    a.done = a.size
    a.metrics = m.MetricsMsg(rank=0, epoch=a.epoch, avg_loss=1.0, batches_processed=a.size,
                             epoch_ms=1.0, samples_processed=a.size)


def test_a_reported_prefix_is_not_examined_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thousand ranks' metrics, each followed by the aggregation check: the check resumes
    after the assignments already settled instead of rescanning the pool each time."""
    pool = Pool(epoch=0, total=1000)
    plans = [pool.take(r, 1, now=0.0) for r in range(1000)]
    looked = 0
    real = Assignment.complete

    def complete(a: Assignment) -> bool:
        nonlocal looked
        looked += 1
        return real.fget(a)  # type: ignore[attr-defined,no-any-return]

    monkeypatch.setattr(Assignment, "complete", property(complete))
    for a in plans:
        assert a is not None
        assert not pool.reported
        _report(a)
    assert pool.reported
    assert pool.trained
    assert looked <= 3 * len(plans), looked  # linear over the epoch, not quadratic


def test_a_dropped_plan_or_an_orphan_keeps_the_checks_right() -> None:
    pool = Pool(epoch=0, total=4)
    a, b, c = pool.take(0, 1, now=0.0), pool.take(1, 2, now=0.0), pool.take(2, 1, now=0.0)
    assert a is not None
    assert b is not None
    assert c is not None
    _report(a)
    _report(c)
    assert not pool.reported
    assert not pool.trained
    assert pool.settled == 1
    b.done = 1  # its rank died after one batch: cut to it, metrics never come
    b.size, b.orphaned = 1, True
    assert pool.trained
    assert pool.reported
    pool.drop(c)  # (as a death does for a plan with nothing averaged)
    assert pool.settled == 0
    assert pool.reported
    d = pool.reassign(3, c.offset, c.size)
    assert not pool.trained
    _report(d)
    assert pool.reported
    assert pool.settled == 3


def test_assignment_plan_is_in_samples() -> None:
    pool = Pool(epoch=1, total=10)
    pool.take(0, 3, now=0.0)
    a = pool.take(1, 4, now=0.0)
    assert a is not None
    assert a.plan(8) == m.EpochPlan(epoch=1, partition_offset=24, partition_size=32)
    assert a.remaining == 4
    a.done = 4
    assert a.complete
    assert a.remaining == 0
