"""The data path off the training thread (TrainSpec.prefetch): the batches fetched ahead
are exactly the ones training takes, in its order, whatever plans come and go; a fetch that
fails fails the batch that needed it; and bf16 autocast (TrainSpec.amp) trains in float32
parameters. A rank's batches and losses are the same with and without prefetching."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset
from worker_harness import BATCH, N, Rank, plan, spec, window

from ddpbus.codecs import messages as m
from ddpbus.worker_agent.data import Prefetcher


@dataclass
class _Plan:
    """What the prefetcher reads of a trainer's plan."""
    indices: np.ndarray[Any, np.dtype[np.int64]]
    batch_size: int
    pos: int = 0
    ahead: int = 0

    def take(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        out = self.indices[self.pos:self.pos + self.batch_size]
        self.pos += self.batch_size
        return out

    @property
    def done(self) -> bool:
        return self.pos + self.batch_size > len(self.indices)


class _Recorder:
    def __init__(self) -> None:
        self.fetched: list[list[int]] = []
        self.threads: set[str] = set()

    def __call__(self, indices: np.ndarray[Any, np.dtype[np.int64]]) -> list[int]:
        self.fetched.append(indices.tolist())
        self.threads.add(threading.current_thread().name)
        return indices.tolist()


@pytest.mark.parametrize("depth", [0, 1, 2, 5])
def test_the_batches_taken_are_the_plans_in_order_as_plans_come_and_go(depth: int) -> None:
    fetch = _Recorder()
    loader = Prefetcher(fetch, depth=depth)
    plans = [_Plan(np.arange(0, 20), 4), _Plan(np.arange(100, 111), 3)]  # 5 and 3 batches
    live = [plans[0]]
    taken: list[list[int]] = []
    try:
        while live:
            current = live[0]
            taken.append(loader.take(current))
            loader.ahead(live)
            if len(taken) == 2:
                live.append(plans[1])  # an ExtendPartition arrives mid-plan
            if current.done:
                live.pop(0)
    finally:
        loader.close()
    want = [list(range(i, i + 4)) for i in range(0, 20, 4)] + [
        list(range(i, i + 3)) for i in range(100, 109, 3)]
    assert taken == want
    if depth == 0:
        assert loader.ahead_hits == 0
        assert fetch.threads == {threading.current_thread().name}
    else:
        # the first batch is fetched at once; every later one had been fetched ahead
        assert loader.ahead_hits == len(want) - 1
        assert fetch.threads == {"ddpbus-prefetch_0"} | {threading.current_thread().name}
    # nothing was read twice, nothing outside the plans
    assert sorted(map(tuple, fetch.fetched)) == sorted(map(tuple, want))


def test_a_batch_asked_for_ahead_of_a_changed_plan_is_dropped_not_trained() -> None:
    fetch = _Recorder()
    loader = Prefetcher(fetch, depth=3)
    first, other = _Plan(np.arange(0, 8), 2), _Plan(np.arange(50, 54), 2)
    try:
        assert loader.take(first) == [0, 1]
        loader.ahead([first])  # 2..7 asked for
        # the plans were replaced (the trainer never does; the prefetcher copes anyway)
        assert loader.take(other) == [50, 51]
        assert loader.take(other) == [52, 53]
    finally:
        loader.close()


def test_a_failing_fetch_fails_the_batch_that_needed_it_in_the_training_thread() -> None:
    def fetch(indices: np.ndarray[Any, np.dtype[np.int64]]) -> list[int]:
        if indices[0] == 4:
            raise OSError("disk gone")
        return indices.tolist()

    loader = Prefetcher(fetch, depth=2)
    p = _Plan(np.arange(0, 12), 4)
    try:
        assert loader.take(p) == [0, 1, 2, 3]
        loader.ahead([p])
        with pytest.raises(OSError, match="disk gone"):
            loader.take(p)
        assert loader.take(p) == [8, 9, 10, 11]  # the next batch is still there
    finally:
        loader.close()


def test_the_default_depth_prefetches_what_reads_and_not_what_indexes_memory() -> None:
    class Disk(Dataset[Any]):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.zeros(2)

    tensors = spec().dataset
    assert isinstance(tensors, TensorDataset)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert spec().prefetch_depth(cpu, tensors) == 0
    assert spec().prefetch_depth(cuda, tensors) == 2
    assert spec().prefetch_depth(cpu, Disk()) == 2
    assert spec(prefetch=5).prefetch_depth(cpu, tensors) == 5


def _train(**kw: Any) -> tuple[list[float], list[torch.Tensor], Rank]:
    torch.manual_seed(0)  # the same initial weights each time
    rank = Rank(spec(**kw))
    rank.trainer.start()
    rank.put(window(plan(0, 0, N // 2), plan(1, 0, N // 2)))
    steps = 2 * (N // 2 // BATCH)
    rank.wait_steps(steps)
    rank.stop()
    losses = [b.batch_loss for b in rank.batches()]
    assert len(losses) == steps
    return losses, [p.detach().clone() for p in rank.trainer.model.parameters()], rank


def test_a_rank_trains_the_same_batches_with_and_without_prefetching() -> None:
    plain, params, _ = _train(prefetch=0)
    ahead, params_ahead, rank = _train(prefetch=3)
    # both plans came in one window: only the very first batch was fetched when needed
    assert rank.trainer.loader.ahead_hits == len(ahead) - 1
    assert ahead == plain
    for a, b in zip(params, params_ahead, strict=True):
        assert torch.equal(a, b)


def test_bf16_autocast_trains_with_float32_parameters() -> None:
    dtypes: list[torch.dtype] = []

    def step(model: torch.nn.Module, b: Any) -> torch.Tensor:
        out = model(b[0])
        dtypes.append(out.dtype)
        return torch.nn.functional.mse_loss(out.float(), b[1])

    plain, _, _ = _train(train_step=step, prefetch=0)
    assert set(dtypes) == {torch.float32}
    dtypes.clear()
    losses, params, rank = _train(train_step=step, amp="bf16")
    assert set(dtypes) == {torch.bfloat16}  # the forward ran in bf16
    assert all(p.dtype == torch.float32 for p in params)
    assert all(p.grad is None or p.grad.dtype == torch.float32
               for p in rank.trainer.model.parameters())
    # the same batches, in bf16's precision (8 bits of mantissa: ~1 % on these losses)
    assert losses == pytest.approx(plain, rel=0.05)
    assert losses != plain


def test_a_window_message_after_the_prefetch_still_ends_in_every_batch_once() -> None:
    """Plans queued behind the one training (StartEpoch) are read ahead too."""
    rank = Rank(spec(prefetch=2))
    rank.trainer.start()
    rank.put(window(plan(0, 0, 2 * BATCH)),
             m.StartEpoch(plan=m.EpochPlan(epoch=1, partition_offset=0,
                                           partition_size=2 * BATCH)))
    rank.wait_steps(4)
    rank.stop()
    assert [x.batches_processed for x in rank.of(m.MetricsMsg)] == [2, 2]


class _SlowSpan:
    """A GPU span that is over only once the host launched ``lag`` more batches."""

    def __init__(self, clock: _LaggingClock, ms: float) -> None:
        self.clock, self.at, self._ms = clock, clock.launched, ms
        self.waited = False

    def ready(self) -> bool:
        return self.clock.launched - self.at >= self.clock.lag

    def ms(self) -> float:
        self.waited = self.waited or not self.ready()
        return self._ms


class _LaggingClock:
    def __init__(self, lag: int) -> None:
        self.lag, self.launched = lag, 0
        self.spans: list[_SlowSpan] = []

    def begin(self) -> None:
        self.launched += 1

    def end(self, _begun: None, host_ms: float) -> _SlowSpan:
        span = _SlowSpan(self, host_ms)
        self.spans.append(span)
        return span


@pytest.mark.parametrize("lag", [1, 3])
def test_batches_whose_compute_is_still_running_are_reported_later_in_step_order(
        lag: int) -> None:
    """On CUDA a batch's report waits for its end event rather than a synchronize per
    batch (timing.py): reported a batch later, in step order, the window's last at once;
    what the coordinator hears is the same as from a rank that waited for every batch."""
    def reports(rank: Rank) -> list[tuple[int, float | None]]:
        return [(b.step_count, b.batch_loss) for b in rank.batches()]

    torch.manual_seed(0)
    plain = Rank(spec())
    plain.trainer.start()
    plain.put(window(plan(0, 0, N // 2)), m.StartEpoch(plan=m.EpochPlan(
        epoch=1, partition_offset=0, partition_size=N // 2)))
    plain.wait_steps(8)
    plain.stop()

    torch.manual_seed(0)
    lagging = Rank(spec())
    clock = _LaggingClock(lag)
    lagging.trainer.clock = clock  # type: ignore[assignment]
    lagging.trainer.start()
    lagging.put(window(plan(0, 0, N // 2)), m.StartEpoch(plan=m.EpochPlan(
        epoch=1, partition_offset=0, partition_size=N // 2)))
    lagging.wait_steps(8)
    lagging.stop()
    assert reports(lagging) == reports(plain)
    assert [b.step_count for b in lagging.batches()] == list(range(1, 9))
    assert [(x.epoch, x.batches_processed, x.avg_loss) for x in lagging.of(m.MetricsMsg)] == [
        (x.epoch, x.batches_processed, x.avg_loss) for x in plain.of(m.MetricsMsg)]
    # a span still running was read without waiting only where it had to be: a plan's
    # last batch (its metrics follow) and at most IN_FLIGHT behind the newest
    waited = [i + 1 for i, s in enumerate(clock.spans) if s.waited]
    if lag == 1:
        assert waited == [4, 8]  # each plan's last batch
    else:
        assert 1 in waited  # IN_FLIGHT: the oldest is read once a second one is launched
        assert {4, 8} <= set(waited)

