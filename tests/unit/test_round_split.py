"""The coordinator's split of an average (runtime.coordinator.round_split): what each field
is made of, and which are left out when a rank could not say."""

from __future__ import annotations

from ddpbus.codecs import messages as m
from ddpbus.orchestrator.runtime.coordinator import round_split


def _ack(rank: int, received_at: float | None, average_ms: float | None,
         collective_ms: float | None, *, failed: bool = False) -> m.SyncAck:
    return m.SyncAck(rank=rank, step_count=5, divergence=0.0, failed=failed,
                     received_at=received_at, average_ms=average_ms,
                     collective_ms=collective_ms)


def test_delivery_is_the_last_rank_and_the_collective_the_least_waiting_one() -> None:
    acks = [_ack(0, 100.0015, 3.0, 2.5), _ack(1, 100.0030, 1.2, 0.9)]
    got = round_split(100.0, 100.001, acks)
    assert got == {"write_ahead_ms": 1.0, "deliver_ms": 3.0, "average_ms": 1.2,
                   "collective_ms": 0.9}


def test_a_rank_that_did_not_say_leaves_its_figure_out() -> None:
    acks = [_ack(0, 100.002, 1.0, 0.5), _ack(1, None, None, 0.4)]  # an older rank's ack
    got = round_split(100.0, 100.001, acks)
    assert got == {"write_ahead_ms": 1.0, "collective_ms": 0.4}


def test_a_failed_collective_reports_only_the_write_ahead_part() -> None:
    acks = [_ack(0, 100.002, 1.0, 0.5), _ack(1, 100.002, 9.0, 8.0, failed=True)]
    assert round_split(100.0, 100.001, acks) == {"write_ahead_ms": 1.0}


def test_no_decision_seen_no_split() -> None:  # (a coordinator that took over mid-round)
    assert round_split(None, 100.001, [_ack(0, 100.002, 1.0, 0.5)]) == {}
