"""El Che's anchor growth and the guard verdict seam."""

from __future__ import annotations

import pytest
from test_elche import feed, make

from ddpbus.orchestrator.core.elche import (
    STABLE,
    ElChe,
    GuardVerdict,
    Phase,
    RankWindow,
    Verdict,
    WindowReport,
)

SUPPRESS = GuardVerdict(Verdict.SUPPRESS_GROWTH)


# --------------------------------------------------------------------- growth


def equal(e: ElChe, times: int = 1, reduce_ms: float = 0.0) -> None:
    feed(e, {0: 10.0, 1: 10.0}, times=times, reduce_ms=reduce_ms)


def test_no_growth_proposal_in_first_warmup_calibration() -> None:
    e = make()
    assert e.pending_anchor is None  # Probe
    equal(e, reduce_ms=1000.0)
    assert e.phase is Phase.WARMUP
    assert e.pending_anchor is None


def test_warmup_fires_only_above_twice_the_target() -> None:
    e = make()
    equal(e)
    equal(e, reduce_ms=10.0)  # overhead 10/110 = 0.09 < 0.10
    assert e.last_overhead == pytest.approx(10 / 110)
    assert e.pending_anchor is None
    equal(e, reduce_ms=20.0)  # 20/120 = 0.167 > 0.10
    assert e.pending_anchor == 20


def test_stable_fires_above_the_target() -> None:
    e = make()
    equal(e, times=4)
    equal(e, reduce_ms=10.0)  # 5th calibration: Stable, 0.0909 > 0.05
    assert e.phase is Phase.STABLE
    assert e.pending_anchor == 19  # ceil(10 * 0.0909 / 0.05)


def test_growth_step_capped_at_double() -> None:
    e = make()
    equal(e, times=4)
    equal(e, reduce_ms=1000.0)
    assert e.pending_anchor == 20


def test_growth_clamped_to_max_anchor() -> None:
    e = make(max_anchor=15)
    equal(e, times=4)
    equal(e, reduce_ms=1000.0)
    assert e.pending_anchor == 15


def test_first_batch_fill_counts_as_fixed_cost() -> None:
    e = make()
    equal(e, times=4)
    report = WindowReport(ranks={r: RankWindow(steps=10, compute_ms=100.0, fill_ms=20.0)
                                 for r in (0, 1)}, reduce_ms=0.0, use_delivered=False)
    e.report_window(report)
    assert e.last_overhead == pytest.approx(10 / 110)
    assert e.pending_anchor == 19


def test_no_growth_while_window_cap_binds() -> None:
    e = make(max_total=15)
    equal(e, times=4)
    equal(e, reduce_ms=1000.0)
    assert e.cap_binds
    assert e.pending_anchor is None


def test_no_growth_when_disabled_as_under_sync() -> None:
    e = make(anchor=1, min_anchor=1, growth=False)
    equal(e, times=4)
    equal(e, reduce_ms=1000.0)
    assert e.pending_anchor is None
    e.apply_verdict(STABLE)
    assert e.anchor == 1


def test_proposal_is_not_applied_without_a_verdict() -> None:
    e = make()
    equal(e, times=4)
    equal(e, reduce_ms=1000.0)
    assert e.anchor == 10


# -------------------------------------------------------------------- verdicts


def grown(**knobs: object) -> ElChe:
    e = make(**knobs)
    equal(e, times=4)
    equal(e, reduce_ms=1000.0)
    assert e.pending_anchor == 20
    return e


def test_stable_verdict_commits_the_proposal() -> None:
    e = grown()
    e.apply_verdict(STABLE)
    assert e.anchor == 20
    assert e.counts == {0: 20, 1: 20}
    assert e.pending_anchor is None


def test_suppress_drops_the_proposal_and_latches_growth_off() -> None:
    e = grown()
    e.apply_verdict(SUPPRESS)
    assert e.anchor == 10
    assert e.growth_latched
    equal(e, reduce_ms=1000.0)
    assert e.pending_anchor is None


def test_five_consecutive_stable_verdicts_rearm_growth() -> None:
    e = grown()
    e.apply_verdict(SUPPRESS)
    for _ in range(4):
        equal(e, reduce_ms=1000.0)
        e.apply_verdict(STABLE)
    assert e.growth_latched
    assert e.anchor == 10
    e.apply_verdict(STABLE)
    assert not e.growth_latched
    equal(e, reduce_ms=1000.0)
    assert e.pending_anchor == 20


def test_suppress_resets_the_stable_streak() -> None:
    e = grown()
    e.apply_verdict(SUPPRESS)
    for _ in range(4):
        e.apply_verdict(STABLE)
    e.apply_verdict(SUPPRESS)
    for _ in range(4):
        e.apply_verdict(STABLE)
    assert e.growth_latched


def test_nudge_down_verdict_shrinks_anchor_and_latches() -> None:
    e = grown()
    e.apply_verdict(GuardVerdict(Verdict.NUDGE_DOWN, factor=0.5))
    assert e.anchor == 5  # below min_anchor 10
    assert e.growth_latched
    assert e.pending_anchor is None
    assert e.counts == {0: 5, 1: 5}


@pytest.mark.parametrize(("anchor", "factor", "expected"), [
    (10, 0.5, 5), (10, 0.33, 4), (10, 0.01, 1), (10, 2.0, 10), (1, 0.1, 1), (3, 0.1, 1)])
def test_nudge_anchor_down_clamps_factor_and_floors_at_one(anchor: int, factor: float,
                                                           expected: int) -> None:
    e = make(anchor=anchor, min_anchor=anchor)
    e.nudge_anchor_down(factor)
    assert e.anchor == expected


def test_relax_up_adds_one_on_stable() -> None:
    e = make(relax_up=True)
    equal(e)
    e.apply_verdict(STABLE)
    assert e.anchor == 11


def test_relax_up_off_by_default() -> None:
    e = make()
    equal(e)
    e.apply_verdict(STABLE)
    assert e.anchor == 10


def test_relax_up_refused_when_max_batch_diff_would_be_exceeded() -> None:
    e = make(relax_up=True, max_batch_diff=15)
    feed(e, {0: 2.0, 1: 5.0})  # 25 vs 10; x1.1 -> 28 vs 11: gap 17 > 15
    e.apply_verdict(STABLE)
    assert e.anchor == 10


def test_relax_up_allowed_within_max_batch_diff() -> None:
    e = make(relax_up=True, max_batch_diff=20)
    feed(e, {0: 2.0, 1: 5.0})
    e.apply_verdict(STABLE)
    assert e.anchor == 11


def test_relax_up_waits_for_the_growth_latch_to_rearm() -> None:
    e = make(relax_up=True)
    equal(e)
    e.apply_verdict(SUPPRESS)  # latches growth off (I.8)
    for _ in range(4):
        e.apply_verdict(STABLE)
    assert e.growth_latched
    assert e.anchor == 10
    e.apply_verdict(STABLE)  # the 5th consecutive Stable re-arms it
    assert not e.growth_latched
    assert e.anchor == 11


def test_relax_up_never_grows_the_anchor_when_growth_is_off_as_under_sync() -> None:
    e = make(relax_up=True, growth=False)
    equal(e)
    for _ in range(3):
        e.apply_verdict(STABLE)
    assert e.anchor == 10


def test_relax_up_never_passes_max_anchor() -> None:
    e = make(relax_up=True, max_anchor=10)
    equal(e)
    e.apply_verdict(STABLE)
    assert e.anchor == 10
