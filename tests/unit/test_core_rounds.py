"""The broker backend's round in the pure core, with a fake clock."""

from __future__ import annotations

from typing import Any

import pytest
from core_harness import Core, records, refusals, sends

from ddpbus.codecs import messages as m
from ddpbus.codecs.errors import ConfigError
from ddpbus.orchestrator.core import rounds
from ddpbus.orchestrator.core.config import describe, schedule_from
from ddpbus.orchestrator.core.state import (
    Command,
    CoreConfig,
    Phase,
    Reduce,
    Reduced,
    Tick,
    Timing,
)
from ddpbus.orchestrator.core.transition import initial_state
from ddpbus.orchestrator.persist import snapshot

DIGEST = "SHA-256=abc"


def broker(world: int = 2, **knobs: Any) -> Core:
    core = Core(world=world, **{"backend": "broker", "anchor": 4, "heartbeat_timeout": 2.0,
                                "snapshot_timeout": 3.0, **knobs})
    core.admit_all()
    return core


def reduces(out: list[Command]) -> list[Reduce]:
    return [c for c in out if isinstance(c, Reduce)]


def update_of(out: list[Command]) -> m.Update:
    """The round's Update (one per rank under cadence: each may carry a folded plan)."""
    updates = sends(out, m.Update)
    assert updates
    first = updates[0].msg
    assert all((u.msg.realized, u.msg.accepted) == (first.realized, first.accepted)
               for u in updates)
    return first


def ready(core: Core, rank: int, *, version: int = 1, mass: float | None = None,
          at: float | None = None) -> list[Command]:
    r = core.state.ranks[rank]
    steps = r.sync_step - r.sealed
    mass = float(steps) if mass is None else mass
    return core.feed(Timing(m.SnapshotReady(rank=rank, version=version, mass=mass,
                                            step_count=r.sync_step,
                                            digest=DIGEST if mass else "",
                                            nbytes=100 if mass else 0)), at)


def tick(core: Core, at: float, *, beating: tuple[int, ...] = (0, 1)) -> list[Command]:
    """Heartbeats from ``beating`` at ``at``, then a tick."""
    for r in beating:
        core.feed(Timing(m.Heartbeat(rank=r, step_count=core.steps[r])), at)
    return core.feed(Tick(), at)


def to_gate(core: Core) -> list[Command]:
    """Train every rank to its target: the gate fires."""
    out: list[Command] = []
    for r in core.state.alive:
        out += core.train(r.rank, r.target)
    return out


def test_forming_needs_no_communicator_and_training_starts() -> None:
    core = Core(backend="broker")
    out = core.admit_all()
    assert not sends(out, m.RequestNewNcclId)
    assert records(out, "session-formed")[0]["backend"] == "broker"
    assert records(out, "training-started")
    assert sends(out, m.StartEpoch)


def test_the_gate_requests_params_and_opens_the_next_window_at_once() -> None:
    core = broker()
    out = to_gate(core)
    assert [s.msg.version for s in sends(out, m.RequestParams)] == [1]
    assert not sends(out, m.SyncNow)
    assert sends(out, m.SetGlobalStep)  # ranks train on while the round runs
    rd = core.state.broker_round
    assert rd is not None
    assert rd.members == (0, 1)
    assert not rd.reducing


def test_every_snapshot_in_reduces_exactly_those_then_update_and_acks_settle() -> None:
    core = broker()
    to_gate(core)
    assert not reduces(ready(core, 0))
    (cmd,) = reduces(ready(core, 1))
    assert cmd.version == 1
    assert [(c.rank, c.mass) for c in cmd.contributions] == [
        (0, 4.0), (1, 4.0)]
    out = core.feed(Reduced(version=1, ok=True, digest=DIGEST))
    update = update_of(out)
    assert update.realized
    assert update.accepted == (0, 1)
    # cadence: ranks wait for the consensus, so each one's next plan rides in its Update
    assert all(u.msg.next_plan is not None for u in sends(out, m.Update))
    assert core.state.broker_round is None
    core.ack(0)
    out = core.ack(1)
    assert records(out, "averaged")[0]["round"] == 1


@pytest.mark.parametrize(("case", "reason"), [
    ("old-version", "stale-snapshot"), ("twice", "duplicate-snapshot"),
    ("no-round", "stale-snapshot")])
def test_bad_snapshots_are_refused_and_change_nothing(case: str, reason: str) -> None:
    core = broker()
    if case != "no-round":
        to_gate(core)
    if case == "twice":
        ready(core, 0)
    before = snapshot.encode(snapshot.Snapshot(core.state, 0, [], 0, 0.0), b"k")
    out = ready(core, 0, version=7 if case == "old-version" else 1)
    assert refusals(out) == [reason]
    state_after = snapshot.Snapshot(core.state, 0, [], 0, 0.0)
    state_after.state.refusals.clear()
    decoded = snapshot.decode(before, b"k").state
    decoded.refusals.clear()
    assert snapshot.encode(snapshot.Snapshot(decoded, 0, [], 0, 0.0), b"k") == \
        snapshot.encode(state_after, b"k")


def reducing() -> Core:
    """A broker-backend core whose round 1 has both snapshots in and is being reduced."""
    core = broker()
    to_gate(core)
    ready(core, 0)
    ready(core, 1)
    return core


def test_the_update_names_the_consensus_digest_and_a_reduce_without_one_fails() -> None:
    out = reducing().feed(Reduced(version=1, ok=True, digest="SHA-256=consensus"))
    assert update_of(out).digest == "SHA-256=consensus"  # what each rank checks it fetched
    out = reducing().feed(Reduced(version=1, ok=True))  # no digest: no rank could check it
    assert refusals(out) == ["reduce-without-digest"]
    update = update_of(out)
    assert not update.realized
    assert (update.digest, update.accepted) == ("", ())
    assert records(out, "reduce-failed") == [
        {"round": 1, "why": "the reducer named no consensus digest"}]


def test_a_stale_reduced_is_refused() -> None:
    core = broker()
    to_gate(core)
    assert refusals(core.feed(Reduced(version=1, ok=True, digest=DIGEST))) == ["stale-reduce"]


def test_snapshot_deadline_soft_aborts_the_late_share_only() -> None:
    core = broker()
    to_gate(core)
    ready(core, 0)
    assert not reduces(tick(core, 1.5))
    assert not reduces(tick(core, 2.9))
    out = tick(core, 3.1)
    assert records(out, "snapshot-timeout")[0]["late"] == [1]
    (cmd,) = reduces(out)
    assert [c.rank for c in cmd.contributions] == [0]
    out = core.feed(Reduced(version=1, ok=True, digest=DIGEST))
    assert update_of(out).accepted == (0,)
    # the late rank kept its parameters: it says so, and carries its steps (no rebuild)
    core.ack(0)
    out = core.feed(Timing(m.SyncAck(rank=1, step_count=4, divergence=0.0, failed=True)))
    assert not sends(out, m.RequestNewNcclId)
    assert core.state.resync
    assert core.state.snapshot_aborts == 1


def test_no_snapshot_at_all_is_a_round_not_realized_without_a_reduce() -> None:
    core = broker()
    to_gate(core)
    tick(core, 1.5)
    out = tick(core, 3.1)
    assert not reduces(out)
    update = update_of(out)
    assert not update.realized
    assert update.accepted == ()


def test_a_failed_reduce_becomes_an_update_not_realized() -> None:
    core = reducing()
    out = core.feed(Reduced(version=1, ok=False, detail="digest mismatch"))
    assert records(out, "reduce-failed")[0]["why"] == "digest mismatch"
    assert not update_of(out).realized


def test_a_rank_dead_before_its_snapshot_is_not_waited_for_and_its_work_moves() -> None:
    core = broker(world=3)
    to_gate(core)
    ready(core, 0)
    ready(core, 1)
    out = tick(core, 2.6)  # rank 2 silent past the heartbeat timeout
    assert records(out, "rank-dead")[0]["rank"] == 2
    (cmd,) = reduces(out)  # at once, not at the snapshot deadline
    assert [c.rank for c in cmd.contributions] == [0, 1]
    core.feed(Reduced(version=1, ok=True, digest=DIGEST))
    core.ack(0)
    out = core.ack(1)
    moved = sends(out, m.ExtendPartition)
    # its 4 trained batches (not in the consensus) and the 4 of the window that opened
    assert sum(s.msg.partition_size for s in moved) == 8 * 8
    assert not sends(out, m.RequestNewNcclId)


def test_a_rank_dead_after_its_snapshot_keeps_its_work_in_the_consensus() -> None:
    core = broker(world=3)
    to_gate(core)
    for r in (0, 1, 2):
        ready(core, r)
    out = core.feed(Reduced(version=1, ok=True, digest=DIGEST))
    assert update_of(out).accepted == (0, 1, 2)
    assert records(tick(core, 2.6), "rank-dead")[0]["rank"] == 2
    core.ack(0)
    out = core.ack(1)
    # its 4 trained batches are in the consensus: only the next window's 4 move
    assert sum(s.msg.partition_size for s in sends(out, m.ExtendPartition)) == 4 * 8
    assert core.state.ranks[2].sealed == 4


def test_sync_folds_each_ranks_next_plan_into_its_update() -> None:
    core = broker(policy="sync", progressive=True)
    out = to_gate(core)
    after = out[next(i for i, c in enumerate(out) if c in sends(out, m.RequestParams)):]
    assert not sends(after, m.StartEpoch)
    ready(core, 0)
    ready(core, 1)
    out = core.feed(Reduced(version=1, ok=True, digest=DIGEST))
    updates = sends(out, m.Update)
    assert sorted(u.rank for u in updates) == [0, 1]  # type: ignore[type-var]
    assert all(u.msg.next_plan is not None for u in updates)
    assert records(out, "update")[0]["folded_plans"] == 2


def test_async_trains_on_during_the_round_and_gets_one_broadcast_update() -> None:
    core = broker(policy="async")
    out = to_gate(core)
    request = out.index(sends(out, m.RequestParams)[0])
    assert sends(out[request:], m.StartEpoch)  # the next window's plans go out at once
    ready(core, 0)
    ready(core, 1)
    out = core.feed(Reduced(version=1, ok=True, digest=DIGEST))
    (update,) = sends(out, m.Update)
    assert update.rank is None
    assert update.msg.next_plan is None


def test_throttle_holds_a_rank_too_far_ahead_once_per_window() -> None:
    core = broker(max_batch_diff=1, anchor=6)
    out = core.train(0, 1)
    assert not sends(out, m.Throttle)  # 1 ahead of the slowest: within max_batch_diff
    out = core.train(0, 1)
    (throttle,) = sends(out, m.Throttle)
    assert throttle.rank == 0
    assert records(out, "throttle")[0]["slowest"] == 0
    assert not sends(core.train(0, 1), m.Throttle)  # told once
    # the throttled rank counts as satisfied: the slow rank alone closes the window
    out = core.train(1, core.state.ranks[1].target)
    assert sends(out, m.RequestParams)
    assert not core.state.ranks[0].throttled


def run_paced(core: Core, pace: dict[int, int]) -> list[tuple[int, ...]]:
    """Train until the run finishes, rank r taking ``pace[r]`` batches per turn (never past
    its budget, never while throttled or while a round runs); every round is served at
    once. Returns each round's batches in flight per rank when it was requested."""
    s = core.state
    rounds: list[tuple[int, ...]] = []
    for _ in range(1000):
        if s.phase is not Phase.TRAINING:
            return rounds
        rd = s.broker_round
        if rd is not None:
            rounds.append(tuple(r.in_flight() for r in s.ranks))
            for r in s.alive:
                ready(core, r.rank, version=rd.version)
            core.feed(Reduced(version=rd.version, ok=True, digest=DIGEST))
            for r in s.alive:
                core.ack(r.rank)
            continue
        for rank, batches in pace.items():
            r = s.ranks[rank]
            for _ in range(batches):
                if (r.steps < r.budget and r.in_flight() and not r.throttled
                        and s.broker_round is None):
                    core.train(rank, 1, ms=1.0 / batches)
    raise AssertionError("the run did not finish")


def test_a_rank_with_nothing_in_flight_throttles_nobody() -> None:
    core = broker(progressive=False, max_batch_diff=3, epochs=1, anchor=10)
    rounds = run_paced(core, {0: 1, 1: 3})
    # rank 0 ran out of its half of the epoch first; rank 1's last 16 batches are one
    # window, not one average per max_batch_diff + 1 steps
    assert rounds[-1] == (0, 16)
    assert core.state.rounds == len(rounds) + 1  # (the last one: the run is finishing)
    assert core.state.phase is Phase.FINISHING


def test_a_coordinator_that_takes_over_mid_reduce_knows_to_reduce_again() -> None:
    core = broker()
    to_gate(core)
    assert rounds.pending_reduce(core.state) is None
    ready(core, 0)
    ready(core, 1)
    data = snapshot.encode(snapshot.Snapshot(core.state, 5, [], 1, 0.0), b"k")
    again = rounds.pending_reduce(snapshot.decode(data, b"k").state)
    assert again is not None
    assert [c.rank for c in again.contributions] == [0, 1]


def test_snapshot_ready_on_a_collective_backend_is_refused() -> None:
    core = Core(backend="gloo")
    core.form()
    out = core.feed(Timing(m.SnapshotReady(rank=0, version=1)))
    assert refusals(out) == ["no-broker-round"]


@pytest.mark.parametrize(("knobs", "text"), [
    ({"easgd_alpha": 0.5}, "needs backend broker"),
    ({"easgd_alpha": 0.5, "backend": "broker", "policy": "sync"}, "policy sync"),
    ({"bf16_wire": True, "backend": "gloo"}, "bf16_wire needs backend broker"),
    ({"easgd_alpha": 0, "backend": "broker"}, "(0, 1]"),
    ({"snapshot_timeout": 0, "backend": "broker"}, "snapshot_timeout"),
])
def test_combinations_that_make_no_sense_are_refused_with_the_reason(
        knobs: dict[str, Any], text: str) -> None:
    with pytest.raises(ConfigError, match=text.replace("(", r"\(").replace("]", r"\]")):
        schedule_from(knobs)


def test_easgd_defaults_to_half_for_async_on_the_broker_only() -> None:
    assert schedule_from({"backend": "broker", "policy": "async"}).effective_easgd_alpha == 0.5
    assert schedule_from({"backend": "broker"}).effective_easgd_alpha == 1.0
    assert schedule_from({"policy": "async"}).effective_easgd_alpha == 1.0
    assert schedule_from({"backend": "broker", "policy": "async",
                          "easgd_alpha": 1}).run_config(64, 2).easgd_alpha == 1.0


def test_the_guard_threshold_defaults_to_0_3_under_easgd_only() -> None:
    easgd = schedule_from({"backend": "broker", "policy": "async"})
    assert easgd.divergence_threshold == 0.3  # resolved when the schedule is built
    assert describe(easgd)["divergence_threshold"] == 0.3
    assert initial_state(CoreConfig(schedule=easgd, world_size=2), 0.0).guard.threshold == 0.3
    for overwrite in ({"backend": "broker"}, {"policy": "async"},
                      {"backend": "broker", "policy": "async", "easgd_alpha": 1}):
        assert schedule_from(overwrite).divergence_threshold == 0.05
    assert schedule_from({"backend": "broker", "policy": "async",
                          "divergence_threshold": 0.1}).divergence_threshold == 0.1


def test_each_epochs_first_window_advises_every_rank_of_its_spans_own_first() -> None:
    """StageAdvisory, once per epoch: to each rank with work, El Che's counts and the
    epoch's spans, its own first; the epoch's later windows send none."""

    core = Core(policy="cadence", progressive=False, epochs=3)
    out = core.form()
    advisories = {c.rank: c.msg for c in sends(out, m.StageAdvisory)}
    plans = {p.rank: p.plan for c in sends(out, m.SetGlobalStep) for p in c.msg.plans}
    assert set(advisories) == set(plans) == {0, 1}
    for rank, advisory in advisories.items():
        assert len(advisory.counts) == 2
        own, other = advisory.segments
        assert own.epoch == other.epoch == 0
        assert own.spans == (m.Span(offset=plans[rank].partition_offset,
                                    size=plans[rank].partition_size),)
        theirs = plans[1 - rank]
        assert other.spans == (m.Span(offset=theirs.partition_offset,
                                      size=theirs.partition_size),)
    s = core.state
    seen: list[int] = []
    while s.epoch < 2:
        for r in s.ranks:
            out = core.train(r.rank, r.target - r.steps)
            seen += [c.msg.segments[0].epoch for c in sends(out, m.StageAdvisory)]
        for r in (0, 1):
            out = core.ack(r)
            seen += [c.msg.segments[0].epoch for c in sends(out, m.StageAdvisory)]
    assert seen == [1, 1, 2, 2]  # one per rank at each epoch's start, none in between
