"""The decision core does per-message work independent of the number of ranks: a message
from one rank looks at that rank, not at all of them (the gate's search is amortized over
a window). Counted in calls, not timed."""

from __future__ import annotations

import pytest
from core_harness import UID, Core

from ddpbus.codecs import messages as m
from ddpbus.orchestrator import window
from ddpbus.orchestrator.state import RankState, State, Timing


@pytest.mark.parametrize("world", [64, 512])
def test_the_gate_examines_a_bounded_number_of_ranks_per_batch(
        world: int, monkeypatch: pytest.MonkeyPatch) -> None:
    core = Core(world=world)
    for r in range(world):
        core.join(r, dataset=world * 8 * 40)
    core.feed(Timing(m.NewNcclIdGenerated(rank=0, uid_bytes=UID)))
    examined = 0  # ranks looked at: one per gate check, all of them per alive list
    real_check, real_alive = window._satisfied, State.alive

    def check(r: RankState) -> bool:
        nonlocal examined
        examined += 1
        return real_check(r)

    def alive(s: State) -> list[RankState]:
        nonlocal examined
        examined += len(s.ranks)
        return real_alive.fget(s)  # type: ignore[attr-defined,no-any-return]

    monkeypatch.setattr(window, "_satisfied", check)
    monkeypatch.setattr(State, "alive", property(alive))
    rounds_before, batches = core.state.rounds, 0
    for _ in range(25):  # every rank reports, in the scan's own order (its worst case)
        for r in range(world):
            if not core.state.ranks[r].acked:  # the average it was told to join
                core.ack(r)
            elif core.state.ranks[r].in_flight():
                core.train(r, 1)
                batches += 1
    assert batches >= 2 * world
    assert core.state.rounds - rounds_before >= 2  # windows opened and closed meanwhile
    # O(1) per batch plus O(world) per window: far below world per batch
    windows = core.state.rounds - rounds_before + 1
    assert examined <= 4 * batches + 2 * world * windows, (examined, batches, windows)
