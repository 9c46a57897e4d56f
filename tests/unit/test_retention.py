"""What of a job's stream may go (orchestrator/runtime/retention.py): the pure rules."""

from __future__ import annotations

import pytest

from ddpbus.codecs.errors import ConfigError
from ddpbus.orchestrator.runtime.retention import Purge, Retention, horizon, plan

JOB = "ret"
P = f"ddpbus.{JOB}"


def test_telemetry_goes_up_to_the_snapshot_and_control_up_to_the_floors() -> None:
    out = plan(JOB, horizon=500, floors={0: 420, 1: 410}, members={0, 1}, done={})
    assert out == [
        Purge(f"{P}.timing.rank.*", 501, "telemetry"),
        Purge(f"{P}.metrics.rank.*", 501, "telemetry"),
        Purge(f"{P}.join.rank.*", 501, "telemetry"),
        Purge(f"{P}.control.rank.0", 421, "rank"), Purge(f"{P}.admit.rank.0", 421, "rank"),
        Purge(f"{P}.control.rank.1", 411, "rank"), Purge(f"{P}.admit.rank.1", 411, "rank"),
        # the broadcast: only what every member has passed
        Purge(f"{P}.control.all", 411, "broadcast"),
    ]


def test_nothing_goes_before_a_snapshot_or_an_ack() -> None:
    assert plan(JOB, horizon=0, floors={0: 300, 1: 300}, members={0, 1}, done={}) == []
    out = plan(JOB, horizon=10, floors={0: 0, 1: 0}, members={0, 1}, done={})
    assert [p.kind for p in out] == ["telemetry"] * 3


def test_nothing_younger_than_the_horizon_goes() -> None:
    """The horizon (the newest snapshot at least --keep-history old) caps every class."""
    out = plan(JOB, horizon=200, floors={0: 900, 1: 950}, members={0, 1}, done={})
    assert {p.below for p in out} == {201}


def test_a_member_that_acked_nothing_holds_the_broadcast_back() -> None:
    out = plan(JOB, horizon=1000, floors={0: 300, 1: 0}, members={0, 1}, done={})
    assert [p.subject for p in out if p.kind != "telemetry"] == [f"{P}.control.rank.0",
                                                                f"{P}.admit.rank.0"]


def test_a_dead_rank_does_not_hold_the_broadcast_back_but_keeps_its_own_subjects() -> None:
    # rank 2 died with its floor at 100: the live members passed 900
    out = plan(JOB, horizon=1000, floors={0: 900, 1: 950, 2: 100}, members={0, 1},
               done={})
    assert Purge(f"{P}.control.all", 901, "broadcast") in out
    assert Purge(f"{P}.control.rank.2", 101, "rank") in out  # only what it acked itself
    # a rank with no consumer floor at all (not read yet) counts as 0 for the broadcast
    out = plan(JOB, horizon=1000, floors={0: 900}, members={0, 1}, done={})
    assert all(p.kind != "broadcast" for p in out)


def test_an_unchanged_floor_costs_no_request() -> None:
    done: dict[str, int] = {}
    first = plan(JOB, horizon=50, floors={0: 40}, members={0}, done=done)
    for p in first:
        done[p.subject] = p.below
    assert plan(JOB, horizon=50, floors={0: 40}, members={0}, done=done) == []
    again = plan(JOB, horizon=50, floors={0: 41}, members={0}, done=done)
    assert {p.subject for p in again} == {f"{P}.control.rank.0", f"{P}.admit.rank.0",
                                          f"{P}.control.all"}


def test_the_horizon_keeps_the_window_behind_the_newest_snapshot() -> None:
    history = [(0.0, 100), (10.0, 200), (20.0, 300)]
    assert horizon(history, 25.0, 0.0) == 300
    assert horizon(history, 25.0, 10.0) == 200
    assert horizon(history, 25.0, 15.0) == 200
    assert horizon(history, 25.0, 30.0) == 0  # nothing old enough yet


@pytest.mark.parametrize(("every", "keep"), [(-1.0, 0.0), (1.0, -5.0), (float("nan"), 0.0)])
def test_bad_retention_settings_are_refused(every: float, keep: float) -> None:
    with pytest.raises(ConfigError, match=">= 0"):
        Retention(every_s=every, keep_s=keep)


def test_zero_turns_compaction_off() -> None:
    assert not Retention(every_s=0).enabled
    assert Retention().enabled
