"""Shared by the El Che tests: a default ElChe and compute-scale window reports."""

from __future__ import annotations

from collections.abc import Mapping

from ddpbus.orchestrator.core.elche import ElChe, RankWindow, WindowReport


def make(ranks: int = 2, **knobs: object) -> ElChe:
    args: dict[str, object] = {"anchor": 10, "min_anchor": 10, "max_anchor": 1000,
                               "overhead_target": 0.05}
    args.update(knobs)
    return ElChe(range(ranks), **args)  # type: ignore[arg-type]


def window(speeds: Mapping[int, float], *, steps: Mapping[int, int] | None = None,
           reduce_ms: float = 0.0) -> WindowReport:
    """A compute-scale report: rank r ran ``steps[r]`` batches (default 10) at ``speeds[r]``."""
    ranks = {}
    for r, ms in speeds.items():
        n = 10 if steps is None else steps[r]
        ranks[r] = RankWindow(steps=n, compute_ms=n * ms)
    return WindowReport(ranks=ranks, reduce_ms=reduce_ms, use_delivered=False)


def feed(e: ElChe, speeds: Mapping[int, float], times: int = 1, **kw: object) -> None:
    for _ in range(times):
        e.report_window(window(speeds, **kw))  # type: ignore[arg-type]
