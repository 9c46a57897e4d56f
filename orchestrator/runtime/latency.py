"""The coordinator's latency statistics, for its run summary and ``bench/control_latency``.

Milliseconds, the newest :data:`SAMPLES` of each (bounded for weeks-long runs):

- *intake*: a stream message's store time (the broker's clock) to its handling;
- *decision*: the same start to the publish of the commands it led to (after the
  write-ahead record that covers them);
- *training decision*: the same, for inputs decided while training, leaving out the
  admission burst at the start (every rank's Hello waits behind the coordinator's own
  start there).
"""

from __future__ import annotations

from collections import deque

import numpy

SAMPLES = 200_000


def percentiles(samples: deque[float]) -> dict[str, float | int]:
    if not samples:
        return {"count": 0}
    p50, p99, top = numpy.percentile(numpy.fromiter(samples, float), [50, 99, 100])
    return {"count": len(samples), "p50": round(float(p50), 3),
            "p99": round(float(p99), 3), "max": round(float(top), 3)}


class Latency:
    def __init__(self, samples: int = SAMPLES) -> None:
        self.intake_ms: deque[float] = deque(maxlen=samples)
        self.decision_ms: deque[float] = deque(maxlen=samples)
        self.training_decision_ms: deque[float] = deque(maxlen=samples)

    def took_in(self, stored_at: float, now: float) -> None:
        """A stream message stored at ``stored_at`` (wall clock) is handled ``now``."""
        self.intake_ms.append((now - stored_at) * 1000.0)

    def published(self, started: list[tuple[float, bool]], now: float) -> None:
        """Commands published ``now``, decided on inputs stored at each ``started`` time
        (and whether the run was training then)."""
        for t, training in started:
            ms = (now - t) * 1000.0
            self.decision_ms.append(ms)
            if training:
                self.training_decision_ms.append(ms)

    def report(self) -> dict[str, dict[str, float | int]]:
        """The summary's three entries."""
        return {"intake_latency_ms": percentiles(self.intake_ms),
                "decision_latency_ms": percentiles(self.decision_ms),
                "training_decision_latency_ms": percentiles(self.training_decision_ms)}
