"""The run summary: what a finished (or failed) run did, as plain JSON-able data."""

from __future__ import annotations

import math
from typing import Any

from ddpbus.orchestrator.core import bundle_meta
from ddpbus.orchestrator.core.config import describe
from ddpbus.orchestrator.core.state import State


def _num(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _per_rank(totals: list[float]) -> dict[str, float]:
    """A per-rank EpochMetrics column summed over the aggregated epochs."""
    return {str(rank): v for rank, v in enumerate(totals)}


def _coverage(s: State) -> dict[str, Any]:
    """Every planned epoch's batches in the consensus exactly once, from the coordinator's
    ledger of chunks (assignments), epoch by epoch."""
    prior = bundle_meta.ledgers(s)  # epochs trained before a resume, from the bundle's proof
    epochs = prior + [s.pools[e].ledger() if e in s.pools else
                      {"epoch": e, "batches": s.total_batches, "trained": 0, "exact": False}
                      for e in range(len(prior), s.schedule.epochs)] if s.total_batches else []
    return {"exact": bool(epochs) and all(e["exact"] for e in epochs),
            "epochs": len(epochs),
            "batches": sum(int(e["trained"]) for e in epochs),
            "resumed_epochs": len(prior),
            "violations": [e for e in epochs if not e["exact"]]}


def summarize(s: State) -> dict[str, Any]:
    batches = {r.rank: r.batches_total for r in s.ranks}
    total = sum(batches.values())
    started = s.training_started_at
    ended = s.finished_at
    ok, reason = s.outcome or (False, "running")
    last_eval = s.eval_history[-1] if s.eval_history else None
    return {
        "ok": ok,
        "reason": reason,
        "world_size": s.config.world_size,
        "backend": s.backend.value if s.backend else None,
        "policy": s.schedule.policy.value,
        "progressive": s.schedule.effective_progressive,
        "epochs": len(s.aggregated),
        "epochs_planned": s.schedule.epochs,
        "rounds": s.rounds,
        "snapshot_aborts": s.snapshot_aborts,  # broker backend: ranks left out of a round
        "global_step": s.global_step,
        "wall_s": (ended - started) if started is not None and ended is not None else None,
        # first batch reported -> last average acknowledged everywhere: training proper
        "train_s": (s.settled_at - s.first_batch_at)
        if s.first_batch_at is not None and s.settled_at is not None else None,
        "test_accuracy": last_eval[1] if last_eval else None,
        "test_accuracy_epoch": last_eval[0] if last_eval else None,  # the latest that came
        "eval": [{"epoch": e, "metric": v} for e, v in s.eval_history],
        "loss": [_num(e.avg_loss) for e in s.aggregated],
        "loss_epochs": [e.epoch for e in s.aggregated],  # after a resume, not from 0
        "batch_share": {str(r): (b / total if total else 0.0) for r, b in batches.items()},
        "batches": {str(r): b for r, b in batches.items()},
        "compute_ms": _per_rank(s.rank_compute_ms),
        "busy_ms": _per_rank(s.rank_busy_ms),
        "anchor": s.elche.anchor,
        "counts": {str(r): c for r, c in s.elche.counts.items()},
        "dataset_size": s.dataset_size,
        "batches_per_epoch": s.total_batches,
        "refused": dict(s.refusals),
        # the ranks' stream message ids below their newest not handled (yet): lost or
        # reordered publishes, which deduplication remembers (core.first_delivery)
        "unseen_ids": sum(len(w.holes) for w in s.seen_ids.values()),
        "coverage": _coverage(s),
        "last_bundle": s.last_bundle or None,  # the version a later --resume would load
        "resumed_from": None if (r := s.config.resume) is None else {
            "source": r.source, "version": r.version, "epoch": r.epoch,
            "global_step": r.global_step},
        "schedule": describe(s.schedule),
    }
