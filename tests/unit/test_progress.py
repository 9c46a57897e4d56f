"""The live display: per-rank rate with coalesced reports (bursts that share a stamp), the
bar of a resumed run."""

from __future__ import annotations

import pytest

from ddpbus.codecs import messages as m
from ddpbus.orchestrator.tools.progress import RunMonitor


def _reports(step: int, n: int) -> m.Reports:
    return m.Reports(rank=0, items=tuple(m.Batch(rank=0, batch_ms=1.0, data_ms=0.0,
                                                 step_count=step + i) for i in range(n)))


def test_bursts_of_coalesced_reports_read_as_the_rate_they_carry() -> None:
    mon = RunMonitor("j", b"k" * 32, 1)
    now = 0.0
    for k in range(50):  # 100 batches a second, 10 to a Reports every 0.1 s, for 5 s
        now = 0.1 * (k + 1)
        mon.observe(_reports(10 * k + 1, 10), now)
    view = mon.ranks[0]
    assert view.batches == 500
    assert view.rate(now) == pytest.approx(100.0, rel=0.05)


def test_a_first_burst_is_not_an_infinite_rate() -> None:
    mon = RunMonitor("j", b"k" * 32, 1)
    mon.observe(_reports(1, 30), 7.0)
    assert mon.ranks[0].rate(7.0) <= 60.0
    mon.observe(m.Batch(rank=0, batch_ms=1.0, data_ms=0.0, step_count=31), 7.25)
    assert mon.ranks[0].batches == 31


def test_a_resumed_runs_bar_counts_only_the_epochs_it_trains() -> None:
    monitor = RunMonitor("job", b"k" * 32, workers=2)
    monitor.observe(m.Accept(rank=0, generation=1, world_size=2, coordinator_generation=1,
                             run=m.RunConfig(
        policy=m.Policy.CADENCE, backend=m.Backend.GLOO, batch_size=10, epochs=5, seed=1,
        gamma=1.0, lr_scale_ratio=1.0, dataset_size=100)), 0.0)
    assert monitor.total_batches() == 50  # nothing planned yet: the whole run
    monitor.observe(m.SetGlobalStep(global_step=30, plans=(
        m.RankPlan(rank=0, plan=m.EpochPlan(epoch=3, partition_offset=0, partition_size=50)),
        m.RankPlan(rank=1, plan=m.EpochPlan(epoch=3, partition_offset=50,
                                            partition_size=50)))), 0.0)
    assert monitor.total_batches() == 20  # epochs 3 and 4
    monitor.observe(m.StartEpoch(plan=m.EpochPlan(epoch=4, partition_offset=0,
                                                  partition_size=50)), 0.0)
    assert (monitor.first_epoch, monitor.epoch, monitor.total_batches()) == (3, 4, 20)
