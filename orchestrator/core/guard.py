"""The divergence guard: may El Che grow its window?

Input per average: ``D = max_r |theta_pre,r - theta_post| / |theta_post|`` from the SyncAcks.
The trend guard keeps the last 5 values; when the last three strictly rise and the latest
exceeds the threshold it answers SuppressGrowth, otherwise Stable. Under the sync policy there
is no window to grow and no measurement: always Stable.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable
from typing import Final

from ddpbus.orchestrator.core.elche import STABLE, GuardVerdict, Verdict

HISTORY: Final = 5
RISES: Final = 3


def cosine(divergence: float, pre_norm: float, post_norm: float) -> float:
    """Cosine between a rank's pre-average and the consensus parameters, from the norms."""
    if pre_norm <= 0 or post_norm <= 0:
        return 1.0
    d = divergence * post_norm
    value = (pre_norm**2 + post_norm**2 - d**2) / (2 * pre_norm * post_norm)
    return max(-1.0, min(1.0, value))


class TrendGuard:
    def __init__(self, *, threshold: float, enabled: bool = True, sync: bool = False) -> None:
        self.threshold = threshold
        self.enabled = enabled and not sync
        self.history: deque[float] = deque(maxlen=HISTORY)

    def observe(self, divergences: Iterable[float]) -> GuardVerdict:
        """One settled average's per-rank divergences -> a verdict for El Che."""
        if not self.enabled:
            return STABLE
        finite = [d for d in divergences if math.isfinite(d)]
        if not finite:
            return STABLE
        self.history.append(max(finite))
        last = list(self.history)[-RISES:]
        rising = len(last) == RISES and all(a < b for a, b in itertools.pairwise(last))
        if rising and last[-1] > self.threshold:
            return GuardVerdict(Verdict.SUPPRESS_GROWTH)
        return STABLE
