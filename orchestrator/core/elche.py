"""El Che: how many batches each rank runs between two averages.

The slowest rank anchors the window with ``anchor`` batches; every other rank gets
``round(anchor * slow_ms / ms_r)`` (at least 1, speed ratio capped at 64) so all ranks reach
the average at about the same wall time. Speeds come from the batches a rank *actually*
ran in each window (never the scheduled count), smoothed over a trust window of the last 5
readings. The anchor grows multiplicatively (at most x2 per cycle) while the window's fixed
cost is above the overhead target, but a growth proposal is only committed when the
divergence guard says Stable (:meth:`ElChe.apply_verdict`). Pure: no clock, no I/O.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

TRUST_WINDOW: Final = 5
MISS_LIMIT: Final = 5
COHORT_BAND: Final = 0.15
DOMINANCE_MARGIN: Final = 0.10
MAX_SPEED_RATIO: Final = 64.0
DEAD_ZONE: Final = 0.05
GROWTH_STEP_CAP: Final = 2.0
STABLE_STREAK_REARM: Final = 5
SHARE_HISTORY: Final = 10
STABLE_AT: Final = 5
MATURE_AT: Final = 20


class Phase(enum.IntEnum):
    PROBE = 0
    WARMUP = 1
    STABLE = 2
    MATURE = 3


class Verdict(enum.Enum):
    STABLE = "stable"
    SUPPRESS_GROWTH = "suppress-growth"
    NUDGE_DOWN = "nudge-down"


@dataclass(frozen=True, slots=True)
class GuardVerdict:
    verdict: Verdict
    factor: float = 1.0  # NudgeDown only


STABLE: Final = GuardVerdict(Verdict.STABLE)


@dataclass(frozen=True, slots=True)
class RankWindow:
    """One rank's batches in one window, on both timing scales."""

    steps: int
    compute_ms: float  # sum of batch_ms (compute only)
    delivered_ms: float = 0.0  # sum of batch_ms + data_ms over batches 2..n
    delivered_batches: int = 0
    fill_ms: float | None = None  # batch_ms + data_ms of the window's first batch


@dataclass(frozen=True, slots=True)
class WindowReport:
    ranks: Mapping[int, RankWindow]
    reduce_ms: float  # measured cost of the previous average (0 when unknown)
    use_delivered: bool  # the policy schedules on delivered cost (cadence/async)


def clamp_total(counts: Mapping[int, int], total: int) -> dict[int, int]:
    """Scale counts down proportionally (floor, min 1) so they sum to ``total`` (C.1.1);
    the remainder goes one by one to the lowest ranks. Ranks beyond ``total`` get 0."""
    ranks = sorted(counts)
    current = sum(counts.values())
    if current <= total:
        return dict(counts)
    if total < len(ranks):
        return {r: (1 if i < total else 0) for i, r in enumerate(ranks)}
    out = {r: max(1, counts[r] * total // current) for r in ranks}
    excess = sum(out.values()) - total
    for r in sorted(ranks, key=lambda r: -out[r]):  # floor of 1 can overshoot: trim largest
        if excess <= 0:
            break
        take = min(excess, out[r] - 1)
        out[r] -= take
        excess -= take
    short = total - sum(out.values())
    for r in ranks:
        if short <= 0:
            break
        out[r] += 1
        short -= 1
    return out


class ElChe:
    """The batch-count balancer for one run. ``ranks`` are the ranks it schedules."""

    def __init__(self, ranks: Iterable[int], *, anchor: int, min_anchor: int, max_anchor: int,
                 overhead_target: float, max_batch_diff: int | None = None,
                 growth: bool = True, relax_up: bool = False, max_total: int | None = None
                 ) -> None:
        self.ranks = sorted(ranks)
        self.anchor = anchor
        self.min_anchor = min_anchor
        self.max_anchor = max_anchor
        self.overhead_target = overhead_target
        self.max_batch_diff = max_batch_diff
        self.growth = growth
        self.relax_up = relax_up
        self.max_total = max_total
        self.counts: dict[int, int] = {r: anchor for r in self.ranks}
        self.anchor_rank: int | None = None
        self.calibrations = 0
        self.cap_binds = False
        self.pending_anchor: int | None = None
        self.growth_latched = False
        self.stable_streak = 0
        self.last_overhead: float | None = None
        self._readings: dict[int, deque[float]] = {r: deque(maxlen=TRUST_WINDOW)
                                                   for r in self.ranks}
        self._misses: dict[int, int] = dict.fromkeys(self.ranks, 0)
        self._fill: dict[int, float | None] = dict.fromkeys(self.ranks)
        self._slack: dict[int, float] = {}
        self._shares: deque[dict[int, int]] = deque(maxlen=SHARE_HISTORY)
        self._apply_cap()

    # -------------------------------------------------------------- observations

    @property
    def phase(self) -> Phase:
        if self.calibrations == 0:
            return Phase.PROBE
        if self.calibrations < STABLE_AT:
            return Phase.WARMUP
        return Phase.STABLE if self.calibrations < MATURE_AT else Phase.MATURE

    @property
    def calibrated(self) -> bool:
        return self.calibrations > 0

    def smoothed_ms(self, rank: int) -> float | None:
        window = self._readings.get(rank)
        return sum(window) / len(window) if window else None

    def anchor_wall_ms(self) -> float:
        slow = None if self.anchor_rank is None else self.smoothed_ms(self.anchor_rank)
        return self.anchor * slow if slow else 0.0

    def fastest(self, candidates: Iterable[int]) -> int | None:
        """The candidate with the lowest smoothed ms/batch (ties: lowest rank); None when no
        candidate has been measured."""
        timed = [(ms, r) for r in candidates if (ms := self.smoothed_ms(r)) is not None]
        return min(timed)[1] if timed else None

    def recent_batch_share(self) -> dict[int, float]:
        """Mean of the last 10 allocations, normalised (equal before any report)."""
        history = list(self._shares) or [self.counts]
        sums = {r: sum(h.get(r, 0) for h in history) for r in self.ranks}
        total = sum(sums.values()) or 1
        return {r: sums[r] / total for r in self.ranks}

    def stage_slack(self, rank: int, slack_ms: float) -> None:
        """Shrink ``rank``'s next count by the expected cost of a callback it will run."""
        self._slack[rank] = self._slack.get(rank, 0.0) + slack_ms

    def set_ranks(self, ranks: Iterable[int]) -> None:
        """Schedule only these ranks from now on (membership changed)."""
        self.ranks = sorted(ranks)
        self.counts = {r: self.counts.get(r, self.anchor) for r in self.ranks}
        if self.anchor_rank not in self.ranks:
            self.anchor_rank = None
        for r in self.ranks:
            self._readings.setdefault(r, deque(maxlen=TRUST_WINDOW))
            self._misses.setdefault(r, 0)
        self._recompute(first=False)

    # ---------------------------------------------------------------- bundles

    def export_state(self) -> dict[str, Any]:
        """What a resume bundle keeps: anchor, anchor rank,
        per-rank smoothed ms/batch and counts, calibrations, growth latch. Knobs are not
        kept: the resumed run supplies them."""
        return {"anchor": self.anchor, "anchor_rank": self.anchor_rank,
                "calibrations": self.calibrations, "growth_latched": self.growth_latched,
                "stable_streak": self.stable_streak,
                "smoothed_ms": {str(r): self.smoothed_ms(r) for r in self.ranks},
                "counts": {str(r): c for r, c in self.counts.items()}}

    def restore_state(self, saved: Mapping[str, Any]) -> bool:
        """Continue from :meth:`export_state` (no re-calibration): each rank's trust window
        is seeded with one sample, the saved mean. The per-rank part needs the same ranks;
        with another world size only the anchor carries over. Returns whether it all did."""
        self.anchor = min(self.max_anchor, max(1, int(saved["anchor"])))
        ms = {int(r): v for r, v in dict(saved.get("smoothed_ms", {})).items()}
        counts = {int(r): int(c) for r, c in dict(saved.get("counts", {})).items()}
        if set(ms) != set(self.ranks):
            self.counts = {r: self.anchor for r in self.ranks}
            self._apply_cap()
            return False
        for r, value in ms.items():
            self._readings[r].clear()
            if value is not None and value > 0:
                self._readings[r].append(float(value))
        self.calibrations = int(saved.get("calibrations", 0))
        anchor_rank = saved.get("anchor_rank")
        self.anchor_rank = int(anchor_rank) if anchor_rank in self.ranks else None
        self.growth_latched = bool(saved.get("growth_latched", False))
        self.stable_streak = int(saved.get("stable_streak", 0))
        self.counts = {r: max(1, counts.get(r, self.anchor)) for r in self.ranks}
        self._apply_cap()
        return True

    # -------------------------------------------------------------------- report

    def report_window(self, report: WindowReport) -> None:
        """Fold one window's timings in, elect the anchor rank, recompute the counts and
        (if the window's fixed cost is too high) stage a growth proposal."""
        movers = {r: w for r, w in report.ranks.items() if w.steps > 0 and r in self._readings}
        if not movers:
            return  # a completely idle window reports nothing
        coherent = report.use_delivered and all(w.delivered_batches > 0
                                                for w in movers.values())
        for r in self.ranks:
            w = movers.get(r)
            reading = None
            if w is not None:
                reading = (w.delivered_ms / w.delivered_batches if coherent
                           else w.compute_ms / w.steps)
                self._fill[r] = w.fill_ms
            if reading is not None and reading > 0:
                self._readings[r].append(reading)
                self._misses[r] = 0
            else:
                self._misses[r] += 1
                if self._misses[r] >= MISS_LIMIT:
                    self._readings[r].clear()
        if not any(self._readings[r] for r in self.ranks):
            return
        first = self.calibrations == 0
        self.calibrations += 1
        self._elect()
        self._recompute(first=first)
        self._propose(report.reduce_ms)

    def _elect(self) -> None:
        timed = {r: ms for r in self.ranks if (ms := self.smoothed_ms(r)) is not None}
        pinned = self.anchor_rank
        if pinned is not None and pinned not in timed:
            pinned = None  # escape: the pinned anchor has no data any more
        if pinned is not None and self.phase < Phase.STABLE:
            return  # frozen before Stable
        slowest = max(timed.values())
        cohort = sorted(r for r, ms in timed.items() if ms >= (1 - COHORT_BAND) * slowest)
        if len(cohort) == 1:
            self.anchor_rank = cohort[0]
        elif pinned in cohort:
            challenger = max(cohort, key=lambda r: (timed[r], -r))
            if timed[challenger] >= (1 + DOMINANCE_MARGIN) * timed[pinned]:
                self.anchor_rank = challenger
        else:
            self.anchor_rank = cohort[0]

    def _recompute(self, *, first: bool) -> None:
        slow = None if self.anchor_rank is None else self.smoothed_ms(self.anchor_rank)
        new: dict[int, int] = {}
        for r in self.ranks:
            current = self.counts.get(r, self.anchor)
            ms = self.smoothed_ms(r)
            if slow is None or ms is None or abs(ms - slow) <= 1e-6:
                target = self.anchor
            else:
                target = max(1, round(self.anchor * min(slow / ms, MAX_SPEED_RATIO)))
            slack = self._slack.pop(r, 0.0)
            if slack > 0 and ms:
                new[r] = max(1, target - math.ceil(slack / ms))  # bypasses the dead zone
                continue
            if not first and abs(target - current) <= DEAD_ZONE * current:
                target = current
            elif not first and self.max_batch_diff is not None:
                m = self.max_batch_diff
                target = max(1, min(current + m, max(current - m, target)))
            new[r] = target
        self.counts = new
        self._apply_cap()
        self._shares.append(dict(self.counts))

    def _apply_cap(self) -> None:
        self.cap_binds = self.max_total is not None and sum(self.counts.values()) > self.max_total
        if self.cap_binds and self.max_total is not None:
            # the per-rank floor of 1 wins when there are more ranks than batches (C.1.2);
            # dispatch still hands out only the batches there are
            self.counts = {r: max(1, c) for r, c in
                           clamp_total(self.counts, self.max_total).items()}

    def _propose(self, reduce_ms: float) -> None:
        self.pending_anchor = None
        self.last_overhead = None
        if not self.growth or self.growth_latched or self.cap_binds or self.anchor_rank is None:
            return
        phase = self.phase
        if phase is Phase.PROBE or (phase is Phase.WARMUP and self.calibrations < 2):
            return
        fire_at = self.overhead_target * (2.0 if phase is Phase.WARMUP else 1.0)
        marginal = self.smoothed_ms(self.anchor_rank) or 0.0
        fill_sample = self._fill.get(self.anchor_rank)
        fill = max(0.0, fill_sample - marginal) if fill_sample is not None else 0.0
        fixed = max(0.0, reduce_ms) + fill
        denominator = self.anchor * marginal + fixed
        if denominator <= 0:
            return
        overhead = fixed / denominator
        self.last_overhead = overhead
        if overhead > fire_at:
            step = min(overhead / self.overhead_target, GROWTH_STEP_CAP)
            proposal = min(self.max_anchor, max(self.min_anchor, math.ceil(self.anchor * step)))
            if proposal > self.anchor:
                self.pending_anchor = proposal

    # ------------------------------------------------------------------- verdict

    def apply_verdict(self, verdict: GuardVerdict) -> None:
        """The one seam through which the divergence guard steers the anchor."""
        proposal, self.pending_anchor = self.pending_anchor, None
        if verdict.verdict is Verdict.STABLE:
            self.stable_streak += 1
            if self.growth_latched and self.stable_streak >= STABLE_STREAK_REARM:
                self.growth_latched = False
            changed = False
            if proposal is not None:
                self.anchor, changed = proposal, True
            # relax-up is growth too: never under sync, nor while a veto latches it off
            if (self.relax_up and self.growth and not self.growth_latched
                    and self._relax_allowed()):
                self.anchor += 1
                changed = True
            if changed:
                self._recompute(first=False)
            return
        self.stable_streak = 0
        self.growth_latched = True
        if verdict.verdict is Verdict.NUDGE_DOWN:
            self.nudge_anchor_down(verdict.factor)

    def _relax_allowed(self) -> bool:
        if self.anchor + 1 > self.max_anchor or self.cap_binds or not self.counts:
            return False
        if self.max_batch_diff is None:
            return True
        scale = (self.anchor + 1) / self.anchor
        slow = self.counts.get(self.anchor_rank, self.anchor) if self.anchor_rank is not None \
            else self.anchor
        fast = max(self.counts.values())
        return round(fast * scale) - round(slow * scale) <= self.max_batch_diff

    def nudge_anchor_down(self, factor: float) -> None:
        """``anchor = min(anchor, max(1, ceil(anchor * clamp(f, 0.1, 1))))``, ignoring
        ``min_anchor`` on purpose."""
        f = min(1.0, max(0.1, factor))
        self.anchor = min(self.anchor, max(1, math.ceil(self.anchor * f)))
        self._recompute(first=False)
