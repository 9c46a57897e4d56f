"""The learning-rate-aware window controller (flodl C.9): may the averaging window shrink?

The divergence guard only holds El Che's growth. Two watchers here can shrink the window (a
``NudgeDown`` verdict, applied through El Che's one verdict seam), once per settled average:

- the LR cliff: the run's learning rate (the ranks' LrUpdate reports) fell by more than
  30 % since the previous average (a MultiStepLR drop; a cosine decay moves less): base
  factor 0.5, since the replicas now drift apart at another rate than El Che measured;
- the convergence watcher: the divergence guard suppressed growth K averages running (the
  replicas keep diverging with growth held): base 0.3 / 0.5 / 0.7 in El Che's warm-up /
  stable / mature phase, K 5 / 3 / 2.

A firing watcher's factor leans on the anchor's trend over the last 5 averages
(``(now - mean) / mean``): ``clamp(base - (1 - base) * trend, 0.1, 0.95)`` (a rising anchor
is cut harder, a falling one gently); both firing multiply, clamped again. Under the sync
policy there is no window: it never fires.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Final

from ddpbus.orchestrator.core.elche import GuardVerdict, Phase, Verdict

LR_HISTORY: Final = 3
ANCHOR_HISTORY: Final = 5
VERDICT_HISTORY: Final = 5
LR_CLIFF: Final = 0.3  # a fall of more than this share of the learning rate
LR_CLIFF_BASE: Final = 0.5
# El Che's phase -> (base factor, consecutive suppressed verdicts that fire)
CONVERGENCE: Final = {Phase.WARMUP: (0.3, 5), Phase.STABLE: (0.5, 3), Phase.MATURE: (0.7, 2)}


def _clamp(x: float, lo: float, hi: float) -> float:
    return max(lo, min(hi, x))


@dataclass(slots=True)
class MetaController:
    enabled: bool = True
    lrs: deque[float] = field(default_factory=lambda: deque(maxlen=LR_HISTORY))
    anchors: deque[int] = field(default_factory=lambda: deque(maxlen=ANCHOR_HISTORY))
    verdicts: deque[Verdict] = field(default_factory=lambda: deque(maxlen=VERDICT_HISTORY))

    def observe(self, verdict: GuardVerdict, *, lr: float | None, anchor: int,
                phase: Phase) -> tuple[GuardVerdict, list[str]]:
        """One settled average: the guard's verdict, the run's learning rate (None: no rank
        reported one), El Che's anchor and phase -> the verdict to apply, and why it
        changed (empty: the guard's stands)."""
        if not self.enabled:
            return verdict, []
        if lr is not None:
            self.lrs.append(lr)
        self.anchors.append(anchor)
        self.verdicts.append(verdict.verdict)
        factors, why = [], []
        if len(self.lrs) >= 2:
            before, now = self.lrs[-2], self.lrs[-1]
            if before > 0 and now < before and (before - now) / before > LR_CLIFF:
                factors.append(self._lean(LR_CLIFF_BASE))
                why.append("lr-cliff")
        if phase in CONVERGENCE:
            base, runs = CONVERGENCE[phase]
            last = list(self.verdicts)[-runs:]
            if len(last) == runs and all(v is not Verdict.STABLE for v in last):
                factors.append(self._lean(base))
                why.append("convergence")
        if not factors:
            return verdict, []
        product = 1.0
        for f in factors:
            product *= f
        return GuardVerdict(Verdict.NUDGE_DOWN, factor=_clamp(product, 0.1, 0.95)), why

    def _lean(self, base: float) -> float:
        trend = 0.0
        if len(self.anchors) >= 2:
            mean = sum(self.anchors) / len(self.anchors)
            trend = (self.anchors[-1] - mean) / mean if mean > 0 else 0.0
        return _clamp(base - (1 - base) * trend, 0.1, 0.95)
