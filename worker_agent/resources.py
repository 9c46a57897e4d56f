"""What a rank's machine spends on it, for ``MetricsMsg.resources``: this process's CPU
(its own CPU time over wall time since the last sample, 100 = one core busy) and resident
memory against the machine's, and, on a CUDA device, the memory torch holds there and the
GPU's utilisation through NVML (torch.cuda.utilization, when nvidia-ml-py is installed;
left out otherwise). Only the standard library off the GPU: no psutil."""

from __future__ import annotations

import logging
import os
import resource
import sys
import time
from typing import Any

from ddpbus.codecs import messages as m

log = logging.getLogger(__name__)


def _rss_bytes() -> int:
    """Resident memory now (Linux: /proc/self/statm); elsewhere the peak, which is what
    getrusage offers."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes vs KiB


def _ram_total_bytes() -> int:
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError):
        return 0


class ResourceProbe:
    """One rank's sampler; ``device`` is its torch device ("cpu", "cuda:1")."""

    def __init__(self, device: Any, clock: Any = time.monotonic) -> None:
        self.device = device
        self.clock = clock
        self._cpu = time.process_time()
        self._at = clock()
        self._ram_total = _ram_total_bytes()
        self._nvml = True  # until torch says NVML is not there

    def sample(self) -> m.ResourceSample:
        cpu, now = time.process_time(), self.clock()
        wall = now - self._at
        percent = 100.0 * (cpu - self._cpu) / wall if wall > 0 else 0.0
        self._cpu, self._at = cpu, now
        gpu = self._gpu()
        return m.ResourceSample(cpu_percent=max(0.0, percent), ram_used_bytes=_rss_bytes(),
                                ram_total_bytes=self._ram_total, **gpu)

    def _gpu(self) -> dict[str, Any]:
        if getattr(self.device, "type", str(self.device).split(":")[0]) != "cuda":
            return {}
        import torch

        out: dict[str, Any] = {
            "vram_allocated_bytes": int(torch.cuda.memory_allocated(self.device)),
            "vram_total_bytes": int(torch.cuda.get_device_properties(self.device).total_memory)}
        if self._nvml:
            try:
                out["gpu_util_percent"] = float(torch.cuda.utilization(self.device))
            except Exception as exc:  # no nvidia-ml-py, or NVML refused: leave it out
                self._nvml = False
                log.info("GPU utilisation not reported (NVML: %s: %s)", type(exc).__name__,
                         exc)
        return out
