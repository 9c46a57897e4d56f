"""A CUDA rank's resource sample (skipped without CUDA): torch's allocated and the device's
total memory, and NVML's utilisation where nvidia-ml-py is installed."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ddpbus.worker_agent.resources import ResourceProbe

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_a_cuda_ranks_sample_has_its_device_memory() -> None:
    device = torch.device("cuda:0")
    held = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)  # 64 MiB
    sample = ResourceProbe(device).sample()
    assert sample.vram_allocated_bytes is not None
    assert sample.vram_allocated_bytes >= held.numel()
    assert sample.vram_total_bytes is not None
    assert sample.vram_total_bytes > sample.vram_allocated_bytes
    if importlib.util.find_spec("pynvml") is not None:
        assert sample.gpu_util_percent is not None
        assert 0.0 <= sample.gpu_util_percent <= 100.0
    else:
        assert sample.gpu_util_percent is None
