"""The coordinator's decision core: ``transition(state, event, now) -> (state, commands)``.

Everything the coordinator decides happens here, and nothing else does: no I/O, no clock
(``now`` is handed in, in seconds), no randomness. The state is plain data that the core
owns and updates; feeding the same events with the same ``now`` values into a fresh
:func:`initial_state` always yields the same state and the same commands, which is what
replaying the stream after a crash relies on. An input that breaks a rule changes nothing
and yields a :class:`~ddpbus.orchestrator.core.state.Refuse` with the reason.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final

from ddpbus.codecs import messages as m
from ddpbus.codecs import subjects as sj
from ddpbus.orchestrator.core import duties, membership, rounds, session, settle, window
from ddpbus.orchestrator.core.bundle_meta import seed as seed_from_bundle
from ddpbus.orchestrator.core.elche import ElChe
from ddpbus.orchestrator.core.guard import TrendGuard
from ddpbus.orchestrator.core.state import (
    BusRestored,
    Command,
    CoreConfig,
    Disconnected,
    Event,
    IdWindow,
    Joined,
    Metrics,
    Phase,
    RankState,
    Reconnected,
    Record,
    Reduced,
    Refuse,
    State,
    Stop,
    Tick,
    Timing,
)


def initial_state(config: CoreConfig, now: float) -> State:
    s = config.schedule
    elche = ElChe(range(config.world_size), anchor=s.effective_anchor,
                  min_anchor=s.effective_min_anchor, max_anchor=s.max_anchor,
                  overhead_target=s.overhead_target, max_batch_diff=s.max_batch_diff,
                  growth=not s.is_sync, relax_up=s.effective_relax_up)
    guard = TrendGuard(threshold=s.effective_divergence_threshold, enabled=s.divergence_guard,
                       sync=s.is_sync)
    state = State(config=config, ranks=[RankState(rank=r) for r in range(config.world_size)],
                  elche=elche, guard=guard, created_at=now,
                  rank_compute_ms=[0.0] * config.world_size,
                  rank_busy_ms=[0.0] * config.world_size)
    state.meta.enabled = s.window_controller and not s.is_sync  # sync has no window
    seed_from_bundle(state)
    return state


def resume(state: State, coordinator_generation: int, now: float) -> State:
    """A snapshot's state taken over by a new coordinator incarnation at ``now``: ranks'
    silence while no coordinator listened is no evidence of death, and a session being
    minted gets a fresh deadline."""
    state.config = dataclasses.replace(state.config,
                                       coordinator_generation=coordinator_generation)
    _forgive_silence(state, now)
    return state


def _forgive_silence(state: State, now: float) -> None:
    """Nobody could be heard until ``now`` (no coordinator, or no broker): every live rank
    gets a full heartbeat timeout from here, and a session being minted a fresh deadline."""
    for r in state.alive:
        r.last_heard = max(r.last_heard, now)
        # a connection that closed while nobody listened may have come back unheard
        r.unplugged_at, r.unplugged_why = None, ""
    if state.rendezvous is not None:
        state.rendezvous.deadline = now + state.config.rendezvous_timeout_s
    if state.broker_round is not None:
        state.broker_round.deadline = now + state.schedule.snapshot_timeout.total_seconds()


def transition(state: State, event: Event, now: float) -> tuple[State, list[Command]]:
    out: list[Command] = []
    msg_id = getattr(event, "msg_id", "")
    misfiled = _misfiled(event)
    if misfiled is not None:
        out.append(Refuse("wrong-event", misfiled))
    elif msg_id and not first_delivery(state, msg_id):
        out.append(Refuse("duplicate-id", f"{type(event).__name__} {msg_id} was handled "
                          "before (a re-published copy)"))
    elif state.phase is Phase.DONE:
        if not _quiet_after_done(event):
            out.append(Refuse("run-over", f"{type(event).__name__} after the run ended"))
    else:
        _dispatch(state, event, now, out)
    for c in out:
        if isinstance(c, Refuse):
            state.refusals[c.reason] += 1
    return state, out


def _quiet_after_done(event: Event) -> bool:
    """The clock's ticks and an exiting rank's last heartbeats go on arriving while the
    shell winds down after the end; they ask for nothing, so they are not refusals."""
    return isinstance(event, Tick | Disconnected | Reconnected) or (
        isinstance(event, Timing) and isinstance(event.msg, m.Heartbeat))


#: The messages each message event may carry. The shell builds events from the subjects
#: the coordinator reads; a message of another family (a ControlMsg that reached the
#: timing intake) is refused here, before anything reads its fields.
_CARRIES: Final[dict[type[Event], tuple[Any, str]]] = {
    Timing: (m.TimingMsg, "TimingMsg"), Metrics: (m.MetricsMsg, "MetricsMsg"),
    Joined: (m.JoinMsg, "JoinMsg")}


def _misfiled(event: Event) -> str | None:
    allowed, family = _CARRIES.get(type(event), (object, ""))
    msg = getattr(event, "msg", None)
    if isinstance(msg, allowed):
        return None
    return f"a {type(event).__name__} event carrying a {type(msg).__name__}, not a {family}"


def _dispatch(state: State, event: Event, now: float, out: list[Command]) -> None:
    if isinstance(event, Timing):
        _timing(state, event.msg, now, out)
    elif isinstance(event, Metrics):
        r = _sender(state, event.msg.rank, "MetricsMsg", out)
        if r is not None:
            r.last_heard = now
            window.on_metrics(state, r, event.msg, now, out)
            window.maybe_average(state, now, out)
    elif isinstance(event, Joined):
        membership.on_join(state, event.msg, now, out)
        if state.phase is Phase.FORMING and state.broker and state.sessions:
            _begin_training(state, now, out)  # no communicator to wait for
    elif isinstance(event, Reduced):
        rounds.on_reduced(state, event, now, out)
    elif isinstance(event, Tick):
        _tick(state, now, out)
    elif isinstance(event, Stop):
        session.end_run(state, m.SaveReason.GRACEFUL_SHUTDOWN, event.reason, now, out)
    elif isinstance(event, Disconnected):
        membership.on_disconnected(state, event.connection, event.reason, now, out)
    elif isinstance(event, Reconnected):
        membership.on_reconnected(state, event.rank, out)
    elif isinstance(event, BusRestored):
        _forgive_silence(state, now)
        out.append(Record("bus-restored", {"away_s": round(event.away_s, 3)}))


def first_delivery(state: State, msg_id: str) -> bool:
    """Whether a stream message with this ``Nats-Msg-Id`` (``rank-N.g<gen>.<seq>``) is new.

    JetStream drops re-published copies inside its duplicate window (2 min); a publisher
    that re-sends its unacknowledged backlog after a longer broker outage can store a second
    copy, which this catches: per rank incarnation, the highest sequence seen and the lower
    ones not seen yet (:class:`IdWindow`; a sender's messages can reach the stream slightly
    out of order when a lost publish is re-sent). Never refuses a sequence it has not seen:
    an id it cannot parse, or an older incarnation's, is left to the other checks."""
    parsed = sj.parse_msg_id(msg_id)
    rank = None if parsed is None else sj.sender_rank(parsed.sender)
    if parsed is None or rank is None:
        return True
    w = state.seen_ids.get(rank)
    if w is None or parsed.generation > w.generation:
        state.seen_ids[rank] = IdWindow.first_seen(parsed.generation, parsed.seq)
        return True
    if parsed.generation < w.generation:
        return True
    return w.admit(parsed.seq)


def _sender(state: State, rank: int, what: str, out: list[Command]) -> RankState | None:
    r = state.rank(rank)
    if r is None or r.hello is None:
        out.append(Refuse("unknown-rank", f"{what} from rank {rank}, which was never admitted"))
        return None
    if r.dead:
        out.append(Refuse("dead-rank", f"{what} from rank {rank}, declared dead"))
        return None
    return r


def _tick(state: State, now: float, out: list[Command]) -> None:
    membership.check_formation(state, now, out)
    membership.check_rendezvous(state, now, out)
    rounds.check_deadline(state, now, out)
    if state.phase in (Phase.FORMING, Phase.TRAINING, Phase.FINISHING):
        membership.check_unplugged(state, now, out)
        membership.check_liveness(state, now, out)
        window.check_reduce_stall(state, now, out)
    session.maybe_done(state, now, out)


def _begin_training(state: State, now: float, out: list[Command]) -> None:
    state.phase = Phase.TRAINING
    state.training_started_at = now
    duties.initial_roles(state)
    out.append(Record("training-started", {"world_size": state.config.world_size,
                                           "total_batches": state.total_batches,
                                           "backend": (state.backend or m.Backend.GLOO).value}))
    window.open_window(state, now, out)


def _timing(state: State, msg: m.TimingMsg, now: float, out: list[Command]) -> None:
    r = _sender(state, msg.rank, type(msg).__name__, out)
    if r is None:
        return
    r.last_heard = now  # every timing frame is liveness, before anything else
    if isinstance(msg, m.Heartbeat):
        membership.on_connection(r, msg.connection, out)
        return
    if isinstance(msg, m.Exiting):
        membership.on_exiting(state, r, now, out)
        return
    if r.exited:
        out.append(Refuse("exited-rank", f"{type(msg).__name__} from rank {r.rank} after "
                          "its Exiting"))
        return
    if isinstance(msg, m.Batch | m.Reports):
        window.on_reports(state, r, msg, now, out)
    elif isinstance(msg, m.SyncAck):
        if window.on_sync_ack(state, r, msg, now, out):
            settle.settle(state, now, out)
        window.maybe_average(state, now, out)
    elif isinstance(msg, m.LrUpdate):
        r.lr = msg.lr
    elif isinstance(msg, m.NewNcclIdGenerated):
        if membership.on_new_id(state, msg, now, out) and state.phase is Phase.FORMING:
            _begin_training(state, now, out)
    else:
        _callback_timing(state, r, msg, now, out)


def _callback_timing(state: State, r: RankState, msg: m.TimingMsg, now: float,
                     out: list[Command]) -> None:
    if isinstance(msg, m.EvalResult):
        duties.on_eval_result(state, r, msg, now, out)
    elif isinstance(msg, m.CheckpointResult):
        duties.on_checkpoint_result(state, r, msg, now, out)
    elif isinstance(msg, m.EpochFnElapsed):
        duties.on_epoch_fn_elapsed(state, r, msg, out)
    elif isinstance(msg, m.Intent):
        duties.on_intent(state, r, msg, out)
    elif isinstance(msg, m.SnapshotReady) and state.broker:
        rounds.on_snapshot(state, r.rank, msg, now, out)
    elif isinstance(msg, m.SnapshotReady):
        backend = (state.backend or m.Backend.GLOO).value
        out.append(Refuse("no-broker-round", f"SnapshotReady from rank {r.rank}: backend "
                          f"{backend} averages in place, no parameter snapshot is pending"))
    else:  # pragma: no cover - every TimingMsg variant is handled above
        out.append(Refuse("unknown-variant", type(msg).__name__))
