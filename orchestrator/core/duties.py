"""Callbacks on an elected rank: eval, checkpoint, epoch_fn, and the end.

One logical callback per event cluster-wide. The role is the rank pinned by the
``callback_rank`` knob, else the fastest: the lowest rank until El Che first calibrates,
then the fastest measured rank, sticky from then on. Eval and checkpoint run at an epoch
boundary, right after the average that closes the epoch, so they see the consensus model;
epoch_fn fires on the rank holding the epoch_fn role (told with SetEpochCallbackRole). A
checkpoint that fails moves to the next live rank that has not tried it, after the next
average (so it, too, sees a consensus). Callback time never enters speed estimates: ranks
stop their data clock while a callback runs, and the measured cost (EWMA, alpha 0.3) is
staged as slack so the callback's rank gets fewer batches in the window that follows.
"""

from __future__ import annotations

import math

from ddpbus.codecs import messages as m
from ddpbus.orchestrator.core import bundle_meta, session
from ddpbus.orchestrator.core.state import (
    Command,
    PendingCheckpoint,
    Phase,
    RankState,
    Record,
    Refuse,
    Send,
    State,
)

Out = list[Command]
EWMA_ALPHA = 0.3
SLACK_FLOOR_MS = 100.0


def _ewma(r: RankState, kind: str, elapsed_ms: float) -> None:
    old = r.callback_ms.get(kind)
    r.callback_ms[kind] = elapsed_ms if old is None else (
        EWMA_ALPHA * elapsed_ms + (1 - EWMA_ALPHA) * old)


# ---------------------------------------------------------------------- roles


def initial_roles(s: State) -> None:
    pinned = s.schedule.callback_rank
    first = pinned if pinned is not None else min(r.rank for r in s.alive)
    s.roles.epoch_fn = s.roles.eval = s.roles.checkpoint = first


def elect_roles(s: State, out: Out) -> None:
    """Once El Che has measured speeds, the fastest rank takes every role (sticky)."""
    if s.schedule.callback_rank is not None or s.roles.by_speed or not s.elche.calibrated:
        return
    fastest = s.elche.fastest(r.rank for r in s.alive)
    if fastest is None:
        return
    s.roles.by_speed = True
    s.roles.epoch_fn = s.roles.eval = s.roles.checkpoint = fastest
    out.append(Record("roles-elected", {"rank": fastest, "by": "fastest"}))


def announce_role(s: State, out: Out) -> None:
    if s.roles.announced != s.roles.epoch_fn:
        s.roles.announced = s.roles.epoch_fn
        out.append(Send(m.SetEpochCallbackRole(rank=s.roles.epoch_fn)))


# ------------------------------------------------------------------ boundaries


def _last_epoch(s: State, epoch: int) -> bool:
    return epoch + 1 >= s.schedule.epochs


def eval_due(s: State, epoch: int) -> bool:
    every = s.schedule.eval_every
    if not s.config.has_eval or every == 0:
        return False
    return (epoch + 1) % every == 0 or _last_epoch(s, epoch) or (
        m.IntentKind.EVAL_NOW in s.intents)


def checkpoint_due(s: State, epoch: int) -> bool:
    every = s.schedule.checkpoint_every
    return _last_epoch(s, epoch) or (every > 0 and (epoch + 1) % every == 0) or (
        m.IntentKind.CHECKPOINT_NOW in s.intents)


def bundle_due(s: State, epoch: int) -> bool:
    every = s.schedule.bundle_every
    return checkpoint_due(s, epoch) or (every > 0 and (epoch + 1) % every == 0)


def _closing_epochs(s: State) -> list[int]:
    """Epochs whose last batch is trained but whose boundary has not been served."""
    return [e for e, p in sorted(s.pools.items()) if p.trained and not p.boundary_done]


def stage_boundary_slack(s: State) -> None:
    """Before El Che recomputes the counts of the window after an epoch boundary, shrink the
    rank that will run that boundary's callbacks by their expected cost."""
    closing = _closing_epochs(s)
    if not closing:
        return
    epoch = closing[-1]
    costs: dict[int, float] = {}
    if eval_due(s, epoch):
        r = s.ranks[s.roles.eval]
        costs[r.rank] = costs.get(r.rank, 0.0) + r.callback_ms.get("eval", 0.0)
    if checkpoint_due(s, epoch) and s.config.has_checkpoint_fn:
        r = s.ranks[s.roles.checkpoint]
        costs[r.rank] = costs.get(r.rank, 0.0) + r.callback_ms.get("checkpoint", 0.0)
    if s.config.has_epoch_fn and not _last_epoch(s, epoch):
        r = s.ranks[s.roles.epoch_fn]
        costs[r.rank] = costs.get(r.rank, 0.0) + r.callback_ms.get("epoch_fn", 0.0)
    floor = max(0.05 * s.elche.anchor_wall_ms(), SLACK_FLOOR_MS)
    for rank, cost in costs.items():
        if cost > floor:
            s.elche.stage_slack(rank, cost)


def boundaries(s: State, now: float, out: Out) -> None:
    """Serve every epoch that the average just sent closed (eval, checkpoint, save)."""
    for epoch in _closing_epochs(s):
        s.pools[epoch].boundary_done = True
        if eval_due(s, epoch):
            dispatch_eval(s, epoch, out)
        if checkpoint_due(s, epoch):
            _dispatch_checkpoint(s, epoch + 1, out)
        if bundle_due(s, epoch):
            _dispatch_bundle(s, epoch, out)
        s.intents.clear()
        out.append(Record("epoch-boundary", {"epoch": epoch, "global_step": s.global_step}))


def dispatch_eval(s: State, epoch: int, out: Out) -> None:
    target = s.roles.eval
    if not s.ranks[target].alive:
        target = min(r.rank for r in s.alive)
    schedule_id = s.next_schedule_id
    s.next_schedule_id += 1
    s.evals[schedule_id] = (epoch, target)
    out.append(Send(m.ExecuteEvalCallback(schedule_id=schedule_id, epoch=epoch,
                                          target_rank=target), rank=target))


def _dispatch_checkpoint(s: State, version: int, out: Out) -> None:
    target = s.roles.checkpoint
    if not s.ranks[target].alive:
        target = min(r.rank for r in s.alive)
    if s.config.has_checkpoint_fn:
        s.checkpoints[version] = PendingCheckpoint(version=version, target=target)
        out.append(Send(m.Checkpoint(version=version, target_rank=target), rank=target))


def _dispatch_bundle(s: State, epoch: int, out: Out) -> None:
    """The checkpoint rank saves the consensus and writes resume bundle ``epoch + 1``."""
    target = s.roles.checkpoint
    if not s.ranks[target].alive:
        target = min(r.rank for r in s.alive)
    reason = "final" if _last_epoch(s, epoch) else bundle_meta.BOUNDARY
    s.last_bundle = epoch + 1
    out.append(Send(m.SaveConsensusModel(target_rank=target, version=epoch + 1,
                                         bundle_meta=bundle_meta.meta_json(s, epoch, reason)),
                    rank=target))
    out.append(Record("bundle", {"version": epoch + 1, "rank": target,
                                 "global_step": s.global_step}))


def retry_evals(s: State, out: Out) -> None:
    """Send again, right after an average (or once none comes any more), the evals whose
    rank died before answering: the heir then scores a consensus, as the boundary's eval
    would have, not its own parameters trained on since."""
    due, s.evals_due = s.evals_due, []
    for epoch in due:
        dispatch_eval(s, epoch, out)


def retry_checkpoints(s: State, out: Out) -> None:
    """Re-dispatch failed checkpoints right after an average (the new target sees a
    consensus); give up on a version once every live rank has tried it."""
    for version, pending in list(s.checkpoints.items()):
        if pending.target not in pending.tried:
            continue
        untried = [r.rank for r in s.alive if r.rank not in pending.tried]
        if not untried:
            del s.checkpoints[version]
            out.append(Record("checkpoint-abandoned", {"version": version,
                                                       "tried": sorted(pending.tried)}))
            continue
        pending.target = untried[0]
        out.append(Send(m.Checkpoint(version=version, target_rank=pending.target),
                        rank=pending.target))
        out.append(Record("checkpoint-failover", {"version": version, "rank": pending.target}))


# ------------------------------------------------------------------- results


def on_eval_result(s: State, r: RankState, msg: m.EvalResult, now: float, out: Out) -> None:
    pending = s.evals.get(msg.schedule_id)
    if pending is None or pending != (msg.epoch, r.rank):
        out.append(Refuse("unexpected-eval-result", f"EvalResult {msg.schedule_id} for epoch "
                          f"{msg.epoch} from rank {r.rank} matches no dispatched eval"))
        return
    del s.evals[msg.schedule_id]
    _ewma(r, "eval", msg.elapsed_ms)
    if msg.error is not None or not math.isfinite(msg.metric):
        out.append(Record("eval-failed", {"rank": r.rank, "epoch": msg.epoch,
                                          "error": msg.error or f"metric {msg.metric}"}))
    else:
        s.eval_history.append((msg.epoch, msg.metric))
        out.append(Send(m.EvalBroadcast(epoch=msg.epoch, metric=msg.metric)))
        out.append(Record("eval", {"rank": r.rank, "epoch": msg.epoch, "metric": msg.metric,
                                   "elapsed_ms": msg.elapsed_ms}))
    maybe_finish(s, now, out)


def on_checkpoint_result(s: State, r: RankState, msg: m.CheckpointResult, now: float,
                         out: Out) -> None:
    pending = s.checkpoints.get(msg.version)
    if pending is None or pending.target != r.rank or r.rank in pending.tried:
        out.append(Refuse("unexpected-checkpoint-result", f"CheckpointResult v{msg.version} "
                          f"from rank {r.rank} matches no dispatched checkpoint"))
        return
    _ewma(r, "checkpoint", msg.elapsed_ms)
    if msg.error is None:
        del s.checkpoints[msg.version]
        s.roles.checkpoint = r.rank  # sticky
        out.append(Record("checkpoint", {"rank": r.rank, "version": msg.version,
                                         "elapsed_ms": msg.elapsed_ms}))
    else:
        pending.tried.add(r.rank)
        out.append(Record("checkpoint-failed", {"rank": r.rank, "version": msg.version,
                                                "error": msg.error}))
        if s.phase is not Phase.TRAINING:
            retry_checkpoints(s, out)  # no average comes any more: models are consensus
    maybe_finish(s, now, out)


def on_epoch_fn_elapsed(s: State, r: RankState, msg: m.EpochFnElapsed, out: Out) -> None:
    _ewma(r, "epoch_fn", msg.elapsed_ms)
    out.append(Record("epoch-fn", {"rank": r.rank, "epoch": msg.epoch,
                                   "elapsed_ms": msg.elapsed_ms}))


def on_intent(s: State, r: RankState, msg: m.Intent, out: Out) -> None:
    s.intents.add(msg.kind)
    out.append(Record("intent", {"rank": r.rank, "kind": msg.kind.value}))


# ------------------------------------------------------------------------ end


def enter_finishing(s: State, now: float, out: Out) -> None:
    if s.phase is Phase.TRAINING:
        s.phase = Phase.FINISHING
        out.append(Record("finishing", {"global_step": s.global_step, "rounds": s.rounds}))
        # a checkpoint that failed while training waits for an average to move on, and
        # the run may finish without another one (under async, when nobody moved since
        # the last), nor an eval whose rank died: no average comes any more, the models
        # agree, so they move on now
        retry_evals(s, out)
        retry_checkpoints(s, out)
    maybe_finish(s, now, out)


def maybe_finish(s: State, now: float, out: Out) -> None:
    """Shutdown once the last average settled on every rank, every epoch aggregated and
    every callback answered."""
    if s.phase is not Phase.FINISHING:
        return
    if not all(r.acked for r in s.alive) or s.evals or s.evals_due or s.checkpoints:
        return
    if s.next_aggregate < s.schedule.epochs:
        return
    session.shutdown(s, now, out)
