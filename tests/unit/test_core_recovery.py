"""Elastic recovery in the pure core, against the simulated cohort (fake clock).

The simulator models the model's *content*: a batch counts once it went into a completed
average (``Sim.consensus``); a killed rank loses what it trained since its last average,
peers inside a collective with it fail and carry their batches to the next round. So
"every sample of every epoch is in the consensus exactly once" is checked for real, not
inferred from the coordinator's own books.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import pytest
from cluster_sim import Sim
from core_harness import UID, Core, formed, hello, records, sends

from ddpbus.codecs import messages as m
from ddpbus.orchestrator.core.config import schedule_from
from ddpbus.orchestrator.core.state import Joined, Phase, Timing
from ddpbus.orchestrator.core.summary import summarize

BATCH = 8
DATASET = 2400  # 300 batches per epoch
EPOCHS = 3


def make(policy: str = "cadence", progressive: bool | None = None, *,
         speeds: tuple[float, ...] = (2.0, 3.0, 4.0), knobs: dict[str, Any] | None = None,
         **options: Any) -> Sim:
    schedule = schedule_from({"policy": policy, "progressive": progressive,
                              "batch_size": BATCH, "epochs": EPOCHS,
                              "heartbeat_timeout": 2.0, **(knobs or {})})
    return Sim(schedule, speeds, dataset_size=DATASET, **options)


def every_batch_once(sim: Sim) -> None:
    per_epoch = DATASET // BATCH
    want = Counter({(e, b): 1 for e in range(EPOCHS) for b in range(per_epoch)})
    assert sim.consensus == want
    assert all(not r.unsealed for r in sim.ranks if not r.killed)
    # the coordinator's own ledger proves the same, from its books alone
    coverage = summarize(sim.state)["coverage"]
    assert coverage["exact"], coverage["violations"]
    assert coverage == {"exact": True, "epochs": EPOCHS, "batches": EPOCHS * per_epoch,
                        "resumed_epochs": 0, "violations": []}


SLOW = (10.0, 15.0, 20.0)  # ~5 s runs: a restart at 3 s finds work left
CASES = [("sync", False), ("cadence", False), ("cadence", True), ("async", False),
         ("async", True)]


def duration(policy: str, progressive: bool | None) -> float:
    clean = make(policy, progressive)
    clean.run()
    return clean.now


@pytest.mark.parametrize(("policy", "progressive"), CASES)
@pytest.mark.parametrize("share", [0.02, 0.5, 0.97])
def test_a_killed_rank_is_shrunk_around_and_every_batch_lands_once(
        policy: str, progressive: bool, share: float) -> None:
    sim = make(policy, progressive)
    sim.at(share * duration(policy, progressive), lambda: sim.kill(1))
    finish = sim.run()
    assert finish.ok, finish.reason
    assert [d["rank"] for d in sim.records("rank-dead")] == [1]
    assert [msg.rank for _, _, msg in sim.sent_of(m.DeclareDead)] == [1]
    sessions = sim.sent_of(m.NewNcclSession)
    assert {msg.new_world_size for _, _, msg in sessions} == {3, 2}
    assert [msg.initial for _, rank, msg in sessions if rank == 0] == [True, False]
    every_batch_once(sim)
    assert len(sim.state.aggregated) == EPOCHS
    assert not sim.sent_of(m.ShutdownWithSave)


def test_lost_work_goes_to_survivors_in_consecutive_slices() -> None:
    sim = make("cadence")
    sim.at(0.3, lambda: sim.kill(2))
    sim.run()
    [moved] = sim.records("work-reassigned")
    assert moved["rank"] == 2
    assert moved["to"] == [0, 1]
    extends = [(rank, msg) for _, rank, msg in sim.sent_of(m.ExtendPartition)]
    assert {rank for rank, _ in extends} == {0, 1}
    for epoch, offset, size in moved["ranges"]:
        parts = sorted((msg.partition_offset, msg.partition_size, rank)
                       for rank, msg in extends if msg.epoch == epoch
                       and offset * BATCH <= msg.partition_offset < (offset + size) * BATCH)
        assert parts[0][0] == offset * BATCH
        for (o1, n1, _), (o2, _, _) in itertools.pairwise(parts):
            assert o1 + n1 == o2  # consecutive
        assert sum(n for _, n, _ in parts) == size * BATCH
        sizes = [n for _, n, _ in parts]
        assert max(sizes) - min(sizes) <= BATCH  # equal split, remainder to the first
        if len(sizes) == 2:
            assert sizes[0] >= sizes[1]
    every_batch_once(sim)


def test_a_rank_dying_inside_the_collective_costs_one_failed_round() -> None:
    sim = make("cadence")
    # kill rank 1 right as it enters its first collective: the peers' collective fails
    orig = sim._enter_collective

    def enter(r: Any) -> None:
        orig(r)
        if r.rank == 1 and not sim.records("rank-dead") and not r.killed:
            sim.kill(1)
    sim._enter_collective = enter  # type: ignore[method-assign]
    finish = sim.run()
    assert finish.ok
    assert sim.records("average-failed")
    every_batch_once(sim)


def test_a_hung_rank_times_out_the_collective_then_is_declared_dead() -> None:
    sim = make("cadence")
    sim.at(0.5, lambda: sim.hang(0))
    finish = sim.run()
    assert finish.ok, finish.reason
    [dead] = sim.records("rank-dead")
    assert dead["rank"] == 0
    assert "silent" in dead["why"]
    every_batch_once_but_hung(sim, hung=0)


def every_batch_once_but_hung(sim: Sim, hung: int) -> None:
    # a hung rank's unaveraged batches never reached the consensus; it was fenced
    sim.ranks[hung].unsealed.clear()
    sim.ranks[hung].killed = True
    every_batch_once(sim)


def test_roles_and_a_pending_eval_fail_over_to_a_survivor() -> None:
    sim = make("cadence", has_eval=True)
    roles = sim.state.roles
    sim.at(0.35, lambda: sim.kill(roles.eval))
    finish = sim.run()
    assert finish.ok
    dead = sim.records("rank-dead")[0]["rank"]
    [moved] = sim.records("roles-failover")
    assert moved["from"] == dead
    assert set(moved["roles"]) == {"epoch_fn", "eval", "checkpoint"}
    assert dead not in (roles.eval, roles.checkpoint, roles.epoch_fn)
    evals = [rank for _, rank, _ in sim.sent_of(m.ExecuteEvalCallback)]
    assert evals
    assert evals[-1] != dead
    assert len(sim.state.eval_history) == EPOCHS  # every epoch's eval came back


@pytest.mark.parametrize(("knobs", "speeds", "reason"), [
    ({"max_failure": "1"}, (2.0, 3.0, 4.0), m.SaveReason.MAX_FAILURE_EXCEEDED),
    ({"max_failure": "33%"}, (2.0, 3.0, 4.0), m.SaveReason.MAX_FAILURE_EXCEEDED),
    ({"min_world": 2}, (2.0, 3.0), m.SaveReason.SINGLE_SURVIVOR),
    ({"min_world": 3}, (2.0, 3.0, 4.0), m.SaveReason.MAX_FAILURE_EXCEEDED),
])
def test_unrecoverable_losses_end_the_run_with_save(knobs: dict[str, Any],
                                                    speeds: tuple[float, ...],
                                                    reason: m.SaveReason) -> None:
    sim = make("cadence", speeds=speeds, knobs=knobs)
    sim.at(0.3, lambda: sim.kill(1))
    finish = sim.run()
    assert not finish.ok
    assert [msg.reason for _, _, msg in sim.sent_of(m.ShutdownWithSave)] == [reason]
    assert not sim.records("work-reassigned")


def test_tolerated_losses_under_a_percentage_limit() -> None:
    sim = make("cadence", knobs={"max_failure": "50%"}, speeds=(2.0, 3.0, 4.0, 5.0))
    sim.at(0.3, lambda: sim.kill(3))
    assert sim.run().ok  # 1 of 4 dead < ceil(0.5 * 4) = 2


def test_a_lone_survivor_finishes_by_default() -> None:
    sim = make("cadence", speeds=(2.0, 3.0))
    sim.at(0.3, lambda: sim.kill(0))
    finish = sim.run()
    assert finish.ok
    assert [msg.new_world_size for _, rank, msg in sim.sent_of(m.NewNcclSession)
            if rank == 1] == [2, 1]
    every_batch_once(sim)


def test_all_ranks_lost() -> None:
    sim = make("cadence", speeds=(2.0, 3.0))
    sim.at(0.3, lambda: (sim.kill(0), sim.kill(1)))
    finish = sim.run()
    assert not finish.ok
    assert [msg.reason for _, _, msg in sim.sent_of(m.ShutdownWithSave)] == [
        m.SaveReason.ALL_RANKS_LOST]


def test_simultaneous_deaths_are_one_membership_change() -> None:
    sim = make("cadence", speeds=(2.0, 3.0, 4.0, 5.0, 6.0))
    sim.at(0.3, lambda: (sim.kill(1), sim.kill(3)))
    assert sim.run().ok
    assert sorted(d["rank"] for d in sim.records("rank-dead")) == [1, 3]
    moved = sim.records("work-reassigned")
    assert all(set(x["to"]) == {0, 2, 4} for x in moved)  # nobody inherits a dead peer's work
    assert {msg.new_world_size for _, _, msg in sim.sent_of(m.NewNcclSession)} <= {5, 4, 3}
    every_batch_once(sim)


def test_a_dead_generator_is_replaced() -> None:
    sim = make("cadence")
    sim.at(0.3, lambda: sim.kill(2))
    # the rebuild's generator dies before answering: the next candidate mints the id
    orig = sim._handle
    killed: list[int] = []

    def handle(r: Any, msg: Any) -> None:
        if isinstance(msg, m.RequestNewNcclId) and sim.state.sessions == 1 and not killed:
            killed.append(r.rank)
            sim.kill(r.rank)
            return
        orig(r, msg)
    sim._handle = handle  # type: ignore[method-assign]
    finish = sim.run()
    assert finish.ok, finish.reason
    assert len(sim.records("rank-dead")) == 2
    every_batch_once(sim)


@pytest.mark.parametrize(("policy", "progressive"), CASES)
def test_a_restarted_rank_grows_back_into_the_run(policy: str, progressive: bool) -> None:
    sim = make(policy, progressive, speeds=SLOW)
    sim.at(0.2, lambda: sim.kill(1))
    sim.at(3.0, lambda: sim.restart(1))
    finish = sim.run()
    assert finish.ok, finish.reason
    [back] = sim.records("rank-rejoined")
    assert back["rank"] == 1
    assert back["generation"] == 2
    assert sim.ranks[1].batches > 0  # it trained again
    sizes = [msg.new_world_size for _, rank, msg in sim.sent_of(m.NewNcclSession) if rank == 0]
    assert sizes == [3, 2, 3]
    every_batch_once(sim)


def test_a_fast_restart_declares_the_old_incarnation_dead() -> None:
    sim = make("cadence")
    sim.at(0.3, lambda: sim.restart(2))  # back before the heartbeat timeout
    finish = sim.run()
    assert finish.ok
    [dead] = sim.records("rank-dead")
    assert dead["rank"] == 2
    assert "restarted" in dead["why"]
    assert sim.records("rank-rejoined")
    every_batch_once(sim)


def test_a_rejoiner_gets_work_only_after_it_received_the_consensus() -> None:
    sim = make("cadence", speeds=SLOW)
    sim.at(0.2, lambda: sim.kill(1))
    sim.at(3.0, lambda: sim.restart(1))
    sim.run()
    fresh = sim.ranks[1]
    first_plan = next(i for i, msg in enumerate(fresh.received)
                      if isinstance(msg, m.StartEpoch | m.ExtendPartition)
                      or (isinstance(msg, m.SetGlobalStep)
                          and any(p.rank == 1 for p in msg.plans)))
    first_sync = next(i for i, msg in enumerate(fresh.received) if isinstance(msg, m.SyncNow))
    assert first_sync < first_plan


def test_a_stale_incarnation_cannot_rejoin() -> None:
    sim = make("cadence")
    sim.at(0.2, lambda: sim.restart(1))

    def stale() -> None:
        from ddpbus.orchestrator.core.state import Joined
        sim.to_core(Joined(m.Hello(rank=1, generation=1, host="sim", device="cpu",
                                   model_signature=b"\x11" * m.MODEL_SIGNATURE_BYTES,
                                   world_size=3, backend="gloo", dataset_size=DATASET)))
    sim.at(0.5, stale)
    assert sim.run().ok
    assert len(sim.records("rank-rejoined")) == 1
    assert any("stale" in r["reason"] for r in sim.records("rank-rejected"))


def test_a_rank_leaving_gracefully_is_shrunk_around_without_counting_as_a_failure() -> None:
    sim = make("cadence", knobs={"max_failure": "1"})

    def leave() -> None:
        r = sim.ranks[2]
        r.exited = True
        sim.to_core(m_exiting(2))
    sim.at(0.3, leave)
    finish = sim.run()
    assert finish.ok
    assert not sim.records("rank-dead")
    assert [msg.rank for _, _, msg in sim.sent_of(m.DeclareDead)] == [2]


def m_exiting(rank: int) -> Any:
    from ddpbus.orchestrator.core.state import Timing
    return Timing(m.Exiting(rank=rank))


@pytest.mark.parametrize("restored", [True, False])
def test_silence_while_the_broker_was_away_is_no_death(restored: bool) -> None:
    from ddpbus.orchestrator.core.state import BusRestored, Record, Tick
    from ddpbus.orchestrator.core.transition import transition
    sim = make("cadence", speeds=SLOW)
    with pytest.raises(AssertionError, match="no Finish"):
        sim.run(until=1.0)  # training, every rank heard within the last second
    state, now = sim.state, sim.now + 5.0  # 5 s without a connection (timeout 2 s)
    out = []
    if restored:
        state, out = transition(state, BusRestored(away_s=5.0), now)
    state, ticked = transition(state, Tick(), now + 0.1)
    records = [c.event for c in [*out, *ticked] if isinstance(c, Record)]
    if restored:
        assert records == ["bus-restored"]
        assert all(now - r.last_heard <= 0.0 for r in state.alive)
    else:  # the same silence without the shell's word is taken for deaths
        assert "rank-dead" in records


def test_the_ledger_names_an_epoch_that_was_not_covered() -> None:
    sim = make("cadence")
    with pytest.raises(AssertionError, match="no Finish"):
        sim.run(until=0.5)
    coverage = summarize(sim.state)["coverage"]
    assert not coverage["exact"]
    assert [v["epoch"] for v in coverage["violations"]] == list(range(EPOCHS))[
        EPOCHS - len(coverage["violations"]):]
    assert all(v["trained"] < v["batches"] for v in coverage["violations"])


def test_a_rejoiner_left_alone_with_the_work_is_no_longer_fresh_and_finishes() -> None:
    core = formed(epochs=2)
    s = core.state
    for rank in (0, 1):
        core.train(rank, s.ranks[rank].target)
    for rank in (0, 1):
        core.ack(rank)
    core.feed(Joined(hello(1, generation=2)))  # rank 1 restarts: fresh, rank 0 holds
    core.steps[1] = 0  # (the new incarnation counts its steps from zero)
    core.feed(Timing(m.NewNcclIdGenerated(rank=0, uid_bytes=UID)))
    assert s.ranks[1].fresh
    adopted = core.exiting(0)  # the only holder leaves before an average reached rank 1
    assert sends(adopted, m.ExtendPartition)
    core.feed(Timing(m.NewNcclIdGenerated(rank=1, uid_bytes=UID)))
    r1 = s.ranks[1]
    assert not r1.fresh
    assert 0 < r1.target <= r1.budget  # (a fresh rank gets neither: the gate never opened)
    assert records(adopted, "fresh-adopted") == [{"rank": 0, "ranks": [1]}]
    for _ in range(100):  # it trains the lost work alone, average after average
        if s.phase is not Phase.TRAINING:
            break
        rounds = s.rounds
        core.train(1, max(1, r1.target - r1.steps))
        assert s.rounds > rounds  # the gate opened
        out = core.ack(1)
    assert sends(out, m.Shutdown)
    assert len(s.aggregated) == 2


def test_a_dead_rank_with_two_lost_ranges_in_one_epoch_is_no_coverage_violation() -> None:
    core = Core(world=3, epochs=1)
    core.form()
    s = core.state
    for rank in range(3):
        core.train(rank, s.ranks[rank].target)
    for rank in range(3):
        core.ack(rank)
    core.exiting(2)  # its unsealed range goes to ranks 0 and 1
    core.feed(Timing(m.NewNcclIdGenerated(rank=0, uid_bytes=UID)))
    out = core.exiting(0)  # its own unsealed range and the one it inherited
    [moved] = records(out, "work-reassigned")
    assert [epoch for epoch, _, _ in moved["ranges"]] == [0, 0]
    assert records(out, "coverage-violation") == []
    assert s.pools[0].coverage_gaps() == []


def test_an_eval_whose_rank_dies_is_sent_again_right_after_the_next_average() -> None:
    """The heir must score a consensus, as the boundary's eval would have, not its own
    parameters trained on since: the lost eval waits for the next SyncNow."""
    sim = make("cadence", has_eval=True)
    for r in sim.ranks:
        r.callback_ms = 150.0  # an eval is pending long enough to die during it
    died: list[tuple[float, int, int]] = []  # (time, rank, epoch of its pending eval)

    def kill_an_evaluator() -> None:
        if not died and sim.state.evals:
            [(epoch, rank)] = sim.state.evals.values()
            died.append((sim.now, rank, epoch))
            sim.kill(rank)
        elif not died:
            sim.at(sim.now + 0.005, kill_an_evaluator)

    sim.at(0.2, kill_an_evaluator)
    finish = sim.run()
    assert finish.ok, finish.reason
    [(killed_at, dead, epoch)] = died
    again = [(t, rank) for t, rank, msg in sim.sent_of(m.ExecuteEvalCallback)
             if msg.epoch == epoch and t > killed_at]
    [(sent_at, heir)] = again
    assert heir != dead
    declared = sim.records("rank-dead")[0]
    assert declared["rank"] == dead
    # not at the death: with the SyncNow of the next average, in the same decision
    syncs = [t for t, _, _ in sim.sent_of(m.SyncNow)]
    assert sent_at in syncs
    assert sorted(e for e, _ in sim.state.eval_history) == list(range(EPOCHS))
