"""Resume bundles, the pure part: the meta record the core writes at an epoch boundary and
the state a resumed run starts from (reference D.4, D.6; storage in :mod:`.bundles`).

A bundle is taken right after the average that closes epoch ``E`` (so the saving rank holds
the consensus, and every batch of epochs ``0..E`` is in it exactly once; the coverage
ledgers say so). Its meta says to start at epoch ``E + 1`` with the global step, averaging
rounds, El Che state, divergence history and eval history of that moment. A run resumed
from it trains epochs ``E + 1`` onwards on the same permutations (same seed), so the
coverage proof spans the whole run across the resume. Work done after the last bundle is
redone, never lost and never counted twice.

Unlike the reference, the world size may change on resume (El Che then keeps only its
anchor and calibrates per-rank speeds afresh), and the parameters and optimizer state are
loaded by ddpbus itself, on every rank, before training.
"""

from __future__ import annotations

import json
import math
from typing import Any, Final

from ddpbus.codecs.errors import DdpbusError
from ddpbus.orchestrator.state import ResumePoint, State

SCHEMA_VERSION: Final = 1  # of bundle manifests and meta records
BOUNDARY: Final = "epoch-boundary"


class BundleError(DdpbusError, ValueError):
    """A bundle that cannot be found, read or used for this run."""


def meta(s: State, epoch: int, reason: str = BOUNDARY) -> dict[str, Any]:
    """The meta record of a bundle taken right after the average that closed ``epoch``."""
    prior = s.config.resume.coverage if s.config.resume is not None else ()
    ledgers = [*prior, *(s.pools[e].ledger() for e in sorted(s.pools) if e <= epoch)]
    return {
        "schema_version": SCHEMA_VERSION,
        "epoch": epoch + 1,
        "global_step": s.global_step,
        "rounds": s.rounds,
        "world_size": len(s.alive),
        "reason": reason,
        "elche": s.elche.export_state(),
        "divergence_history": [d for d in s.guard.history if math.isfinite(d)],
        "coverage": ledgers,
        "eval_history": [[e, v] for e, v in s.eval_history if math.isfinite(v)],
        "seed": s.schedule.seed,
        "batch_size": s.schedule.batch_size,
        "dataset_size": s.dataset_size,
        "epochs_planned": s.schedule.epochs,
    }


def meta_json(s: State, epoch: int, reason: str = BOUNDARY) -> str:
    return json.dumps(meta(s, epoch, reason), sort_keys=True, allow_nan=False)


def point(source: str, version: int, record: dict[str, Any]) -> ResumePoint:
    """A bundle's meta as the core's :class:`ResumePoint`; a clear error if malformed."""
    try:
        epoch = int(record["epoch"])
        coverage = tuple(dict(c) for c in record.get("coverage", []))
        resumed = ResumePoint(
            source=source, version=version, epoch=epoch,
            global_step=int(record["global_step"]), rounds=int(record["rounds"]),
            world_size=int(record["world_size"]),
            dataset_size=int(record.get("dataset_size", 0)), elche=dict(record.get("elche") or {}),
            divergence_history=tuple(float(d) for d in record.get("divergence_history", [])),
            coverage=coverage,
            eval_history=tuple((int(e), float(v)) for e, v in record.get("eval_history", [])))
        _check_elche(resumed.elche)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise BundleError(f"{source}: malformed bundle meta ({exc!r})") from None
    if epoch < 0 or resumed.global_step < 0 or len(coverage) != epoch or any(
            int(c.get("epoch", -1)) != e or not c.get("exact") for e, c in enumerate(coverage)):
        raise BundleError(f"{source}: the bundle's coverage does not prove epochs 0..{epoch - 1}"
                          " trained exactly once; it cannot be resumed exactly")
    return resumed


def _check_elche(saved: dict[str, Any]) -> None:
    """Raise ValueError/TypeError unless ``saved`` is what ElChe.export_state wrote."""
    if not saved:
        return
    int(saved["anchor"])
    for rank, ms in dict(saved.get("smoothed_ms", {})).items():
        int(rank)
        if ms is not None:
            float(ms)
    for rank, count in dict(saved.get("counts", {})).items():
        int(rank)
        int(count)


def seed(s: State) -> None:
    """Start a fresh core state where its resume point says (called once, at creation)."""
    r = s.config.resume
    if r is None:
        return
    s.epoch = s.next_aggregate = r.epoch
    s.global_step = r.global_step
    s.rounds = r.rounds
    s.eval_history = list(r.eval_history)
    s.guard.history.extend(r.divergence_history)
    if r.elche:
        s.elche.restore_state(r.elche)  # checked by point()


def ledgers(s: State) -> list[dict[str, Any]]:
    """Coverage ledgers of the epochs this run did not train itself (resumed over)."""
    return list(s.config.resume.coverage) if s.config.resume is not None else []
