"""The decision core does per-message work independent of the number of ranks: a message
from one rank looks at that rank, not at all of them (the gate's search is amortized over
a window). Counted in calls, not timed."""

from __future__ import annotations

import pytest
from core_harness import UID, Core, records, sends

from ddpbus.codecs import messages as m
from ddpbus.orchestrator.core import window
from ddpbus.orchestrator.core.pools import Pool
from ddpbus.orchestrator.core.state import Command, Phase, RankState, State, Tick, Timing
from ddpbus.orchestrator.persist import snapshot


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


def test_a_burst_of_deaths_is_one_membership_change() -> None:
    """32 of 1,024 ranks die together (a rack): their last heartbeats land up to a beat
    apart, yet the coordinator declares them in one tick and rebuilds the communicator
    once, over the 992 survivors."""
    world, timeout = 1024, 30.0
    core = Core(world=world, heartbeat_timeout=timeout)
    for r in range(world):
        core.join(r, dataset=world * 8 * 40)
    core.feed(Timing(m.NewNcclIdGenerated(rank=0, uid_bytes=UID)))
    assert core.state.phase is Phase.TRAINING
    dead = set(range(100, 1024, 29))  # 32 ranks, spread over the cohort
    assert len(dead) == 32
    out: list[Command] = []
    for t in range(1, 40):  # a heartbeat a second; the dead stop somewhere in second 5
        for r in range(world):
            # half the rack beat once more in second 5, just before it died
            if r not in dead or t < 5 or (t == 5 and r % 2 == 0):
                core.feed(Timing(m.Heartbeat(rank=r, step_count=0)), at=t + r / world)
        for k in range(10):  # the shell's ticks, ten a second
            ticked = core.feed(Tick(), at=t + 1 + k / 10)
            for ask in sends(ticked, m.RequestNewNcclId):  # the generator answers at once
                ticked += core.feed(Timing(m.NewNcclIdGenerated(rank=ask.rank or 0,
                                                                uid_bytes=UID)))
            out += ticked
    declared = [s.msg.rank for s in sends(out, m.DeclareDead)]
    assert sorted(declared) == sorted(dead)
    assert len(records(out, "rank-dead")) == 32
    rebuilds = records(out, "session-rebuild")
    assert len(rebuilds) == 1, rebuilds
    assert len(rebuilds[0]["members"]) == world - 32
    assert len(sends(out, m.RequestNewNcclId)) == 1
    session = [s.msg for s in sends(out, m.NewNcclSession)]  # one session, told each member
    assert {(x.uid_bytes, x.new_world_size) for x in session} == {(UID, world - 32)}
    assert sorted(x.new_rank for x in session) == list(range(world - 32))
    assert {r.rank for r in core.state.alive} == set(range(world)) - dead


def test_a_lone_silent_rank_does_not_drag_the_quiet_ones_with_it() -> None:
    """The suspect margin applies only to ranks that have missed nearly the whole
    timeout: a rank a few beats late survives its peer's death."""
    core = Core(world=4, heartbeat_timeout=30.0)
    core.form()
    for t in range(1, 40):
        for r in (1, 2):
            core.feed(Timing(m.Heartbeat(rank=r, step_count=0)), at=float(t))
        if t < 25:
            core.feed(Timing(m.Heartbeat(rank=3, step_count=0)), at=float(t))
        out = core.feed(Tick(), at=t + 0.5)
        if sends(out, m.DeclareDead):
            break
    assert [s.msg.rank for s in sends(out, m.DeclareDead)] == [0]  # 3 is 6 s quiet: alive
    assert core.state.ranks[3].alive


def test_an_open_epoch_keeps_only_its_plans_in_flight() -> None:
    """Plans trained, reported and in the consensus are folded out of the epoch's pool (at
    1,024 ranks keeping them made a full snapshot's encoding grow from 22 to 172 ms over a
    30 s epoch): the pool holds what is in flight, however many windows the epoch lasts,
    and the epoch still aggregates and proves its coverage from every plan."""
    world = 16
    core = Core(world=world, epochs=1)
    for r in range(world):
        core.join(r, dataset=world * 8 * 400)  # 400 batches a rank: dozens of windows
    core.feed(Timing(m.NewNcclIdGenerated(rank=0, uid_bytes=UID)))
    pool = core.state.pools[0]
    peak, windows, out = 0, 0, []
    copied: object = None
    while core.state.phase is Phase.TRAINING:
        rounds = core.state.rounds
        for r in range(world):
            if not core.state.ranks[r].acked:
                out += core.ack(r)
            elif core.state.ranks[r].in_flight():
                out += core.train(r, 1)
        windows += core.state.rounds > rounds
        if pool.closed is None:
            peak = max(peak, len(pool.assignments))
            if windows == 10 and copied is None:  # mid-epoch, some plans folded
                copied = snapshot.untree(snapshot.tree(pool))
    assert windows >= 20
    assert peak <= 3 * world, peak  # plans in flight, not every plan of the epoch
    ledger = pool.ledger()  # (the epoch's, kept when it was compacted)
    assert ledger["exact"]
    assert ledger["chunks"] >= windows * world // 2  # every plan counted, folded or not
    [aggregated] = sends(out, m.EpochAggregated)
    metrics = aggregated.msg.metrics
    assert sum(metrics.per_rank_samples) == world * 400 * 8  # every chunk's metrics
    assert sum(metrics.per_rank_batch_share) == pytest.approx(1.0)
    # what was folded survives a snapshot (the coordinator's restart resumes from it)
    assert isinstance(copied, Pool)
    assert copied.folded.chunks > 0
    end = max(copied.folded.edges)
    assert copied.folded.edges == {0: 1, end: -1}  # here they tile a prefix: two entries
    assert copied.ledger()["trained"] == copied.folded.trained + sum(
        a.done for _, a in copied.assignments)
