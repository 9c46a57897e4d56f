"""When the coordinator's cycle collector makes its full passes.

CPython runs a full collection (generation 2) when enough allocations have piled up. At
1,024 ranks that is every few seconds, it holds the event loop ~10 ms (more as the state
grows), and it lands most often on the allocation-heaviest moment there is: the gate's own
decision, which builds a window's plans for every rank while the last closing reports wait
behind it. So the coordinator process takes full passes off the allocation trigger
(:func:`take_full_passes`, at its start) and makes them itself (:class:`Collector`), and
so does ``ddpbus simulate`` (one process standing for a whole cohort):

- at a quiet moment, once an average is over (every rank's SyncAck read; the ranks train,
  the next gate is a window away: the moment a full snapshot is written too; the
  simulator's: once its SyncAcks are on the wire), at most once every :data:`EVERY_S`;
- on a tick once :data:`OVERDUE_S` passed without one, whatever is happening (a job that
  opens no window still collects its cycles).

The young generations stay automatic: their passes see only recent objects and take
microseconds. Objects without cycles are freed by reference counting at once, as always;
only cyclic garbage waits for the next full pass, at most :data:`OVERDUE_S` of it.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Final

EVERY_S: Final = 2.0  # at quiet moments, at most this often
OVERDUE_S: Final = 30.0  # and on a tick once this long passed without a full pass
# generation 2's threshold counts generation-1 passes (one per ~7,000 allocations): this
# many is never reached, so no allocation starts a full pass
NEVER: Final = 1 << 30


def take_full_passes() -> None:
    """No full collection starts on its own in this process from now on (the young
    generations keep their thresholds): a :class:`Collector` runs them."""
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, NEVER)


class Collector:
    """Full passes at the moments the coordinator picks; ``clock``: monotonic seconds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last = clock()  # the process started with a full pass (then froze it)
        self.passes = 0
        self.max_ms = 0.0
        self.total_ms = 0.0

    def quiet_due(self) -> bool:
        """At a quiet moment: is a full pass due?"""
        return self._clock() - self._last >= EVERY_S

    def overdue(self) -> bool:
        """Is a full pass due whatever is happening?"""
        return self._clock() - self._last >= OVERDUE_S

    def collect(self) -> int:
        """One full pass now; the unreachable objects it found."""
        started = time.perf_counter()
        found = gc.collect()
        took = (time.perf_counter() - started) * 1000.0
        self._last = self._clock()
        self.passes += 1
        self.total_ms += took
        self.max_ms = max(self.max_ms, took)
        return found

    def report(self) -> dict[str, float | int]:
        return {"passes": self.passes, "max_ms": round(self.max_ms, 3),
                "total_ms": round(self.total_ms, 3)}
