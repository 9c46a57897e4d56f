"""The coordinator's full collections: none started by allocations once it takes them over,
one at a quiet moment at most every EVERY_S, one on a tick once OVERDUE_S passed."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from ddpbus.codecs import messages as m
from ddpbus.orchestrator.core import gc_policy
from ddpbus.orchestrator.core.gc_policy import Collector
from ddpbus.orchestrator.tools.simulate import SimulatedCohort

# Allocates cyclic garbage in the old generation well past the point where CPython starts
# a full pass on its own, recording the generation of every pass; then one Collector pass.
_PROBE = """
import gc, json, sys
from ddpbus.orchestrator.core import gc_policy
gc.collect()
gc.freeze()
if sys.argv[1] == "taken":
    gc_policy.take_full_passes()
passes = []
gc.callbacks.append(lambda phase, info: phase == "stop" and passes.append(info["generation"]))
class Node:
    other = None  # the node it points at
live = []  # what the process holds a while (the state, as it changes), then lets go
for _ in range(200_000):
    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle: only the collector frees it
    live.append(a)  # old enough to outlive the young passes
    if len(live) == 20_000:
        live = []  # garbage now, in the old generation: only a full pass finds it
gc.callbacks.clear()
found = gc_policy.Collector().collect()
print(json.dumps({"passes": passes, "found": found, "threshold": gc.get_threshold()}))
"""


def _probe(mode: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True,
                          text=True, timeout=120, check=True)
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_no_allocation_starts_a_full_pass_once_taken_over() -> None:
    free = _probe("automatic")
    assert 2 in free["passes"]  # the probe does reach the trigger
    taken = _probe("taken")
    assert 2 not in taken["passes"]
    assert 0 in taken["passes"]  # the young generations stay automatic
    assert 1 in taken["passes"]
    assert taken["threshold"][2] == gc_policy.NEVER
    # every cycle dropped in the old generation waited for the collector's own pass
    assert taken["found"] >= 9 * 2 * 20_000
    assert free["found"] < taken["found"]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_quiet_moment_collects_at_most_every_interval() -> None:
    clock = FakeClock()
    c = Collector(clock)
    assert not c.quiet_due()  # the process starts with a full pass
    clock.now += gc_policy.EVERY_S - 0.01
    assert not c.quiet_due()
    clock.now += 0.01
    assert c.quiet_due()
    assert not c.overdue()
    c.collect()
    assert not c.quiet_due()
    assert c.report()["passes"] == 1
    assert c.report()["max_ms"] >= 0


def test_a_pass_is_overdue_after_the_overdue_interval_whatever_happens() -> None:
    clock = FakeClock()
    c = Collector(clock)
    clock.now += gc_policy.OVERDUE_S - 0.01
    assert c.quiet_due()
    assert not c.overdue()
    clock.now += 0.01
    assert c.overdue()
    c.collect()
    assert not c.overdue()
    assert not c.quiet_due()
    assert c.report()["passes"] == 1


async def test_the_simulator_collects_once_its_acks_are_on_the_wire(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One process stands for the whole cohort: its passes come once every rank has
    answered a SyncNow and the answers are flushed to the server, at most every EVERY_S."""
    clock = FakeClock()
    made = Collector(clock)
    happened: list[str] = []

    async def flush(**_: object) -> None:  # nats-py: flush(timeout=...)
        happened.append("flush")

    real_collect = made.collect
    monkeypatch.setattr(made, "collect", lambda: happened.append("collect") or real_collect())
    cohort = SimulatedCohort(SimpleNamespace(jetstream=lambda: None,  # type: ignore[arg-type]
                                             flush=flush), "sim", b"k" * 32, 64,
                             collector=made)
    sent: list[object] = []
    monkeypatch.setattr(cohort, "_emit", lambda r, msg, durable: sent.append(msg))
    clock.now += gc_policy.EVERY_S
    for r in cohort.ranks:
        cohort.handle(r, m.SyncNow())
    assert sum(isinstance(x, m.SyncAck) for x in sent) == 64
    assert happened == []  # not while the broadcast is being handled
    for _ in range(3):
        await asyncio.sleep(0)
    assert happened == ["flush", "collect"]  # the acks out first, once for the cohort
    assert made.passes == 1
    clock.now += gc_policy.EVERY_S / 2
    for r in cohort.ranks:  # the next average, too soon
        cohort.handle(r, m.SyncNow())
    for _ in range(3):
        await asyncio.sleep(0)
    assert made.passes == 1
