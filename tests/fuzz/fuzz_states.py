"""Coordinator core states in every phase, for the intake and snapshot fuzzing, and the
path a resume bundle's manifest takes into a core.

A simulated run (tests/unit's ``cluster_sim``, the real core against simulated ranks) is
folded again through a fresh core, event by event at its own times, and the state is kept
at the first moment each phase of interest holds; the broker backend's round in flight
comes from the hand-fed harness (``core_harness``). :func:`fresh` hands out a deep copy, so
an example can feed anything into it.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from functools import cache
from typing import Final

import fuzz_corpus as fc
from cluster_sim import Sim
from core_harness import Core, hello

from ddpbus.codecs import messages as m
from ddpbus.codecs import subjects as sj
from ddpbus.orchestrator.core import bundle_meta
from ddpbus.orchestrator.core.config import schedule_from
from ddpbus.orchestrator.core.state import (
    Admit,
    CoreConfig,
    Joined,
    Phase,
    Send,
    State,
    Tick,
    Timing,
)
from ddpbus.orchestrator.core.summary import summarize
from ddpbus.orchestrator.core.transition import initial_state, transition
from ddpbus.orchestrator.persist import bundles

WORLD: Final = 4  # fuzz_corpus.WORLD
SPEEDS: Final = (2.0, 3.0, 4.0, 5.0)


def _sync_in_flight(s: State) -> bool:
    return s.phase is Phase.TRAINING and s.sync_sent_at is not None and any(
        not r.acked for r in s.alive)


def _window_open(s: State) -> bool:
    return s.phase is Phase.TRAINING and s.rounds >= 1 and all(
        r.acked for r in s.alive) and any(r.steps for r in s.alive)


_MOMENTS: Final[dict[str, Callable[[State], bool]]] = {
    "forming": lambda s: s.phase is Phase.FORMING,
    "training-sync-in-flight": _sync_in_flight,
    "training-window-open": _window_open,
    "finishing": lambda s: s.phase is Phase.FINISHING,
    "draining": lambda s: s.phase is Phase.DRAINING,
    "done": lambda s: s.phase is Phase.DONE,
}


def _folded() -> dict[str, State]:
    sim = Sim(schedule_from({"policy": "cadence", "batch_size": 8, "epochs": 2}), SPEEDS,
              dataset_size=640, has_eval=True, has_checkpoint_fn=True)
    sim.run()
    state = initial_state(sim.config, 0.0)
    found: dict[str, State] = {}
    for now, event in sim.delivered:
        state, _ = transition(state, event, now)
        for name, holds in _MOMENTS.items():
            if name not in found and holds(state):
                found[name] = copy.deepcopy(state)
    return found


def _admitting() -> State:
    core = Core(world=WORLD)
    core.join(0)
    core.join(2)
    return core.state


def _broker_round() -> State:
    core = Core(world=WORLD, backend="broker", anchor=4, snapshot_timeout=3.0)
    core.admit_all()
    for r in core.state.alive:
        core.train(r.rank, r.target)
    return core.state


@cache
def _states() -> dict[str, State]:
    states = {"admitting": _admitting(), **_folded(), "broker-round": _broker_round()}
    missing = [n for n in (*_MOMENTS, "broker-round") if n not in states]
    if missing or states["broker-round"].broker_round is None:
        raise AssertionError(f"the simulated run never reached {missing or 'a broker round'}")
    return states


PHASES: Final = ("admitting", *_MOMENTS, "broker-round")


def fresh(name: str) -> State:
    """A deep copy of the state at moment ``name`` (one of :data:`PHASES`)."""
    return copy.deepcopy(_states()[name])


# -------------------------------------------------------------------- snapshots

_SNAPSHOT_REASONS: Final = (  # first match wins: "does not load" wraps any other text
    ("does not load", "does-not-load"), ("signature does not match", "bad-signature"),
    ("not a ddpbus coordinator", "magic"), ("unknown snapshot node", "node"),
    ("which it may not", "foreign-class"), ("not a ddpbus class", "not-a-class"),
    ("not an enum", "not-an-enum"), ("holds something else", "not-a-snapshot"))


def snapshot_reason(exc: Exception) -> str:
    """A short label for a SnapshotError (it has no ``reason`` of its own)."""
    text = str(exc)
    return next((label for needle, label in _SNAPSHOT_REASONS if needle in text),
                f"other:{text[:40]}")


# ---------------------------------------------------------- resuming from a bundle

STAGES: Final = ("manifest", "fits", "meta")  # where a BundleError may come from


def manifest(state: State) -> bytes:
    """The manifest of a bundle taken at the end of epoch 0 of ``state``'s run."""
    meta = bundle_meta.meta(state, epoch=0)
    parts = {p: {"name": f"v1/{p}.safetensors", "size": 10, "sha256": "0" * 64}
             for p in bundles.PARTS}
    return bundles.Manifest(job="earlier", version=1, parts=parts, meta=meta,
                            store={"kind": "object", "bucket": "ddpbus_earlier_bundles"}
                            ).to_json()


def _run_resumed(config: CoreConfig) -> None:
    """A core seeded from a bundle: every rank joins, training starts (its commands encoded
    for publishing), the next bundle's meta and the run summary are written."""
    core = initial_state(config, 0.0)
    encoder = fc.encoder(sj.COORDINATOR)
    out = [c for r in range(config.world_size) for c in transition(
        core, Joined(hello(r, world=config.world_size)), 1.0)[1]]
    if core.rendezvous is not None:
        out += transition(core, Timing(m.NewNcclIdGenerated(
            rank=core.rendezvous.generator, uid_bytes=b"\x22" * m.NCCL_ID_BYTES)), 2.0)[1]
    out += transition(core, Tick(), 3.0)[1]
    for c in out:
        if isinstance(c, Send):
            subject = sj.CONTROL_ALL.subject(fc.JOB) if c.rank is None else \
                sj.CONTROL_RANK.subject(fc.JOB, c.rank)
            encoder.encode(subject, c.msg)
        elif isinstance(c, Admit):
            encoder.encode(sj.ADMIT_RANK.subject(fc.JOB, c.msg.rank), c.msg)
    bundle_meta.meta_json(core, core.epoch)
    summarize(core)


def resume_from(raw: bytes, state: State) -> str:
    """What a coordinator does with ``--resume``: parse, check, seed a core, run it. The
    outcome: ``accepted`` or ``refused-by-<stage>`` (a BundleError); anything else raised
    is a :class:`fuzz_corpus.Crash`."""
    sched = state.schedule
    stage = "manifest"
    try:
        manifest = bundles.Manifest.from_json(raw, "fuzz")
        stage = "fits"
        bundles.check_fits(manifest, seed=sched.seed, batch_size=sched.batch_size,
                           epochs=sched.epochs)
        stage = "meta"
        point = bundle_meta.point(manifest.describe(), manifest.version, manifest.meta)
        stage = "core"
        _run_resumed(dataclasses.replace(state.config, resume=point))
    except bundles.BundleError as exc:
        if stage not in STAGES or not str(exc):
            raise fc.Crash(f"{stage} refused {fc.shown(raw)} without a reason") from exc
        return f"refused-by-{stage}"
    except Exception as exc:
        raise fc.Crash(f"{type(exc).__name__} at {stage}: {exc} on {fc.shown(raw)}") from exc
    return "accepted"
