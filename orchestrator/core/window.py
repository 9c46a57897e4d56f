"""Windows: batch bookkeeping, the averaging gate, SyncNow, and dispatch of the next window.

A *window* is the stretch between two averages. When it opens, every alive rank gets a
``target`` (the steps that satisfy the gate) and a ``budget`` (the steps it may take; larger
than the target only under async, by the lookahead), broadcast in SetGlobalStep, plus the
plans (StartEpoch) to train. The gate fires when the
previous average is acknowledged by every alive rank, every alive rank reached its target
(booked from its Batch reports), and at least one rank moved. Then:
SyncNow, El Che and the guard are updated inline (so the next window opens without waiting
for acks), epoch-boundary callbacks go out, and the next window opens.

The gate does not wait for MetricsMsg: a rank holds the metrics of the plan its closing
batch finished until its window is over (behind its next reports, or its share of the
report interval after its SyncAck: :mod:`ddpbus.orchestrator.core.coalesce`), so at a thousand
ranks the gate's last report is not queued behind a thousand metrics. An epoch is
aggregated (EpochAggregated) once its batches are trained and every plan's metrics are in,
or its rank died first (a ``metrics-lost`` record names the plan); eval and checkpoint
key on the batches (``Pool.trained``), and Shutdown waits for every epoch's aggregate.
"""

from __future__ import annotations

from collections.abc import Callable

from ddpbus.codecs import messages as m
from ddpbus.orchestrator.core import duties, rounds, session
from ddpbus.orchestrator.core.aggregate import aggregate_epoch
from ddpbus.orchestrator.core.elche import RankWindow, WindowReport, clamp_total
from ddpbus.orchestrator.core.pools import Pool, equal_split, proportional_split
from ddpbus.orchestrator.core.state import Command, Phase, RankState, Record, Refuse, Send, State

Out = list[Command]


# ---------------------------------------------------------------- bookkeeping


def on_batch(s: State, r: RankState, msg: m.Batch, now: float, out: Out) -> None:
    """Credit the batches since the rank's previous report (``step_count`` is the rank's
    monotonic local step, so a lost or coalesced report never skews the books)."""
    if s.phase not in (Phase.TRAINING, Phase.FINISHING):
        out.append(Refuse("batch-outside-training", f"rank {r.rank} reported a batch in "
                          f"phase {s.phase.value}"))
        return
    delta = msg.step_count - r.step
    if delta <= 0:
        out.append(Refuse("stale-batch", f"rank {r.rank} reported step {msg.step_count}, "
                          f"already at {r.step}"))
        return
    if delta > r.in_flight():
        out.append(Refuse("batch-without-plan", f"rank {r.rank} reported step "
                          f"{msg.step_count}: {delta} batches, {r.in_flight()} in flight"))
        return
    if delta > 1:
        out.append(Record("batch-reports-missing", {"rank": r.rank, "batches": delta - 1}))
    _credit(s, r, delta, now)
    if msg.batch_loss is not None:
        r.last_loss = msg.batch_loss
    _time(r, msg.batch_ms, msg.data_ms)
    if not r.acked:  # it may yet turn out to belong to the average pending (on_sync_ack)
        r.unacked_reports.append((r.step, msg.batch_ms, msg.data_ms))
    if r.steps > r.budget:
        out.append(Record("budget-exceeded", {"rank": r.rank, "steps": r.steps,
                                              "budget": r.budget}))
    if s.broker:
        rounds.maybe_throttle(s, out)


def _time(r: RankState, batch_ms: float, data_ms: float) -> None:
    """Book one report's timing in the open window (El Che's two scales, C.1.2)."""
    r.compute_ms += batch_ms
    if r.fill_ms is None:  # the window's first batch: its excess is the fill cost
        r.fill_ms = batch_ms + data_ms
    else:
        r.delivered_ms += batch_ms + data_ms
        r.delivered_batches += 1


def on_reports(s: State, r: RankState, msg: m.Batch | m.Reports, now: float, out: Out
               ) -> None:
    """A Batch, or coalesced per-batch reports: each item does exactly what it would do
    arriving alone (a Batch is booked and may open the gate, an LrUpdate is noted)."""
    lookahead = s.schedule.policy is m.Policy.ASYNC and s.schedule.effective_progressive
    for item in (msg,) if isinstance(msg, m.Batch) else msg.items:
        if isinstance(item, m.Batch):
            on_batch(s, r, item, now, out)
            if not _holds_gate(r):
                maybe_average(s, now, out)
            if lookahead and r.in_flight() == 0:
                _lookahead(s, r, now, out)
        else:
            r.lr = item.lr


def _credit(s: State, r: RankState, batches: int, now: float) -> None:
    """``batches`` more trained by ``r``, in plan order."""
    for _ in range(batches):
        head = next(a for a in r.queue if not a.complete)
        head.done += 1
    if s.first_batch_at is None:
        s.first_batch_at = now
    r.step += batches
    r.batches_total += batches
    r.steps = r.step - r.window_start


def on_metrics(s: State, r: RankState, msg: m.MetricsMsg, now: float, out: Out) -> None:
    head = next((a for a in r.queue if a.metrics is None), None)
    if (head is not None and not head.complete and head.epoch == msg.epoch
            and msg.batches_processed == head.size and r.in_flight() >= head.remaining):
        # the plan is done: its last Batch reports were lost on the way
        out.append(Record("batch-reports-missing", {"rank": r.rank,
                                                    "batches": head.remaining}))
        _credit(s, r, head.remaining, now)
    waiting = next((a for a in r.queue if a.complete and a.metrics is None
                    and a.epoch == msg.epoch), None)
    if waiting is None:
        out.append(Refuse("metrics-without-plan", f"rank {r.rank} sent metrics for epoch "
                          f"{msg.epoch} with no finished plan awaiting them"))
        return
    if msg.batches_processed != waiting.size:
        out.append(Record("metrics-mismatch", {"rank": r.rank, "epoch": msg.epoch,
                                               "reported": msg.batches_processed,
                                               "planned": waiting.size}))
    waiting.metrics = msg
    while r.queue and r.queue[0].complete and r.queue[0].metrics is not None:
        r.queue.popleft()
    aggregate_ready(s, now, out)
    if s.schedule.policy is m.Policy.ASYNC and s.schedule.effective_progressive:
        _lookahead(s, r, now, out)


def aggregate_ready(s: State, now: float, out: Out) -> None:
    """Aggregate epochs in ascending order, each once its pool is trained and reported."""
    compact = False
    while (pool := s.pools.get(s.next_aggregate)) is not None and pool.reported:
        pool.completed_at = now
        wall = None
        if s.schedule.effective_progressive and pool.first_dispatch_at is not None:
            wall = (now - pool.first_dispatch_at) * 1000.0
        devices = tuple(_device_index(r.hello.device if r.hello else "") for r in s.ranks)
        metrics = aggregate_epoch(pool.epoch, pool.chunks(), len(s.ranks), pool_wall_ms=wall,
                                  device_indices=devices, folded=pool.folded.sums)
        pool.aggregated = True
        for rank, ms in enumerate(metrics.per_rank_compute_only_ms):
            s.rank_compute_ms[rank] += ms
        for rank, ms in enumerate(metrics.per_rank_share_complete_ms):
            s.rank_busy_ms[rank] += ms
        if s.aggregated:  # only the latest epoch keeps its per-rank columns
            last = s.aggregated[-1]
            s.aggregated[-1] = m.EpochMetrics(epoch=last.epoch, avg_loss=last.avg_loss,
                                              epoch_ms=last.epoch_ms, scalars=last.scalars)
        s.aggregated.append(metrics)
        s.next_aggregate += 1
        out.append(Send(m.EpochAggregated(metrics=metrics)))
        out.append(Record("epoch-aggregated", {"epoch": pool.epoch, "loss": metrics.avg_loss,
                                               "epoch_ms": metrics.epoch_ms,
                                               "batch_share": list(metrics.per_rank_batch_share)}))
        compact = True
    if compact:  # (its metrics may come after the average that sealed it)
        compact_pools(s)
    duties.maybe_finish(s, now, out)


def _device_index(device: str) -> int:
    kind, _, index = device.partition(":")
    return int(index) if kind == "cuda" and index.isdigit() else (0 if kind == "cuda" else -1)


# ----------------------------------------------------------------------- gate


def _satisfied(r: RankState) -> bool:
    """Reached its target, or quiesced (nothing in flight: it joins with what it has), or
    throttled (it waits for this average). Its metrics may still be on the way."""
    return r.steps >= r.target or r.in_flight() == 0 or r.throttled


def _holdout(s: State, hint: int, ready: Callable[[RankState], bool]) -> RankState | None:
    """An alive rank not ``ready``, None when there is none. The search starts at ``hint``,
    the rank that held out last time: while it still does (the common case: a message
    from any other rank), this is O(1), and a window costs O(ranks) in all however the
    ranks report. The hint is only where to look: the answer never depends on it."""
    ranks = s.ranks
    n = len(ranks)
    for k in range(n):
        r = ranks[(hint + k) % n]
        if r.alive and not ready(r):
            return r
    return None


def _holds_gate(r: RankState) -> bool:
    """``r`` itself keeps the gate shut (alive, not ready): then no average can be called,
    and a report of its own need not look (one that makes it ready does)."""
    return r.alive and not (r.acked and _satisfied(r))


def _blocker(s: State) -> RankState | None:
    """An alive rank that holds the gate shut (unacknowledged, or not satisfied)."""
    r = _holdout(s, s.gate_hint, lambda r: r.acked and _satisfied(r))
    if r is not None:
        s.gate_hint = r.rank
    return r


def unacked(s: State) -> RankState | None:
    """An alive rank that has not answered the latest SyncNow."""
    r = _holdout(s, s.ack_hint, lambda r: r.acked)
    if r is not None:
        s.ack_hint = r.rank
    return r


def check_reduce_stall(s: State, now: float, out: Out) -> None:
    """The backstop (flodl D.5): an average sent ``reduce_stall_timeout`` ago that alive
    ranks still have not answered cannot settle (a dead peer is declared long before, and a
    hung collective fails at ``collective_timeout``): something is wedged that no rule here
    can undo. End the run, every rank saving, rather than wait for ever."""
    if s.settled_round >= s.rounds or s.sync_sent_at is None:
        return
    stalled = now - s.sync_sent_at
    limit = s.schedule.effective_reduce_stall_timeout.total_seconds()
    if stalled < limit:
        return
    holdout = unacked(s)
    if holdout is None:
        return  # every alive rank answered: settling is someone else's move
    session.end_run(s, m.SaveReason.REDUCE_STALL,
                    f"average {s.rounds} unsettled for {stalled:.0f}s (limit {limit:.0f}s): "
                    f"rank {holdout.rank} never answered it", now, out)


def maybe_average(s: State, now: float, out: Out) -> None:
    if s.phase is not Phase.TRAINING or s.rendezvous is not None or s.orphans:
        return  # (no collective while the communicator is being rebuilt)
    if _blocker(s) is not None:
        return
    alive = s.alive
    if not alive:
        return
    if any(r.steps > 0 for r in alive) or s.resync:
        sync(s, now, out)
    elif not _pool(s, s.epoch).trained and not any(r.in_flight() > r.target for r in alive):
        return  # no empty reduces, and nothing to move on to
    # (an epoch can end with nobody moved since the last average: under async a rank may
    # train its last batch just before the SyncNow that averages it in; then the boundary
    # and the next window follow without another reduce)
    duties.boundaries(s, now, out)
    open_window(s, now, out)


def sync(s: State, now: float, out: Out) -> None:
    """Broadcast SyncNow (or, on the broker backend, RequestParams) and finalise the
    window inline."""
    alive = s.alive
    s.rounds += 1
    if s.broker:
        rounds.request(s, now, out)
    else:
        out.append(Send(m.SyncNow()))
    s.sync_sent_at = now
    steps = {r.rank: r.steps for r in alive}
    s.global_step += sum(steps.values())
    duties.stage_boundary_slack(s)
    report = WindowReport(
        ranks={r.rank: RankWindow(steps=r.steps, compute_ms=r.compute_ms,
                                  delivered_ms=r.delivered_ms,
                                  delivered_batches=r.delivered_batches, fill_ms=r.fill_ms)
               for r in alive},
        reduce_ms=s.reduce_ms, use_delivered=not s.schedule.is_sync)
    s.elche.report_window(report)
    if s.pending_verdict is not None:
        s.elche.apply_verdict(s.pending_verdict)
        s.pending_verdict = None
    s.round_members, s.round_ok = tuple(steps), None
    s.round_moved, s.resync = s.resync or any(steps.values()), False
    for r in alive:
        r.acked, r.sync_step, r.window_start, r.throttled = False, r.step, r.step, False
        r.steps, r.compute_ms, r.delivered_ms, r.delivered_batches, r.fill_ms = 0, 0., 0., 0, None
        r.unacked_reports.clear()
    out.append(Record("average", {"round": s.rounds, "global_step": s.global_step,
                                  "steps": steps, "anchor": s.elche.anchor,
                                  "counts": dict(s.elche.counts),
                                  "overhead": s.elche.last_overhead}))
    duties.elect_roles(s, out)
    duties.retry_evals(s, out)
    duties.retry_checkpoints(s, out)


def on_sync_ack(s: State, r: RankState, msg: m.SyncAck, now: float, out: Out) -> bool:
    """Take one rank's SyncAck in; False (and a Refuse) for one with no average pending.
    The caller settles the round (:func:`~ddpbus.orchestrator.settle.settle`) after each
    accepted ack."""
    if r.acked:
        out.append(Refuse("unexpected-ack", f"SyncAck from rank {r.rank} with no average "
                          "pending for it"))
        return False
    r.acked = True
    if msg.failed:
        # the collective failed (a peer died or hung): this rank kept its own parameters
        # and carries its steps into the next average; a new communicator is needed
        s.resync = True
        s.round_ok = bool(s.round_ok)
        out.append(Record("average-failed", {"round": s.rounds, "rank": r.rank}))
    else:
        s.round_ok = True
        if s.round_moved:
            r.fresh = False  # the average handed it the consensus
        r.divergence, r.pre_norm, r.post_norm = msg.divergence, msg.pre_norm, msg.post_norm
    unreported = msg.step_count - r.step
    if 0 < unreported <= r.in_flight():  # Batch reports lost on the way: the ack tells
        out.append(Record("batch-reports-missing", {"rank": r.rank, "batches": unreported}))
        _credit(s, r, unreported, now)
    carried = msg.step_count - r.sync_step
    if carried > 0:
        # batches trained before the collective but reported after SyncNow (async
        # lookahead) belong to the average just done, not to the new window
        r.window_start = msg.step_count
        r.steps = max(0, r.step - r.window_start)
        r.target = min(r.target, r.steps + r.in_flight())
        s.global_step += carried
        # and their timing leaves the window with them: it is rebuilt from the reports
        # after the collective (El Che read the closed window at SyncNow; left here, the
        # carried batches would put an ordinary batch in the fill slot and skew the
        # next reading)
        r.compute_ms, r.delivered_ms, r.delivered_batches, r.fill_ms = 0., 0., 0, None
        for step, batch_ms, data_ms in r.unacked_reports:
            if step > msg.step_count:
                _time(r, batch_ms, data_ms)
    r.unacked_reports.clear()
    if not msg.failed:
        r.seal(msg.step_count)
    return True


def compact_pools(s: State) -> None:
    """Keep only the ledger of every epoch that is aggregated, served at its boundary and
    in the consensus everywhere (no rank holds an unsealed or unreported piece of it, so no
    death can reassign any of it); and of every other epoch, fold the plans that are
    settled and that no rank holds any more (:meth:`Pool.fold`): the state, and every
    snapshot of it, stays the size of the cohort and its work in flight, however long the
    run or the epoch."""
    held = [a for r in s.ranks for q in (r.history, r.queue) for a in q]
    open_epochs = {a.epoch for a in held}
    ids = {id(a) for a in held}
    for pool in s.pools.values():
        if pool.closed is not None:
            continue
        if pool.aggregated and pool.boundary_done and pool.epoch not in open_epochs:
            pool.compact()
        else:
            pool.fold(ids)


# ------------------------------------------------------------------- dispatch


def _pool(s: State, epoch: int) -> Pool:
    pool = s.pools.get(epoch)
    if pool is None:
        pool = s.pools[epoch] = Pool(epoch=epoch, total=s.total_batches)
    return pool


def _advance(s: State) -> bool:
    """Move ``s.epoch`` past trained epochs; False when no epoch is left to dispatch."""
    while True:
        pool = _pool(s, s.epoch)
        if not pool.trained:
            return True
        if s.epoch + 1 >= s.schedule.epochs:
            return False
        s.epoch += 1


def _give(s: State, r: RankState, size: int, now: float, *, stream: bool
          ) -> list[m.RankPlan]:
    """Give ``r`` up to ``size`` batches from the current epoch (and, with ``stream``, the
    following ones): the plans, in order (the caller decides how they travel)."""
    plans: list[m.RankPlan] = []
    given, epoch = 0, s.epoch
    while given < size and epoch < s.schedule.epochs:
        a = _pool(s, epoch).take(r.rank, size - given, now)
        if a is not None:
            r.give(a)
            given += a.size
            plans.append(m.RankPlan(rank=r.rank, plan=a.plan(s.schedule.batch_size)))
        if not stream:
            break
        epoch += 1
    return plans


def open_window(s: State, now: float, out: Out) -> None:
    more = _advance(s)
    if not more and not any(r.in_flight() for r in s.alive):
        duties.enter_finishing(s, now, out)
        return
    # (with no epoch left to dispatch, windows go on while reassigned work is in flight)
    pool = _pool(s, s.epoch)
    duties.announce_role(s, out)
    alive = s.alive
    counts = {r.rank: s.elche.counts.get(r.rank, s.elche.anchor) for r in alive}
    if s.schedule.is_sync:
        counts = dict.fromkeys(counts, 1)
    overshoot = s.schedule.overshoot(s.total_batches)
    progressive = s.schedule.effective_progressive
    plans: list[m.RankPlan] = []
    if progressive and more:
        plans = _dispatch_progressive(s, counts, now)
    elif more and pool.cursor == 0:
        plans = _dispatch_partitions(s, pool, now)
    for r in alive:
        in_flight = r.in_flight() if not r.fresh else 0
        r.target = min(counts[r.rank], in_flight)
        r.budget = min(in_flight, r.target + overshoot) if not progressive else \
            r.target + overshoot
    budgets = tuple(s.ranks[i].budget if s.ranks[i].alive else 0 for i in range(len(s.ranks)))
    # the window's plans ride in the broadcast that opens it (every rank reads control.all
    # anyway: a thousand ranks cost one message, not a thousand); on the broker path each
    # rank's rides in its Update instead, where a round is settling
    broadcast = () if s.broker else tuple(plans)
    out.append(Send(m.SetGlobalStep(global_step=s.global_step, step_budget=budgets,
                                    plans=broadcast)))
    if s.broker:
        out += rounds.fold_plans(s, plans)
    advise(s, plans, counts, out)


def advise(s: State, plans: list[m.RankPlan], counts: dict[int, int], out: Out) -> None:
    """StageAdvisory (flodl's data-staging hint), when a window starts an epoch: to each
    rank given work of it, El Che's counts (rank order; 0 for a rank not alive) and the
    epoch's spans in walk order, its own first, then the other ranks' (which it may be
    handed when they die or fall behind), for its data stager to read ahead. Once per
    epoch, not per window: at scale a per-rank message each window would cost what riding
    the plans in one broadcast saves."""
    fresh = sorted({p.plan.epoch for p in plans if p.plan.epoch > s.advised_epoch})
    if not fresh:
        return
    s.advised_epoch = fresh[-1]
    spans: dict[int, list[tuple[int, m.Span]]] = {}
    for p in plans:
        if p.plan.epoch in fresh:
            spans.setdefault(p.rank, []).append(
                (p.plan.epoch, m.Span(offset=p.plan.partition_offset,
                                      size=p.plan.partition_size)))
    order = tuple(counts.get(r.rank, 0) if r.alive else 0 for r in s.ranks)
    for rank, own in sorted(spans.items()):
        others = [x for other, theirs in sorted(spans.items()) if other != rank for x in theirs]
        # one segment per epoch for its own spans, then one per epoch for the others'
        segments = [m.Segment(epoch=e, spans=tuple(sp for ep, sp in part if ep == e))
                    for part in (own, others) for e in fresh if any(ep == e for ep, _ in part)]
        out.append(Send(m.StageAdvisory(counts=order, segments=tuple(segments)), rank=rank))


def _available(s: State, *, stream: bool) -> int:
    """Batches that can still be handed out: the current epoch's, and with ``stream`` the
    later epochs' too."""
    last = s.schedule.epochs if stream else s.epoch + 1
    return sum(s.pools[e].remaining if e in s.pools else s.total_batches
               for e in range(s.epoch, last))


def _dispatch_progressive(s: State, counts: dict[int, int], now: float
                          ) -> list[m.RankPlan]:
    stream = s.schedule.policy is m.Policy.ASYNC
    wants = {r.rank: max(0, counts[r.rank] - r.in_flight()) if not r.fresh else 0
             for r in s.alive}
    available = _available(s, stream=stream)
    if sum(wants.values()) > available:
        wants = clamp_total({r: w for r, w in wants.items() if w > 0}, available) | {
            r: 0 for r, w in wants.items() if w == 0}
    return [p for r in s.alive if wants[r.rank] > 0
            for p in _give(s, r, wants[r.rank], now, stream=stream)]


def _dispatch_partitions(s: State, pool: Pool, now: float) -> list[m.RankPlan]:
    """Non-progressive: the whole epoch at once, one consecutive slice per rank (C.7)."""
    ranks = [r.rank for r in s.alive if not r.fresh] or [r.rank for r in s.alive]
    if s.schedule.is_sync or not s.elche.calibrated:
        sizes = equal_split(pool.total, ranks)
    else:
        sizes = proportional_split(pool.total, {r: s.elche.smoothed_ms(r) for r in ranks})
    plans = []
    for rank in ranks:
        a = pool.take(rank, sizes[rank], now)
        if a is not None:
            s.ranks[rank].give(a)
            plans.append(m.RankPlan(rank=rank, plan=a.plan(s.schedule.batch_size)))
    return plans


def _lookahead(s: State, r: RankState, now: float, out: Out) -> None:
    """Async only: a rank that finished its plans before the window closes may run ahead,
    up to its budget (bounded overshoot)."""
    if s.phase is not Phase.TRAINING or not r.alive or r.in_flight() > 0:
        return
    room = r.budget - r.steps
    if room > 0:
        plans = _give(s, r, room, now, stream=True)
        out += [Send(m.StartEpoch(plan=p.plan), rank=r.rank) for p in plans]
        if plans:
            given = sum(p.plan.partition_size for p in plans) // s.schedule.batch_size
            out.append(Record("lookahead", {"rank": r.rank, "batches": given}))
