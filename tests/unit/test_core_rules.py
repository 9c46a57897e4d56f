"""The coordinator core's rules through ``transition()``: admission, sessions, the gate."""

from __future__ import annotations

from core_harness import (
    UID,
    Core,
    accepted,
    formed,
    hello,
    records,
    refusals,
    rejected,
    sends,
)

from ddpbus.codecs import messages as m
from ddpbus.orchestrator.core.state import Admit, Joined, Phase, Stop, Tick, Timing

# ------------------------------------------------------------------ admission


def test_matching_hellos_are_admitted_and_form() -> None:
    core = Core()
    out = core.admit_all()
    assert sum(isinstance(c, Admit) and isinstance(c.msg, m.Accept) for c in out) == 2
    assert core.state.phase is Phase.FORMING


def test_reject_world_size_mismatch() -> None:
    core = Core()
    out = core.feed(Joined(hello(0, world=3)))
    assert rejected(out)
    assert "world size" in rejected(out)[0]
    assert not accepted(out)
    assert not core.state.ranks[0].alive


def test_reject_rank_outside_world() -> None:
    core = Core()
    assert rejected(core.feed(Joined(hello(5))))


def test_reject_model_signature_mismatch() -> None:
    core = Core()
    core.join(0)
    out = core.join(1, sig=b"\x33" * m.MODEL_SIGNATURE_BYTES)
    assert "model signature" in rejected(out)[0]
    assert not core.state.ranks[1].alive


def test_reject_dataset_smaller_than_a_batch() -> None:
    core = Core()
    assert "fewer than one batch" in rejected(core.join(0, dataset=4))[0]


def test_reject_dataset_size_mismatch() -> None:
    core = Core()
    core.join(0)
    assert "dataset" in rejected(core.join(1, dataset=320))[0]


def test_reject_nccl_backend_without_cuda() -> None:
    core = Core(backend="nccl")
    assert "needs CUDA" in rejected(core.join(0, backend="gloo", device="cpu"))[0]


def test_reject_mixed_cohort_under_auto_backend() -> None:
    core = Core()
    assert accepted(core.join(0, backend="nccl", device="cuda:0"))
    assert "auto" in rejected(core.join(1, backend="gloo", device="cpu"))[0]


def test_duplicate_hello_is_refused_without_state_change() -> None:
    core = Core()
    core.join(0)
    before = (repr(core.state.ranks), core.state.phase, core.state.model_signature,
              core.state.dataset_size)
    out = core.join(0)
    assert refusals(out) == ["duplicate-hello"]
    assert not any(isinstance(c, Admit) for c in out)
    assert (repr(core.state.ranks), core.state.phase, core.state.model_signature,
            core.state.dataset_size) == before


def test_stale_generation_is_rejected() -> None:
    core = Core()
    core.join(0, generation=2)
    assert "stale" in rejected(core.join(0, generation=1))[0]
    hello_now = core.state.ranks[0].hello
    assert hello_now is not None
    assert hello_now.generation == 2


def test_rejoin_of_a_live_rank_replaces_its_old_incarnation() -> None:
    core = Core()
    core.form()
    out = core.feed(Joined(m.Rejoin(hello=hello(0, generation=2), resume_stream_seq=7)))
    assert accepted(out)
    assert [f["rank"] for f in records(out, "rank-dead")] == [0]
    assert [s.msg.rank for s in sends(out, m.DeclareDead)] == [0]
    hello_now = core.state.ranks[0].hello
    assert hello_now is not None
    assert hello_now.generation == 2
    assert core.state.ranks[0].alive
    assert core.state.ranks[0].fresh


def test_rejoin_with_another_model_is_rejected_and_changes_nothing() -> None:
    core = Core()
    core.form()
    out = core.join(1, generation=2, sig=b"\x33" * m.MODEL_SIGNATURE_BYTES)
    assert "model signature" in rejected(out)[0]
    assert not records(out, "rank-dead")
    hello_now = core.state.ranks[1].hello
    assert hello_now is not None
    assert hello_now.generation == 1


def test_join_after_the_run_ended_is_rejected() -> None:
    core = Core()
    core.form()
    core.feed(Stop())
    assert "draining" in rejected(core.join(1, generation=2))[0]


# ---------------------------------------------------------------- rendezvous


def test_new_id_request_goes_to_rank_zero_first() -> None:
    out = Core().admit_all()
    requests = sends(out, m.RequestNewNcclId)
    assert [s.rank for s in requests] == [0]


def test_new_id_from_non_generator_is_refused_and_changes_nothing() -> None:
    core = Core()
    core.admit_all()
    out = core.feed(Timing(m.NewNcclIdGenerated(rank=1, uid_bytes=UID)))
    assert refusals(out) == ["not-generator"]
    assert not sends(out, m.NewNcclSession)
    assert core.state.phase is Phase.FORMING
    assert core.state.rendezvous is not None
    assert core.state.rendezvous.generator == 0


def test_new_id_sends_every_member_its_session() -> None:
    out = Core().form()
    sessions = sends(out, m.NewNcclSession)
    assert [(s.rank, s.msg.new_rank, s.msg.new_world_size, s.msg.uid_bytes)
            for s in sessions] == [(0, 0, 2, UID), (1, 1, 2, UID)]
    assert records(out, "training-started")


def test_generator_timeout_moves_to_next_candidate() -> None:
    core = Core()
    core.admit_all()
    assert not sends(core.feed(Tick(), at=4.9), m.RequestNewNcclId)
    out = core.feed(Tick(), at=5.0)
    assert [s.rank for s in sends(out, m.RequestNewNcclId)] == [1]
    assert records(out, "session-generator-timeout") == [{"generator": 0, "next": 1}]
    assert refusals(core.feed(Timing(m.NewNcclIdGenerated(rank=0, uid_bytes=UID)))) == [
        "not-generator"]
    out = core.feed(Timing(m.NewNcclIdGenerated(rank=1, uid_bytes=UID)))
    assert len(sends(out, m.NewNcclSession)) == 2
    assert core.state.phase is Phase.TRAINING


def test_generator_exhaustion_ends_with_shutdown_with_save() -> None:
    core = Core()
    core.admit_all()
    core.feed(Tick(), at=5.0)
    out = core.feed(Tick(), at=10.0)
    assert len(sends(out, m.ShutdownWithSave)) == 1
    assert core.state.phase in (Phase.DRAINING, Phase.DONE)
    assert not sends(out, m.RequestNewNcclId)


def test_formation_timeout_shuts_down() -> None:
    core = Core()
    core.join(0)
    assert not sends(core.feed(Tick(), at=299.0), m.Shutdown)
    out = core.feed(Tick(), at=301.0)
    assert len(sends(out, m.Shutdown)) == 1
    assert records(out, "formation-timeout") == [{"joined": 1}]


# --------------------------------------------------------------- first window


def test_first_window_broadcasts_global_step_with_every_ranks_plans() -> None:
    """One control.all message opens the window: the budgets and each rank's plans (not a
    StartEpoch per rank: at a thousand ranks that is a thousand publishes a window)."""
    out = Core().form()
    [opened] = sends(out, m.SetGlobalStep)
    assert opened.rank is None  # control.all
    assert opened.msg == m.SetGlobalStep(global_step=0, step_budget=(10, 10), plans=(
        m.RankPlan(rank=0, plan=m.EpochPlan(epoch=0, partition_offset=0, partition_size=80)),
        m.RankPlan(rank=1, plan=m.EpochPlan(epoch=0, partition_offset=80,
                                            partition_size=80))))
    assert not sends(out, m.StartEpoch)


# ----------------------------------------------------------------------- gate


def test_no_sync_before_every_rank_reached_its_target() -> None:
    core = formed()
    assert not sends(core.train(0, 10), m.SyncNow)
    assert not sends(core.train(1, 9), m.SyncNow)
    assert len(sends(core.train(1, 1), m.SyncNow)) == 1


def _one_epoch(world: int) -> Core:
    """Formed, one epoch of 10 batches a rank."""
    core = Core(world=world, epochs=1)
    for r in range(world):
        core.join(r, dataset=80 * world)
    core.feed(Timing(m.NewNcclIdGenerated(rank=0, uid_bytes=UID)))
    return core


def test_the_gate_waits_for_batches_and_the_aggregate_for_metrics() -> None:
    """A rank sends the metrics of the plan its closing batch finished after its SyncAck
    (reports.py): the gate fires on the batches; EpochAggregated and Shutdown wait for the
    last plan's metrics."""
    core = _one_epoch(2)
    core.train(0, 10, metrics=False)
    assert len(sends(core.train(1, 10, metrics=False), m.SyncNow)) == 1
    out = core.ack(0) + core.ack(1) + core.metrics(0, 0, 10)
    assert not sends(out, m.EpochAggregated)
    assert not sends(out, m.Shutdown)
    out = core.metrics(1, 0, 10)
    assert not refusals(out)
    assert [s.msg.metrics.epoch for s in sends(out, m.EpochAggregated)] == [0]
    assert len(sends(out, m.Shutdown)) == 1


def test_a_rank_lost_before_its_metrics_leaves_the_epoch_aggregated_without_them() -> None:
    core = _one_epoch(3)
    for r in range(3):
        core.train(r, 10, metrics=False)
    for r in range(3):
        core.ack(r)
    out = core.exiting(2)  # trained, averaged, gone before its held metrics went out
    assert records(out, "metrics-lost") == [{"rank": 2, "epoch": 0, "batches": 10}]
    out = core.metrics(0, 0, 10) + core.metrics(1, 0, 10)
    (aggregated,) = sends(out, m.EpochAggregated)
    assert aggregated.msg.metrics.per_rank_batch_share[2] == 0.0
    assert len(sends(out, m.Shutdown)) == 1


def test_a_rank_lost_outside_the_consensus_loses_no_metrics_its_heirs_retrain() -> None:
    """Its last average failed: its batches are not in the consensus and go to the
    survivors, whose metrics will cover them; nothing is recorded as lost."""
    core = _one_epoch(3)
    for r in range(3):
        core.train(r, 10, metrics=False)
    out = core.exiting(2)
    for r in (0, 1):
        out += core.feed(Timing(m.SyncAck(rank=r, step_count=core.state.ranks[r].sync_step,
                                          divergence=0.0, failed=True)))
    assert records(out, "work-reassigned")
    assert len(sends(out, m.ExtendPartition)) == 2
    assert not records(out, "metrics-lost")


def test_no_sync_while_a_rank_has_not_acked_the_previous_one() -> None:
    core = formed()
    core.train(0, 10)
    core.train(1, 10)
    core.ack(0)
    assert not sends(core.train(0, 10) + core.train(1, 10), m.SyncNow)
    assert len(sends(core.ack(1), m.SyncNow)) == 1


def test_acks_alone_never_trigger_an_empty_reduce() -> None:
    core = formed()
    core.train(0, 10)
    core.train(1, 10)
    assert not sends(core.ack(0) + core.ack(1), m.SyncNow)
    assert core.state.rounds == 1


def test_sync_ack_never_counts_as_a_batch() -> None:
    core = formed()
    core.train(0, 10)
    core.train(1, 10)
    assert core.state.global_step == 20
    core.ack(0)
    core.ack(1)
    assert core.state.global_step == 20
    assert [r.steps for r in core.state.ranks] == [0, 0]
    assert [r.batches_total for r in core.state.ranks] == [10, 10]


def test_batches_carried_back_to_the_average_take_their_timing_with_them() -> None:
    core = formed(policy="async", epochs=3)
    r0, r1 = core.state.ranks
    core.train(0, r0.budget, ms=1.0)  # its target and its lookahead
    assert sends(core.train(1, r1.target, ms=2.5), m.SyncNow)
    averaged_at = r0.sync_step
    core.train(0, 1, ms=7.0)  # trained before the collective, reported after SyncNow
    core.train(0, 1, ms=3.0)  # trained after it
    core.feed(Timing(m.SyncAck(rank=0, step_count=averaged_at + 1, divergence=0.01)))
    assert (r0.window_start, r0.steps) == (averaged_at + 1, 1)
    assert r0.fill_ms == 3.0  # the window's first batch is the one after the collective
    assert r0.compute_ms == 3.0
    assert (r0.delivered_ms, r0.delivered_batches) == (0.0, 0)
    core.train(0, 1, ms=1.0)
    assert (r0.delivered_ms, r0.delivered_batches) == (1.0, 1)


def test_global_step_grows_by_sum_of_steps_and_is_broadcast() -> None:
    core = formed()
    core.train(0, 10, ms=2.0)
    out = core.train(1, 10, ms=5.0)
    opened = sends(out, m.SetGlobalStep)[0].msg
    assert (opened.global_step, opened.step_budget) == (20, (25, 10))
    core.ack(0)
    core.ack(1)
    core.train(0, 25, ms=2.0)
    out = core.train(1, 10, ms=5.0)
    assert sends(out, m.SetGlobalStep)[0].msg.global_step == 55
    assert records(out, "average")[0]["steps"] == {0: 25, 1: 10}


def test_sync_policy_budget_one_every_window_and_no_growth() -> None:
    core = Core(policy="sync")
    out = core.form()
    budgets = [s.msg.step_budget for s in sends(out, m.SetGlobalStep)]
    assert not sends(core.train(0, 1), m.SyncNow)
    for window in range(6):
        out = core.train(1, 1)
        assert len(sends(out, m.SyncNow)) == 1
        budgets += [s.msg.step_budget for s in sends(out, m.SetGlobalStep)]
        core.now += 1.0  # a slow reduce: overhead far above the target
        core.ack(0)
        core.ack(1)
        if window < 5:
            core.train(0, 1)
    assert budgets == [(1, 1)] * 7
    assert core.state.elche.anchor == 1
    assert not core.state.elche.growth
    assert core.state.global_step == 12


# ------------------------------------------------------------------ refusals


def test_batch_with_no_plan_is_refused() -> None:
    core = formed()
    core.train(0, 10)
    out = core.batch(0)
    assert refusals(out) == ["batch-without-plan"]
    assert core.state.ranks[0].steps == 10
    assert core.state.refusals["batch-without-plan"] == 1


def test_batch_before_training_is_refused() -> None:
    core = Core()
    core.join(0)
    assert refusals(core.batch(0)) == ["batch-outside-training"]


def test_metrics_without_a_finished_plan_are_refused() -> None:
    core = formed()
    core.train(0, 5)
    assert refusals(core.metrics(0, 0, 7)) == ["metrics-without-plan"]  # not the plan's size
    assert refusals(core.metrics(0, 1, 10)) == ["metrics-without-plan"]  # another epoch
    assert core.state.ranks[0].queue[0].metrics is None
    assert core.state.ranks[0].steps == 5


def test_stale_batch_report_is_refused() -> None:
    core = formed()
    core.train(0, 3)
    out = core.feed(Timing(m.Batch(rank=0, batch_ms=1.0, data_ms=0.0, step_count=2)))
    assert refusals(out) == ["stale-batch"]
    assert core.state.ranks[0].steps == 3


def test_lost_batch_reports_are_credited_by_step_count() -> None:
    core = formed()
    core.train(0, 2)
    out = core.feed(Timing(m.Batch(rank=0, batch_ms=1.0, data_ms=0.0, step_count=5)))
    assert records(out, "batch-reports-missing") == [{"rank": 0, "batches": 2}]
    assert core.state.ranks[0].steps == 5


def test_unexpected_sync_ack_is_refused() -> None:
    core = formed()
    assert refusals(core.ack(0)) == ["unexpected-ack"]


def test_timing_from_unknown_rank_is_refused() -> None:
    core = formed()
    out = core.feed(Timing(m.Heartbeat(rank=7, step_count=0)))
    assert refusals(out) == ["unknown-rank"]
