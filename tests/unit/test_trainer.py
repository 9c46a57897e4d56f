"""The training thread of one rank, driven through its inbox: epochs, the data clock and
the plans it refuses."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
import torch.distributed as dist
from worker_harness import BATCH, N, Rank, plan, run_config, spec, window

from ddpbus.codecs import messages as m
from ddpbus.worker_agent.spec import WorkerContext


def test_an_older_epochs_reassigned_work_does_not_enter_that_epoch_again() -> None:
    """Async lookahead queues epoch 1 before a dead peer's epoch-0 work arrives
    (ExtendPartition of epoch 0): epoch_fn runs once per epoch, while the reassigned
    batches are trained, seen by train_step (ctx.epoch) and reported as epoch 0's."""
    calls: list[int] = []
    seen: list[int] = []

    def epoch_fn(epoch: int, _ctx: WorkerContext) -> None:
        calls.append(epoch)

    def train_step(model: Any, b: Any) -> Any:
        seen.append(rank.trainer.ctx.epoch)
        return ((model(b[0]) - b[1]) ** 2).mean()

    rank = Rank(spec(epoch_fn=epoch_fn, train_step=train_step))
    rank.put(m.SetEpochCallbackRole(rank=0),
             window(plan(0, 0, 2 * BATCH), plan(1, 0, 2 * BATCH)),
             m.ExtendPartition(epoch=0, partition_offset=2 * BATCH, partition_size=BATCH),
             m.StartEpoch(plan=m.EpochPlan(epoch=1, partition_offset=2 * BATCH,
                                           partition_size=BATCH)))
    rank.trainer.start()  # the four are queued before the first batch
    rank.wait_steps(6)
    rank.stop()
    assert calls == [0, 1]
    assert [x.epoch for x in rank.of(m.EpochFnElapsed)] == [0, 1]
    assert seen == [0, 0, 1, 1, 0, 1]  # each batch's own epoch
    assert rank.trainer.epoch == 1  # the newest entered
    # each plan's metrics under its own epoch, in plan order
    assert [(x.epoch, x.batches_processed) for x in rank.of(m.MetricsMsg)] == [
        (0, 2), (1, 2), (0, 1), (1, 1)]


def test_waiting_for_a_plan_inside_a_window_is_not_data_time() -> None:
    """A rank that ran out of plans in an open window waits for the next one (StartEpoch,
    ExtendPartition); that wait is the coordinator's, not this rank's data loading."""
    idle = 0.4
    rank = Rank()
    rank.trainer.start()
    rank.put(window(plan(0, 0, BATCH)))
    rank.wait_steps(1)
    time.sleep(idle)  # the idle time under test, not a wait for something
    rank.put(m.ExtendPartition(epoch=0, partition_offset=BATCH, partition_size=BATCH))
    rank.wait_steps(2)
    time.sleep(idle)  # again: the rank idles in its window
    rank.put(m.StartEpoch(plan=m.EpochPlan(epoch=0, partition_offset=2 * BATCH,
                                           partition_size=BATCH)))
    rank.wait_steps(3)
    rank.stop()
    batches = rank.batches()
    assert [b.step_count for b in batches] == [1, 2, 3]
    assert all(b.data_ms < idle * 1000.0 / 2 for b in batches), [b.data_ms for b in batches]
    metrics = rank.of(m.MetricsMsg)
    assert all(x.data_starve_ms < idle * 1000.0 / 2 for x in metrics)


@pytest.mark.parametrize("bad", [
    m.StartEpoch(plan=m.EpochPlan(epoch=0, partition_offset=N - BATCH,
                                  partition_size=2 * BATCH)),  # runs past the end
    m.StartEpoch(plan=m.EpochPlan(epoch=0, partition_offset=0, partition_size=0)),
    m.ExtendPartition(epoch=0, partition_offset=N, partition_size=BATCH),  # beyond it
    m.ExtendPartition(epoch=0, partition_offset=-BATCH, partition_size=BATCH),
    window(plan(0, 2 * N, BATCH)),  # a window's plan
], ids=["past-the-end", "empty", "extend-beyond", "negative-offset", "window-plan"])
def test_a_plan_outside_the_dataset_is_refused_counted_and_not_trained(bad: m.ControlMsg
                                                                        ) -> None:
    rank = Rank()
    rank.put(window(), bad, window(plan(0, 0, BATCH), plan(0, BATCH, BATCH)))
    rank.trainer.start()
    # both good plans trained: plans train in order, so a bad one taken would come first
    rank.wait_steps(2)
    rank.stop()
    assert [b.step_count for b in rank.batches()] == [1, 2]
    assert [(x.epoch, x.batches_processed) for x in rank.of(m.MetricsMsg)] == [(0, 1),
                                                                               (0, 1)]
    assert all(math.isfinite(x.avg_loss) for x in rank.of(m.MetricsMsg))
    assert rank.refused == ["plan-out-of-range"]


def test_a_plan_that_ends_the_dataset_with_a_short_batch_is_trained() -> None:
    """Legal plans are untouched: one ending exactly at the dataset's last sample, and one
    shorter than a batch (a partial last batch)."""
    rank = Rank()
    rank.put(window(plan(0, N - 2 * BATCH, 2 * BATCH), plan(1, N - BATCH // 2, BATCH // 2)))
    rank.trainer.start()
    rank.wait_steps(3)
    rank.stop()
    assert rank.refused == []
    assert [(x.epoch, x.batches_processed) for x in rank.of(m.MetricsMsg)] == [(0, 2), (1, 1)]


def test_a_rank_whose_average_failed_saves_and_scores_nothing_until_the_next_one(
        tmp_path: Any) -> None:
    """The collective closing an epoch failed on this rank (a peer died in it): its
    parameters are its own. The eval, checkpoint and bundle queued behind that SyncNow are
    refused, not run on them (a bundle would claim the epoch over parameters no average
    made); the next average that succeeds lifts that."""
    evals: list[float] = []
    checkpoints: list[int] = []
    bundles: list[int] = []

    def eval_fn(model: Any, _data: Any) -> float:
        evals.append(1.0)
        return 0.5

    rank = Rank(spec(eval_fn=eval_fn, eval_dataset=[0],
                     checkpoint_fn=lambda version, _model: checkpoints.append(version)),
                out_dir=tmp_path, bundle_sink=lambda version, _b, _meta: bundles.append(version))
    rank.trainer.configure(run_config(backend=m.Backend.GLOO), world_size=2)
    closing = (m.ExecuteEvalCallback(schedule_id=1, epoch=0, target_rank=0),
               m.Checkpoint(version=1, target_rank=0),
               m.SaveConsensusModel(target_rank=0, version=1, bundle_meta='{"epoch": 1}'))
    rank.put(window(plan(0, 0, BATCH)))
    rank.trainer.start()
    rank.wait_steps(1)
    rank.put(m.SyncNow(), *closing)  # no communicator session: the collective fails
    rank.wait_for(lambda: len(rank.of(m.CheckpointResult)) == 1)
    assert [a.failed for a in rank.of(m.SyncAck)] == [True]
    [result] = rank.of(m.EvalResult)
    assert result.error is not None
    assert "latest average failed" in result.error
    assert "latest average failed" in (rank.of(m.CheckpointResult)[0].error or "")
    assert (evals, checkpoints, bundles) == ([], [], [])
    assert not (tmp_path / "consensus.safetensors").exists()
    # a session of one and an average that succeeds: the same requests are carried out
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        rank.trainer.group_ready = True
        rank.put(m.SyncNow(), *closing)
        rank.wait_for(lambda: len(rank.of(m.CheckpointResult)) == 2)
    finally:
        rank.stop()  # its exit leaves the group
        if dist.is_initialized():
            dist.destroy_process_group()
    assert [a.failed for a in rank.of(m.SyncAck)] == [True, False]
    assert rank.of(m.EvalResult)[-1].error is None
    assert (evals, checkpoints, bundles) == ([1.0], [1], [1])
    assert (tmp_path / "consensus.safetensors").exists()


def test_a_throttled_rank_trains_nothing_more_in_its_open_window() -> None:
    """Throttle (max_batch_diff): the rank stops in an open window with work left (until the
    average that closes it). EvalBroadcast after it marks when the inbox was read."""
    rank = Rank()
    rank.put(window(plan(0, 0, 6 * BATCH)), m.Throttle(), m.EvalBroadcast(epoch=0, metric=1.0))
    rank.trainer.start()
    rank.wait_for(lambda: rank.trainer.ctx.last_eval is not None)
    assert rank.trainer.throttled
    assert rank.batches() == []  # the window is open and the plan unfinished
    rank.stop()


def test_epoch_aggregated_and_eval_broadcast_reach_the_users_code() -> None:
    """EpochAggregated becomes ctx.latest_metrics, EvalBroadcast ctx.poll_eval() (once)."""
    seen: list[tuple[Any, Any]] = []

    def train_step(model: Any, b: Any) -> Any:
        ctx = rank.trainer.ctx
        seen.append((ctx.latest_metrics, ctx.poll_eval()))
        return ((model(b[0]) - b[1]) ** 2).mean()

    aggregated = m.EpochMetrics(epoch=4, avg_loss=0.25, epoch_ms=10.0,
                                per_rank_loss=(0.2, 0.3))
    rank = Rank(spec(train_step=train_step))
    rank.put(m.EpochAggregated(metrics=aggregated), m.EvalBroadcast(epoch=4, metric=0.97),
             window(plan(0, 0, 2 * BATCH)))
    rank.trainer.start()
    rank.wait_steps(2)
    rank.stop()
    assert seen == [(aggregated, (4, 0.97)), (aggregated, None)]


def test_a_stage_advisory_reaches_a_dataset_that_can_read_ahead() -> None:
    """StageAdvisory: a dataset with stage(indices) hears the advised spans' samples in
    walk order (own first), from the stager's thread; one without keeps training as is."""
    import numpy as np
    import torch
    from torch.utils.data import TensorDataset

    from ddpbus.worker_agent.data import plan_indices

    class Staging(TensorDataset):
        def __init__(self, *tensors: torch.Tensor) -> None:
            super().__init__(*tensors)
            self.asked: list[list[int]] = []

        def stage(self, indices: np.ndarray) -> None:  # type: ignore[type-arg]
            self.asked.append(indices.tolist())

    base = spec().dataset
    data = Staging(*base.tensors)
    rank = Rank(spec(dataset=data))
    advisory = m.StageAdvisory(counts=(2, 3), segments=(
        m.Segment(epoch=1, spans=(m.Span(offset=0, size=BATCH),)),
        m.Segment(epoch=1, spans=(m.Span(offset=BATCH, size=2 * BATCH),))))
    rank.put(advisory, window(plan(0, 0, BATCH)))
    rank.trainer.start()
    rank.wait_steps(1)
    rank.stop()
    rank.trainer.stager.join(30)
    seed = run_config().seed
    want = (plan_indices(N, seed, 1, 0, BATCH).tolist()
            + plan_indices(N, seed, 1, BATCH, 2 * BATCH).tolist())
    assert data.asked == [want]
    assert rank.trainer.stager.latest == advisory
    assert rank.trainer.stager.staged == 3 * BATCH


def test_nccl_error_handling_aborts_the_communicator_and_keeps_the_process(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from ddpbus.worker_agent import trainer
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    assert trainer.nccl_error_handling() == "2"
    assert not caplog.records
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # an operator's choice stays
    assert trainer.nccl_error_handling() == "3"
    assert "ends this process" in caplog.text
