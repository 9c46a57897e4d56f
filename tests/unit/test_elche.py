"""El Che, the batch-count balancer, driven directly."""

from __future__ import annotations

import pytest
from elche_helpers import feed, make

from ddpbus.orchestrator.core.elche import (
    Phase,
    RankWindow,
    WindowReport,
    clamp_total,
)

# ----------------------------------------------------------------- calibration


def test_first_calibration_sets_counts_from_speeds() -> None:
    e = make()
    feed(e, {0: 2.0, 1: 5.0})
    assert e.anchor_rank == 1
    assert e.counts == {0: 25, 1: 10}
    assert e.phase is Phase.WARMUP


def test_counts_before_any_report_are_the_anchor() -> None:
    e = make()
    assert e.counts == {0: 10, 1: 10}
    assert e.phase is Phase.PROBE
    assert not e.calibrated


def test_speed_divides_by_actual_batches_not_scheduled_count() -> None:
    e = make()  # both scheduled 10
    feed(e, {0: 2.0, 1: 5.0}, steps={0: 40, 1: 10})  # rank 0 ran 40 in the window
    assert e.smoothed_ms(0) == pytest.approx(2.0)
    assert e.counts[0] == 25


def test_idle_window_reports_nothing() -> None:
    e = make()
    feed(e, {0: 2.0, 1: 5.0}, steps={0: 0, 1: 0})
    assert e.calibrations == 0
    assert e.smoothed_ms(0) is None


def test_trust_window_is_mean_of_last_five_readings() -> None:
    e = make()
    for ms in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0):
        feed(e, {0: ms, 1: 10.0})
    assert e.smoothed_ms(0) == pytest.approx((2 + 3 + 4 + 5 + 6) / 5)


def test_five_missed_reports_clear_a_ranks_window() -> None:
    e = make()
    feed(e, {0: 2.0, 1: 5.0})
    feed(e, {0: 2.0, 1: 5.0}, steps={0: 0, 1: 10}, times=4)
    assert e.smoothed_ms(0) == pytest.approx(2.0)
    feed(e, {0: 2.0, 1: 5.0}, steps={0: 0, 1: 10})
    assert e.smoothed_ms(0) is None


def test_delivered_scale_used_when_every_mover_has_delivered_samples() -> None:
    e = make()
    report = WindowReport(ranks={
        0: RankWindow(steps=10, compute_ms=20.0, delivered_ms=27.0, delivered_batches=9),
        1: RankWindow(steps=10, compute_ms=50.0, delivered_ms=54.0, delivered_batches=9)},
        reduce_ms=0.0, use_delivered=True)
    e.report_window(report)
    assert e.smoothed_ms(0) == pytest.approx(3.0)
    assert e.smoothed_ms(1) == pytest.approx(6.0)


def test_scales_never_mix_when_one_mover_lacks_delivered_samples() -> None:
    e = make()
    report = WindowReport(ranks={
        0: RankWindow(steps=10, compute_ms=20.0, delivered_ms=27.0, delivered_batches=9),
        1: RankWindow(steps=1, compute_ms=5.0)},
        reduce_ms=0.0, use_delivered=True)
    e.report_window(report)
    assert e.smoothed_ms(0) == pytest.approx(2.0)
    assert e.smoothed_ms(1) == pytest.approx(5.0)


def test_speed_ratio_capped_at_64() -> None:
    e = make()
    feed(e, {0: 1.0, 1: 100.0})
    assert e.counts == {0: 640, 1: 10}


def test_count_never_below_one() -> None:
    e = make(anchor=1, min_anchor=1)
    feed(e, {0: 2.0, 1: 5.0})
    feed(e, {0: 20.0, 1: 5.0})  # anchor rank 1 frozen: round(1 * 5 / 11) = 0 -> 1
    assert e.counts[0] == 1


# ------------------------------------------------------------ dead zone / diff


def test_change_within_dead_zone_keeps_the_count() -> None:
    e = make()
    feed(e, {0: 2.0, 1: 5.0})  # rank 0: 25
    feed(e, {0: 1.846, 1: 5.0})  # mean 1.923 -> target 26, within 5% of 25
    assert e.counts[0] == 25


def test_change_beyond_dead_zone_applies() -> None:
    e = make()
    feed(e, {0: 2.0, 1: 5.0})
    feed(e, {0: 4.0 / 3.0, 1: 5.0})  # mean 1.667 -> target 30
    assert e.counts[0] == 30


def test_max_batch_diff_limits_growth_per_update() -> None:
    e = make(max_batch_diff=3)
    feed(e, {0: 2.0, 1: 5.0})  # the first calibration is not limited
    assert e.counts[0] == 25
    feed(e, {0: 4.0 / 3.0, 1: 5.0})  # target 30
    assert e.counts[0] == 28


def test_max_batch_diff_limits_shrink_per_update() -> None:
    e = make(max_batch_diff=3)
    feed(e, {0: 2.0, 1: 5.0})
    feed(e, {0: 8.0, 1: 5.0}, steps={0: 10, 1: 10})  # rank 0 mean 5.0 -> target 10
    assert e.counts[0] == 22


def test_staged_slack_shrinks_next_count_once_bypassing_dead_zone() -> None:
    e = make()
    feed(e, {0: 2.0, 1: 5.0})
    e.stage_slack(0, 3.0)  # ceil(3 / 2) = 2 batches
    feed(e, {0: 2.0, 1: 5.0})
    assert e.counts[0] == 23
    feed(e, {0: 2.0, 1: 5.0})
    assert e.counts[0] == 25


# ------------------------------------------------------------------ window cap


def test_clamp_total_scales_down_to_total_with_floor_one() -> None:
    out = clamp_total({0: 30, 1: 10, 2: 1}, 20)
    assert sum(out.values()) <= 20
    assert min(out.values()) >= 1
    assert out[0] > out[1]


def test_clamp_total_keeps_counts_that_fit() -> None:
    assert clamp_total({0: 3, 1: 4}, 7) == {0: 3, 1: 4}


def test_clamp_total_degenerate_total_below_rank_count() -> None:
    out = clamp_total({0: 5, 1: 5, 2: 5}, 2)
    assert out == {0: 1, 1: 1, 2: 0}


def test_window_cap_keeps_counts_within_epoch() -> None:
    e = make(max_total=20)
    feed(e, {0: 2.0, 1: 5.0})
    assert sum(e.counts.values()) <= 20
    assert min(e.counts.values()) >= 1
    assert e.cap_binds


def test_window_cap_floor_of_one_wins_when_world_exceeds_epoch() -> None:
    e = make(ranks=3, max_total=2)
    feed(e, {0: 2.0, 1: 5.0, 2: 5.0})
    assert min(e.counts.values()) >= 1


# -------------------------------------------------------------------- election


def test_single_slowest_rank_is_the_anchor() -> None:
    e = make(ranks=3)
    feed(e, {0: 5.0, 1: 10.0, 2: 8.0})  # 8 < 0.85 * 10: alone in the cohort
    assert e.anchor_rank == 1


def test_cohort_band_elects_lowest_index_member() -> None:
    e = make()
    feed(e, {0: 9.0, 1: 10.0})  # 9 >= 0.85 * 10: both in the slow cohort
    assert e.anchor_rank == 0


def test_election_frozen_before_stable() -> None:
    e = make()
    feed(e, {0: 2.0, 1: 5.0})
    feed(e, {0: 20.0, 1: 5.0})  # rank 0 is now far slower, phase still Warmup
    assert e.phase is Phase.WARMUP
    assert e.anchor_rank == 1


def test_election_reopens_at_stable() -> None:
    e = make()
    feed(e, {0: 2.0, 1: 5.0})
    feed(e, {0: 20.0, 1: 5.0}, times=4)
    assert e.phase is Phase.STABLE
    assert e.anchor_rank == 0


def test_challenger_within_dominance_margin_keeps_pinned_anchor() -> None:
    e = make()
    feed(e, {0: 5.0, 1: 10.0})
    feed(e, {0: 10.5, 1: 10.0}, times=5)  # 5% slower: not dominant
    assert e.phase is Phase.STABLE
    assert e.anchor_rank == 1


def test_challenger_beyond_dominance_margin_takes_the_anchor() -> None:
    e = make()
    feed(e, {0: 5.0, 1: 10.0})
    feed(e, {0: 11.5, 1: 10.0}, times=5)  # 15% slower, both still in the 15% band
    assert e.anchor_rank == 0


def test_anchor_escapes_a_pinned_rank_without_data() -> None:
    e = make()
    feed(e, {0: 2.0, 1: 5.0})
    feed(e, {0: 2.0, 1: 5.0}, steps={0: 10, 1: 0}, times=5)
    assert e.smoothed_ms(1) is None
    assert e.anchor_rank == 0


# ------------------------------------------------------------ share / fastest


def test_recent_batch_share_is_equal_before_any_report() -> None:
    assert make().recent_batch_share() == {0: 0.5, 1: 0.5}


def test_recent_batch_share_averages_recent_allocations() -> None:
    e = make()
    feed(e, {0: 2.0, 1: 5.0})  # 25 / 10
    assert e.recent_batch_share() == pytest.approx({0: 25 / 35, 1: 10 / 35})
    feed(e, {0: 8.0 / 3.0, 1: 5.0})  # mean 2.33 -> 21 / 10
    assert e.recent_batch_share() == pytest.approx({0: 46 / 66, 1: 20 / 66})


def test_fastest_is_lowest_smoothed_ms() -> None:
    e = make(ranks=3)
    feed(e, {0: 5.0, 1: 2.0, 2: 3.0})
    assert e.fastest([0, 1, 2]) == 1
    assert e.fastest([0, 2]) == 2


def test_fastest_ties_go_to_lowest_rank_and_unmeasured_are_skipped() -> None:
    e = make(ranks=3)
    feed(e, {0: 4.0, 1: 4.0, 2: 9.0}, steps={0: 10, 1: 10, 2: 10})
    assert e.fastest([1, 0]) == 0
    fresh = make(ranks=3)
    assert fresh.fastest([0, 1, 2]) is None
