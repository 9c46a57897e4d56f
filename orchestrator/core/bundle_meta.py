"""Resume bundles, the pure part: the meta record the core writes at an epoch boundary and
the state a resumed run starts from (storage in :mod:`.bundles`).

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
from ddpbus.orchestrator.core.state import ResumePoint, State

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
    """A bundle's meta as the core's :class:`ResumePoint`; a clear error if malformed.

    The meta comes from storage, so every value that the core, a later bundle's meta and the
    run summary read is checked and typed here (counters in ``[0, 2**64)``, finite floats,
    ledgers that JSON can hold) rather than failing there, mid-run."""
    try:
        epoch = _count(record["epoch"])
        coverage = tuple(_ledger(c) for c in record.get("coverage", []))
        resumed = ResumePoint(
            source=source, version=version, epoch=epoch,
            global_step=_count(record["global_step"]), rounds=_count(record["rounds"]),
            world_size=_count(record["world_size"]),
            dataset_size=_count(record.get("dataset_size", 0)),
            elche=_elche(record.get("elche") or {}),
            divergence_history=tuple(_finite(d) for d in record.get("divergence_history", [])),
            coverage=coverage,
            eval_history=tuple((_count(e), _finite(v))
                               for e, v in record.get("eval_history", [])))
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise BundleError(f"{source}: malformed bundle meta ({exc!r})") from None
    if len(coverage) != epoch or any(c["epoch"] != e or not c["exact"]
                                     for e, c in enumerate(coverage)):
        raise BundleError(f"{source}: the bundle's coverage does not prove epochs 0..{epoch - 1}"
                          " trained exactly once; it cannot be resumed exactly")
    return resumed


_U64: Final = 2**64


def _count(value: Any) -> int:
    """A counter as meta() writes it: an integer (a decimal string as a JSON key) in
    ``[0, 2**64)``; TypeError/ValueError if not."""
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{value!r} is not a count")
    if not 0 <= value < _U64:
        raise ValueError(f"{value} is outside [0, 2**64)")
    return value


def _finite(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{value!r} is not a number")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{value!r} is not a finite number")
    return number


def _ledger(saved: Any) -> dict[str, Any]:
    """One epoch's coverage ledger (what ``Pool.ledger`` wrote), its counts typed."""
    ledger = dict(saved)
    ledger |= {k: _count(ledger[k]) for k in ("epoch", "batches", "trained")}
    ledger["exact"] = ledger.get("exact") is True
    json.dumps(ledger, allow_nan=False)  # it is written into later bundles' meta
    return ledger


def _elche(saved: dict[str, Any]) -> dict[str, Any]:
    """What ElChe.export_state wrote, with the types ElChe.restore_state reads; raises
    ValueError/TypeError unless it is that."""
    if not saved:
        return {}
    smoothed = {str(_count(r)): None if ms is None else _finite(ms)
                for r, ms in dict(saved.get("smoothed_ms", {})).items()}
    counts = {str(_count(r)): _count(c) for r, c in dict(saved.get("counts", {})).items()}
    anchor_rank = saved.get("anchor_rank")
    return {"anchor": _count(saved["anchor"]),
            "anchor_rank": None if anchor_rank is None else _count(anchor_rank),
            "calibrations": _count(saved.get("calibrations", 0)),
            "growth_latched": saved.get("growth_latched", False) is True,
            "stable_streak": _count(saved.get("stable_streak", 0)),
            "smoothed_ms": smoothed, "counts": counts}


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
        s.elche.restore_state(r.elche)  # typed by point()


def ledgers(s: State) -> list[dict[str, Any]]:
    """Coverage ledgers of the epochs this run did not train itself (resumed over)."""
    return list(s.config.resume.coverage) if s.config.resume is not None else []
