"""A rank's resource sample (MetricsMsg.resources): its CPU over the interval, its resident
memory against the machine's, and no GPU fields off the GPU."""

from __future__ import annotations

import time

from ddpbus.worker_agent.resources import ResourceProbe


def test_a_cpu_ranks_sample_measures_the_interval() -> None:
    now = [0.0]
    probe = ResourceProbe("cpu", clock=lambda: now[0])
    spent = time.process_time()
    while time.process_time() - spent < 0.05:  # work for the interval to measure
        sum(range(1000))
    burned = time.process_time() - spent
    now[0] = 2 * burned  # half of the wall time busy
    sample = probe.sample()
    assert 40.0 <= sample.cpu_percent <= 60.0, sample
    assert 0 < sample.ram_used_bytes < sample.ram_total_bytes
    assert (sample.gpu_util_percent, sample.vram_total_bytes,
            sample.vram_allocated_bytes) == (None, None, None)
    now[0] += 10.0  # an idle interval next
    assert probe.sample().cpu_percent < 5.0
