"""The core's liveness, stop and end rules, and its determinism (fake clock)."""

from __future__ import annotations

from core_harness import UID, Core, formed, records, refusals, sends

from ddpbus.codecs import messages as m
from ddpbus.orchestrator.core.state import (
    Command,
    CoreConfig,
    Finish,
    Phase,
    Stop,
    Tick,
    Timing,
)
from ddpbus.orchestrator.core.transition import initial_state

# ------------------------------------------------------------------- liveness


def test_silent_rank_is_declared_dead_exactly_once() -> None:
    core = formed()
    log: list[Command] = []
    for t in range(1, 80):
        log += core.feed(Timing(m.Heartbeat(rank=0, step_count=0)), at=float(t))
        log += core.feed(Tick(), at=t + 0.5)
    assert [f["rank"] for f in records(log, "rank-dead")] == [1]
    assert len(sends(log, m.ShutdownWithSave)) == 1
    assert core.state.ranks[1].dead
    finish = [c for c in log if isinstance(c, Finish)]
    assert len(finish) == 1
    assert not finish[0].ok


def test_rank_is_not_dead_at_the_timeout() -> None:
    core = formed()
    assert not records(core.feed(Tick(), at=30.0), "rank-dead")
    assert records(core.feed(Tick(), at=30.1), "rank-dead")


def test_heartbeat_refreshes_liveness() -> None:
    core = formed()
    core.feed(Timing(m.Heartbeat(rank=0, step_count=0)), at=20.0)
    core.feed(Timing(m.Heartbeat(rank=1, step_count=0)), at=20.0)
    assert not records(core.feed(Tick(), at=31.0), "rank-dead")
    assert core.state.phase is Phase.TRAINING


def test_any_timing_frame_refreshes_liveness() -> None:
    core = formed()
    core.now = 20.0
    core.train(0, 3)
    core.train(1, 3)
    assert not records(core.feed(Tick(), at=45.0), "rank-dead")


def test_rank_that_said_exiting_is_never_declared_dead() -> None:
    core = formed()
    core.feed(Stop())
    log = core.exiting(1, at=1.0)
    for t in range(2, 100):
        log += core.feed(Tick(), at=float(t))
    assert not records(log, "rank-dead")
    assert not core.state.ranks[1].dead


# ----------------------------------------------------------------- stop / end


def test_stop_sends_graceful_shutdown_with_save() -> None:
    core = formed()
    out = core.feed(Stop())
    assert [s.msg for s in sends(out, m.ShutdownWithSave)] == [
        m.ShutdownWithSave(reason=m.SaveReason.GRACEFUL_SHUTDOWN)]
    assert core.state.phase is Phase.DRAINING


def test_finish_once_every_rank_said_exiting() -> None:
    core = formed()
    core.feed(Stop())
    assert not any(isinstance(c, Finish) for c in core.exiting(0))
    out = core.exiting(1)
    assert sum(isinstance(c, Finish) for c in out) == 1
    assert core.state.phase is Phase.DONE


def test_finish_after_exit_timeout() -> None:
    core = formed()
    core.feed(Stop(), at=1.0)
    core.exiting(0, at=2.0)
    assert not any(isinstance(c, Finish) for c in core.feed(Tick(), at=30.5))
    out = core.feed(Tick(), at=31.5)
    finish = [c for c in out if isinstance(c, Finish)]
    assert len(finish) == 1
    assert "[1]" in finish[0].reason


def test_second_stop_sends_nothing() -> None:
    core = formed()
    core.feed(Stop())
    assert not sends(core.feed(Stop()), m.ShutdownWithSave)


def test_events_after_done_are_refused() -> None:
    core = formed()
    core.feed(Stop())
    core.exiting(0)
    core.exiting(1)
    for event in (Stop(), Timing(m.Batch(rank=0, batch_ms=1.0, data_ms=0.0, step_count=1))):
        out = core.feed(event)
        assert refusals(out) == ["run-over"]
        assert len(out) == 1


def test_ticks_and_last_heartbeats_after_done_are_not_refusals() -> None:
    """The shell's ticker and a rank's last heartbeats outlive the end by a moment."""
    core = formed()
    core.feed(Stop())
    core.exiting(0)
    core.exiting(1)
    before = dict(core.state.refusals)
    for event in (Tick(), Timing(m.Heartbeat(rank=0, step_count=0))):
        assert core.feed(event) == []
    assert dict(core.state.refusals) == before


def test_a_checkpoint_failed_in_the_last_window_moves_on_when_the_run_finishes() -> None:
    core = Core(policy="async", progressive=False, epochs=2, checkpoint_every=1)
    core.state = initial_state(CoreConfig(schedule=core.state.config.schedule, world_size=2,
                                          has_checkpoint_fn=True), 0.0)
    for rank in (0, 1):
        core.join(rank, dataset=24 * 8)  # 12 batches per rank and epoch
    core.feed(Timing(m.NewNcclIdGenerated(rank=0, uid_bytes=UID)))
    s = core.state
    while not s.pools[0].boundary_done:  # epoch 0; its boundary asks rank 0 for v1
        for r in s.ranks:
            core.train(r.rank, r.target - r.steps)
        core.ack(0)
        core.ack(1)
    assert s.epoch == 1
    for r in s.ranks:  # epoch 1's gate: the last average of the run
        core.train(r.rank, r.target)
    assert s.rounds == 3
    core.feed(Timing(m.CheckpointResult(rank=0, version=1, elapsed_ms=5.0,
                                        error="disk full")))
    # both train their last batch before the SyncNow reaches them: it is in that
    # average, so nobody moves after it and the run finishes without another one
    core.train(0, 1)
    core.train(1, 1)
    core.feed(Timing(m.SyncAck(rank=0, step_count=core.steps[0], divergence=0.01)))
    out = core.feed(Timing(m.SyncAck(rank=1, step_count=core.steps[1], divergence=0.01)))
    assert s.phase is Phase.FINISHING
    assert s.rounds == 3
    assert sorted((c.msg.version, c.rank) for c in sends(out, m.Checkpoint)) == [
        (1, 1), (2, 0)]  # v1 moved to the rank that has not tried it
    core.feed(Timing(m.CheckpointResult(rank=0, version=2, elapsed_ms=5.0)))
    out = core.feed(Timing(m.CheckpointResult(rank=1, version=1, elapsed_ms=5.0)))
    assert sends(out, m.Shutdown)


# -------------------------------------------------------------- determinism


def script(core: Core) -> list[Command]:
    log = core.form()
    log += core.train(0, 10, ms=2.0) + core.train(1, 10, ms=5.0)
    core.now = 0.5
    log += core.ack(0) + core.ack(1)
    log += core.train(0, 25, ms=2.0) + core.train(1, 4, ms=5.0)
    log += core.feed(Tick(), at=1.0)
    log += core.feed(Stop(), at=2.0)
    log += core.exiting(0, at=2.1) + core.exiting(1, at=2.2)
    return log


def test_same_events_yield_identical_commands() -> None:
    first, second = script(Core(now=0.0)), script(Core(now=0.0))
    assert repr(first) == repr(second)
    assert any(isinstance(c, Finish) for c in first)


def test_epoch_fn_elapsed_is_learnt_as_the_callbacks_cost_and_logged() -> None:
    """EpochFnElapsed: the coordinator keeps an EWMA of the epoch_fn's cost per rank (the
    slack El Che grants the rank that runs it at the next boundary) and logs each one."""
    core = formed()
    out = core.feed(Timing(m.EpochFnElapsed(rank=0, epoch=0, elapsed_ms=400.0)))
    assert records(out, "epoch-fn") == [{"rank": 0, "epoch": 0, "elapsed_ms": 400.0}]
    assert core.state.ranks[0].callback_ms["epoch_fn"] == 400.0
    core.feed(Timing(m.EpochFnElapsed(rank=0, epoch=1, elapsed_ms=200.0)))
    cost = core.state.ranks[0].callback_ms["epoch_fn"]
    assert 200.0 < cost < 400.0  # smoothed, not replaced
    assert "epoch_fn" not in core.state.ranks[1].callback_ms


def test_an_average_no_alive_rank_settles_ends_the_run_once_with_reduce_stall() -> None:
    """The reduce-stall backstop (flodl D.5): rank 1 keeps beating but never answers the
    SyncNow; past reduce_stall_timeout the run ends with ShutdownWithSave(REDUCE_STALL),
    once, and not a moment before."""
    core = formed(policy="cadence", progressive=False, heartbeat_timeout=5,
                  reduce_stall_timeout=60)
    s = core.state
    for r in s.ranks:
        core.train(r.rank, r.target - r.steps)
    assert s.rounds == 1
    sent = s.sync_sent_at
    assert sent is not None
    core.ack(0)
    out: list[Command] = []
    for t in range(1, 61):  # rank 1 alive all along (beats), silent about the average
        out += core.feed(Timing(m.Heartbeat(rank=1, step_count=core.steps[1])), at=sent + t)
        out += core.feed(Timing(m.Heartbeat(rank=0, step_count=core.steps[0])), at=sent + t)
        if t < 60:
            out += core.feed(Tick(), at=sent + t)
    assert not sends(out, m.ShutdownWithSave)  # 59 s: still waiting
    out = core.feed(Tick(), at=sent + 60.0)
    [stop] = sends(out, m.ShutdownWithSave)
    assert stop.msg.reason is m.SaveReason.REDUCE_STALL
    [aborted] = records(out, "run-aborted")
    assert aborted["reason"] == "REDUCE_STALL"
    assert "rank 1 never answered" in aborted["why"]
    assert s.outcome is not None
    assert not s.outcome[0]
    assert not sends(core.feed(Tick(), at=sent + 61.0), m.ShutdownWithSave)  # once


def test_the_reduce_stall_ceiling_defaults_to_flodls() -> None:
    from datetime import timedelta

    from ddpbus.orchestrator.core.config import schedule_from

    assert schedule_from({}).effective_reduce_stall_timeout == timedelta(seconds=300)
    assert schedule_from({"heartbeat_timeout": 60}).effective_reduce_stall_timeout == \
        timedelta(seconds=600)
