"""The core's ledger is deduplicated by message id: a re-published copy that JetStream
stored twice (after an outage longer than its duplicate window) changes nothing."""

from __future__ import annotations

from core_harness import Core, formed, refusals

from ddpbus.codecs import messages as m
from ddpbus.orchestrator.core.state import ID_HOLES, Command, Metrics, Timing
from ddpbus.orchestrator.core.transition import first_delivery


def batch(core: Core, rank: int, msg_id: str) -> list[Command]:
    core.steps[rank] += 1
    return core.feed(Timing(m.Batch(rank=rank, batch_ms=1.0, data_ms=0.0,
                                    step_count=core.steps[rank]), msg_id))


def test_a_second_copy_of_a_batch_report_is_refused_and_counts_nothing() -> None:
    core = formed()
    assert not refusals(batch(core, 0, "rank-0.g1.10"))
    before = core.state.ranks[0].batches_total
    core.steps[0] -= 1  # the very same report again
    assert refusals(batch(core, 0, "rank-0.g1.10")) == ["duplicate-id"]
    assert core.state.ranks[0].batches_total == before
    assert core.state.refusals["duplicate-id"] == 1


def test_a_second_copy_of_a_metrics_message_is_refused() -> None:
    core = formed()
    plan = core.state.ranks[1].queue[0]
    for _ in range(plan.size):
        core.batch(1)
    msg = m.MetricsMsg(rank=1, epoch=plan.epoch, avg_loss=1.0, batches_processed=plan.size,
                       epoch_ms=1.0, samples_processed=plan.size * 8)
    assert not refusals(core.feed(Metrics(msg, "rank-1.g1.99")))
    assert refusals(core.feed(Metrics(msg, "rank-1.g1.99"))) == ["duplicate-id"]


def test_late_but_unseen_sequences_pass_and_seen_ones_do_not() -> None:
    core = formed()
    s = core.state
    assert first_delivery(s, "rank-0.g1.5")
    assert first_delivery(s, "rank-0.g1.9")  # 6..8 not seen yet: holes
    assert first_delivery(s, "rank-0.g1.7")  # re-sent after a later one was stored
    assert not first_delivery(s, "rank-0.g1.7")
    assert not first_delivery(s, "rank-0.g1.9")
    assert not first_delivery(s, "rank-0.g1.5")
    assert first_delivery(s, "rank-0.g1.6")
    assert first_delivery(s, "rank-1.g1.7")  # another rank's sequence space


def test_a_new_incarnation_starts_afresh_and_an_old_one_is_left_to_fencing() -> None:
    core = formed()
    s = core.state
    assert first_delivery(s, "rank-0.g1.50")
    assert first_delivery(s, "rank-0.g2.1")
    assert not first_delivery(s, "rank-0.g2.1")
    assert first_delivery(s, "rank-0.g1.50")  # generation 1 is fenced elsewhere


def test_ids_it_cannot_read_are_never_refused() -> None:
    core = formed()
    for odd in ("", "coordinator.g1.5", "rank-x.g1.5", "rank-0.gX.5", "rank-0.g1", "junk"):
        assert first_delivery(core.state, odd)
        assert first_delivery(core.state, odd)


def test_the_window_stays_bounded() -> None:
    core = formed()
    s = core.state
    for seq in range(1, 100_000, 7):  # six of every seven sequences never arrive
        assert first_delivery(s, f"rank-0.g1.{seq}")
    assert len(s.seen_ids[0].holes) <= ID_HOLES
    high = s.seen_ids[0].high
    assert first_delivery(s, f"rank-0.g1.{high - 3}")  # a recent hole still passes
    assert not first_delivery(s, f"rank-0.g1.{high - 3}")
