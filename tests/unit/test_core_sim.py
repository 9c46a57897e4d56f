"""Whole runs of the real core against simulated ranks (cluster_sim): fake clock, no I/O."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from cluster_sim import Sim

from ddpbus.codecs import messages as m
from ddpbus.orchestrator.core.config import schedule_from
from ddpbus.orchestrator.core.state import Record, Send

BATCH = 8
POLICY_GRID = [(p, prog) for p in ("sync", "cadence", "async") for prog in (True, False)]


def make(policy: str = "cadence", progressive: bool | None = None, *,
         speeds: tuple[float, ...] = (2.0, 5.0), dataset: int = 645, epochs: int = 2,
         knobs: dict[str, Any] | None = None, **options: Any) -> Sim:
    schedule = schedule_from({"policy": policy, "progressive": progressive,
                              "batch_size": BATCH, "epochs": epochs, **(knobs or {})})
    return Sim(schedule, speeds, dataset_size=dataset, **options)


def ran(*args: Any, **kwargs: Any) -> Sim:
    sim = make(*args, **kwargs)
    sim.run()
    return sim


def index_of(sim: Sim, cls: type[Any]) -> list[int]:
    return [i for i, (_, _, msg) in enumerate(sim.sent) if isinstance(msg, cls)]


def last_trained(sim: Sim, epoch: int) -> float:
    return max(t for t, _, e, _ in sim.batch_log if e == epoch)


def boundary_averages(sim: Sim) -> dict[int, dict[str, Any]]:
    """epoch -> the average record that closed it (the one just before its boundary)."""
    out: dict[int, dict[str, Any]] = {}
    last: dict[str, Any] | None = None
    for c in sim.commands:
        if isinstance(c, Record) and c.event == "average":
            last = c.fields
        elif isinstance(c, Record) and c.event == "epoch-boundary" and last is not None:
            out[c.fields["epoch"]] = last
    return out


# --------------------------------------------------------------- every policy


@pytest.mark.parametrize(("policy", "progressive"), POLICY_GRID)
def test_every_batch_of_every_epoch_trained_exactly_once(policy: str,
                                                         progressive: bool) -> None:
    sim = ran(policy, progressive, epochs=3)
    total: Counter[tuple[int, int]] = Counter()
    for r in sim.ranks:
        total.update(r.trained)
    per_epoch = 645 // BATCH
    assert total == Counter({(e, b): 1 for e in range(3) for b in range(per_epoch)})


@pytest.mark.parametrize(("policy", "progressive"), POLICY_GRID)
def test_run_finishes_ok(policy: str, progressive: bool) -> None:
    sim = make(policy, progressive)
    finish = sim.run()
    assert finish.ok
    assert finish.reason == "completed"


@pytest.mark.parametrize(("policy", "progressive"), POLICY_GRID)
def test_shutdown_is_last_and_follows_every_ack(policy: str, progressive: bool) -> None:
    sim = ran(policy, progressive)
    shutdown_at, _, last = sim.sent[-1]
    assert isinstance(last, m.Shutdown)
    assert len(sim.sent_of(m.Shutdown)) == 1
    assert not sim.sent_of(m.ShutdownWithSave)
    syncs = len(sim.sent_of(m.SyncNow))
    assert sim.state.rounds == syncs
    acks = sim.timings_of(m.SyncAck)
    assert len(acks) == syncs * len(sim.ranks)
    assert all(t <= shutdown_at for t, _ in acks)
    assert Counter(a.rank for _, a in acks) == {r.rank: syncs for r in sim.ranks}


@pytest.mark.parametrize(("policy", "progressive"), POLICY_GRID)
def test_final_average_covers_the_trailing_steps(policy: str, progressive: bool) -> None:
    sim = ran(policy, progressive)
    last_sync = sim.sent_of(m.SyncNow)[-1][0]
    assert max(t for t, *_ in sim.batch_log) <= last_sync + sim.latency
    assert sim.state.global_step == 2 * (645 // BATCH)


@pytest.mark.parametrize(("policy", "progressive"), POLICY_GRID)
def test_no_empty_reduce(policy: str, progressive: bool) -> None:
    sim = ran(policy, progressive)
    assert all(sum(a["steps"].values()) > 0 for a in sim.records("average"))


@pytest.mark.parametrize(("policy", "progressive"), POLICY_GRID)
def test_no_rank_exceeds_its_budget(policy: str, progressive: bool) -> None:
    sim = ran(policy, progressive, epochs=3)
    assert sim.records("budget-exceeded") == []


@pytest.mark.parametrize(("policy", "progressive"), POLICY_GRID)
def test_protocol_following_ranks_are_never_refused(policy: str, progressive: bool) -> None:
    sim = ran(policy, progressive, has_eval=True, has_checkpoint_fn=True, has_epoch_fn=True)
    assert sim.refusals() == []


@pytest.mark.parametrize(("policy", "progressive"), POLICY_GRID)
def test_lost_batch_reports_cost_no_batch_and_no_wedge(policy: str, progressive: bool) -> None:
    sim = make(policy, progressive, lose_batch_report=lambda rank, step: step % 7 == 0)
    assert sim.run(until=120.0).ok
    total: Counter[tuple[int, int]] = Counter()
    for r in sim.ranks:
        total.update(r.trained)
    assert total == Counter({(e, b): 1 for e in range(2) for b in range(645 // BATCH)})
    assert sim.state.global_step == 2 * (645 // BATCH)
    # under sync every report ends its window (budget 1), so each is stored with an ack
    assert bool(sim.records("batch-reports-missing")) is (policy != "sync")


@pytest.mark.parametrize(("policy", "progressive"), POLICY_GRID)
def test_epochs_aggregated_in_order_exactly_once(policy: str, progressive: bool) -> None:
    sim = ran(policy, progressive, epochs=3)
    epochs = [msg.metrics.epoch for _, _, msg in sim.sent_of(m.EpochAggregated)]
    assert epochs == [0, 1, 2]


# -------------------------------------------------------------- heterogeneity


def test_cadence_gives_fast_rank_batches_in_proportion_to_speed() -> None:
    sim = ran("cadence", speeds=(2.0, 5.0), dataset=8000, epochs=3)
    fast, slow = (r.batches for r in sim.ranks)
    assert fast + slow == 3000
    assert fast / slow == pytest.approx(2.5, rel=0.2)


def test_sync_gives_equal_batches_and_fast_rank_idles() -> None:
    sim = ran("sync", speeds=(2.0, 5.0), dataset=8000, epochs=3)
    fast, slow = sim.ranks
    assert fast.batches == slow.batches == 1500
    # both wait out the control round trip; the fast rank also waits 3 ms per step
    assert fast.idle_ms - slow.idle_ms == pytest.approx((5.0 - 2.0) * 1500, rel=0.05)
    assert fast.idle_ms > 3 * slow.idle_ms


# ------------------------------------------------------------------ callbacks


@pytest.mark.parametrize(("policy", "progressive"), [("sync", False), ("cadence", True),
                                                     ("cadence", False)])
def test_eval_dispatched_right_after_the_average_closing_each_epoch(policy: str,
                                                                    progressive: bool) -> None:
    sim = ran(policy, progressive, epochs=3, has_eval=True)
    syncs = index_of(sim, m.SyncNow)
    for epoch in range(3):
        [i] = [i for i, (_, _, msg) in enumerate(sim.sent)
               if isinstance(msg, m.ExecuteEvalCallback) and msg.epoch == epoch]
        closing = max(j for j in syncs if j < i)
        assert sim.sent[closing][0] == sim.sent[i][0]  # same decision
        first_after = min(j for j in syncs if sim.sent[j][0] > last_trained(sim, epoch))
        assert closing == first_after
        assert not [j for j, (_, _, msg) in enumerate(sim.sent[:i])
                    if isinstance(msg, m.StartEpoch) and msg.plan.epoch > epoch]


def test_eval_broadcast_follows_each_eval_result() -> None:
    sim = ran("cadence", epochs=3, has_eval=True)
    results = sim.timings_of(m.EvalResult)
    broadcasts = sim.sent_of(m.EvalBroadcast)
    assert [r.epoch for _, r in results] == [0, 1, 2]
    assert [(t, b.epoch, b.metric) for t, _, b in broadcasts] == [
        (t, r.epoch, r.metric) for t, r in results]


def test_roles_lowest_rank_until_calibrated_then_fastest() -> None:
    sim = ran("cadence", speeds=(5.0, 2.0), epochs=3, has_eval=True, has_epoch_fn=True)
    roles = [(i, msg.rank) for i, (_, _, msg) in enumerate(sim.sent)
             if isinstance(msg, m.SetEpochCallbackRole)]
    assert [rank for _, rank in roles] == [0, 1]
    assert roles[0][0] < index_of(sim, m.SyncNow)[0] < roles[1][0]
    assert sim.records("roles-elected") == [{"rank": 1, "by": "fastest"}]
    assert {msg.target_rank for _, _, msg in sim.sent_of(m.ExecuteEvalCallback)} == {1}


def test_roles_are_sticky_when_speeds_change() -> None:
    sim = make("cadence", speeds=(5.0, 2.0), dataset=2400, epochs=3, has_eval=True)

    def speed_up() -> None:
        sim.ranks[0].ms_per_batch = 0.5
    sim.at(0.3, speed_up)
    sim.run()
    assert sim.ranks[0].batches > sim.ranks[1].batches  # rank 0 did become the fastest
    assert len(sim.records("roles-elected")) == 1
    assert (sim.state.roles.eval, sim.state.roles.checkpoint, sim.state.roles.epoch_fn) == (
        1, 1, 1)
    assert [msg.rank for _, _, msg in sim.sent_of(m.SetEpochCallbackRole)] == [0, 1]


def test_pinned_callback_rank_holds_every_role() -> None:
    sim = ran("cadence", epochs=2, has_eval=True, has_checkpoint_fn=True,
              knobs={"callback_rank": 1})
    assert sim.records("roles-elected") == []
    assert {msg.target_rank for _, _, msg in sim.sent_of(m.ExecuteEvalCallback)} == {1}
    assert {msg.target_rank for _, _, msg in sim.sent_of(m.Checkpoint)} == {1}
    assert [msg.rank for _, _, msg in sim.sent_of(m.SetEpochCallbackRole)] == [1]


def test_failed_checkpoint_moves_to_the_next_rank() -> None:
    sim = make("cadence", epochs=3, has_checkpoint_fn=True, knobs={"checkpoint_every": 1})
    sim.ranks[0].fail_checkpoint = True  # rank 0 is the fastest: it holds the role first
    assert sim.run().ok
    targets = [(msg.version, rank) for _, rank, msg in sim.sent_of(m.Checkpoint)]
    assert targets == [(1, 0), (1, 1), (2, 1), (3, 1)]
    assert sim.records("checkpoint-failover") == [{"version": 1, "rank": 1}]
    assert [r["rank"] for r in sim.records("checkpoint")] == [1, 1, 1]
    assert sim.state.roles.checkpoint == 1


def test_checkpoint_abandoned_when_every_rank_fails() -> None:
    sim = make("cadence", epochs=2, has_checkpoint_fn=True, knobs={"checkpoint_every": 1})
    for r in sim.ranks:
        r.fail_checkpoint = True
    finish = sim.run()
    assert finish.ok
    assert sim.records("checkpoint-abandoned") == [{"version": 1, "tried": [0, 1]},
                                                   {"version": 2, "tried": [0, 1]}]
    assert sim.records("checkpoint") == []


def test_slow_eval_shrinks_eval_ranks_count_after_the_boundary() -> None:
    slow = make("cadence", dataset=2400, epochs=3, has_eval=True)
    slow.ranks[0].callback_ms = 500.0  # rank 0 is the fastest: the eval rank
    slow.run()
    quick = ran("cadence", dataset=2400, epochs=3, has_eval=True)
    assert slow.state.roles.eval == 0
    assert boundary_averages(quick)[1]["counts"] == {0: 25, 1: 10}
    shrunk = boundary_averages(slow)[1]["counts"]
    assert shrunk[0] < 25
    assert shrunk[1] == 10
    # the window that follows the boundary gives the eval rank the shrunk count
    boundary = next(i for i, c in enumerate(slow.commands)
                    if isinstance(c, Record) and c.event == "epoch-boundary"
                    and c.fields["epoch"] == 1)
    opened = next(c.msg for c in slow.commands[boundary:]
                  if isinstance(c, Send) and isinstance(c.msg, m.SetGlobalStep))
    assert opened.step_budget[0] <= shrunk[0]


# ---------------------------------------------------------------------- async


def windows(sim: Sim) -> list[tuple[dict[int, int], dict[int, int], tuple[int, ...]]]:
    """Per averaged window: (El Che counts it opened with, steps at its SyncNow, budgets)."""
    anchor = sim.config.schedule.anchor
    counts = dict.fromkeys(range(len(sim.ranks)), anchor)
    budget: tuple[int, ...] = ()
    out = []
    for c in sim.commands:
        if isinstance(c, Send) and isinstance(c.msg, m.SetGlobalStep):
            budget = c.msg.step_budget
        elif isinstance(c, Record) and c.event == "average":
            out.append((counts, c.fields["steps"], budget))
            counts = c.fields["counts"]
    return out


def test_async_lookahead_overshoots_count_but_never_budget() -> None:
    sim = ran("async", dataset=2400, epochs=3)
    seen = windows(sim)
    assert sim.records("lookahead")
    assert any(steps[0] > counts[0] for counts, steps, _ in seen)
    assert all(steps[r] <= budget[r] for _, steps, budget in seen for r in steps)


def test_cadence_never_overshoots_its_count() -> None:
    sim = ran("cadence", dataset=2400, epochs=3)
    assert all(steps[r] <= counts[r] for counts, steps, _ in windows(sim) for r in steps)
    assert sim.records("lookahead") == []


# ------------------------------------------------------------------- liveness


def test_rank_gone_silent_is_declared_dead_once_and_the_run_aborts() -> None:
    # min_world=2 is the reference's rule: a lone survivor ends the run (SingleSurvivor)
    sim = make("cadence", dataset=2400, epochs=3, knobs={"min_world": 2})

    def hang() -> None:
        sim.ranks[1].silent = True
    sim.at(0.2, hang)
    finish = sim.run()
    assert not finish.ok
    assert [d["rank"] for d in sim.records("rank-dead")] == [1]
    [(when, _, msg)] = sim.sent_of(m.ShutdownWithSave)
    assert msg.reason is m.SaveReason.SINGLE_SURVIVOR
    assert when == pytest.approx(0.2 + 30.0, abs=0.2)
    assert not sim.sent_of(m.Shutdown)


def test_same_cohort_same_run() -> None:
    first = ran("async", dataset=2400, epochs=2, has_eval=True)
    second = ran("async", dataset=2400, epochs=2, has_eval=True)
    assert repr(first.sent) == repr(second.sent)
    assert repr(first.commands) == repr(second.commands)
