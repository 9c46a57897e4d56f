"""Recovery: a rank's death (elastic shrink) and a restarted rank's return (grow-back).

A death, processed exactly once per incarnation:

1. the rank is marked dead; DeclareDead goes to every rank (survivors leave the process
   group, a dead-declared rank that still runs — SIGSTOP'd, partitioned — exits: fenced);
2. its callback roles move to the fastest survivor, a pending eval is re-dispatched, a
   pending checkpoint fails over;
3. the unrecoverable rules: ``max_failure`` ranks missing, or fewer than ``min_world``
   alive, end the run with ShutdownWithSave{MaxFailureExceeded | SingleSurvivor |
   AllRanksLost};
4. once the round it may have been part of is settled (every survivor answered the pending
   SyncNow), its *lost work* is computed: every batch it was given that is not in a completed
   average (not only the untrained remainder, as in the reference: batches it trained since
   its last average died with its parameters). Its assignments are cut to the part that is
   in the consensus, and the lost ranges go to the survivors as ExtendPartition, consecutive
   slices, the remainder to the first survivors. So each epoch's assignments still tile the
   epoch exactly once, with every sample's contribution in the consensus exactly once;
5. a new communicator is formed over the survivors (RequestNewNcclId -> NewNcclSession),
   and training goes on: survivors keep training inside their window meanwhile.

A rank restarted with a new generation is admitted back (grow-back) as a *fresh* member:
it gets no work until an average has handed it the consensus parameters (it joins the next
round with mass 0, which receives the consensus), then it is scheduled like any rank; if
every holder of the consensus leaves first, the fresh ranks are taken as they are. A
Hello from a new incarnation of a rank still believed alive declares the old one dead first.
"""

from __future__ import annotations

from ddpbus.codecs import messages as m
from ddpbus.orchestrator.core import duties, rounds, session, window
from ddpbus.orchestrator.core.pools import equal_split
from ddpbus.orchestrator.core.state import (
    Command,
    Phase,
    RankState,
    Record,
    Send,
    State,
)

Out = list[Command]
_ACTIVE = (Phase.FORMING, Phase.TRAINING, Phase.FINISHING)


# ---------------------------------------------------------------------- death


def declare_dead(s: State, r: RankState, why: str, now: float, out: Out, *,
                 cause: str = "silent") -> None:
    declare_dead_all(s, [(r, why)], now, out, cause=cause)


def declare_dead_all(s: State, dead: list[tuple[RankState, str]], now: float,
                     out: Out, *, cause: str = "silent") -> None:
    """Ranks found dead together (one tick) are all marked before any is processed, so
    none of them inherits another's lost work. ``cause``, for the record and the metric:
    ``silent`` (heartbeat timeout), ``disconnected`` (the broker's word), ``restarted``
    (a newer incarnation joined)."""
    dead = [(r, why) for r, why in dead if r.alive]  # exactly once per incarnation
    for r, why in dead:
        r.alive, r.dead, r.death = False, True, why
        s.deaths += 1
        out.append(Record("rank-dead", {"rank": r.rank, "why": why, "cause": cause,
                                        "generation": r.hello.generation if r.hello else 0,
                                        "host": r.hello.host if r.hello else "",
                                        "alive": [x.rank for x in s.alive]}))
    for r, _why in dead:
        if s.phase in (Phase.DRAINING, Phase.DONE):
            break
        lose(s, r, now, out)


def lose(s: State, r: RankState, now: float, out: Out) -> None:
    """``r`` left the cohort (dead, or exited mid-run): shrink around it."""
    out.append(Send(m.DeclareDead(rank=r.rank)))
    if s.alive:
        s.elche.set_ranks(x.rank for x in s.alive)
    reason = _unrecoverable(s)
    if reason is not None:
        code, text = reason
        session.end_run(s, code, f"rank {r.rank} lost: {text}", now, out)
        return
    _adopt_fresh(s, r, out)
    _fail_over_roles(s, r, out)
    if s.phase is not Phase.FORMING:
        s.orphans.append(r)
    if all(x.acked for x in s.alive):
        resolve_orphans(s, now, out)
    elif s.broker:
        rounds.maybe_reduce(s, now, out)  # a snapshot nobody will send is not waited for
    # otherwise the survivors are inside (or about to fail) the pending collective: the
    # dead rank's share of it is known, and the communicator rebuilt, once they answer


def _adopt_fresh(s: State, gone: RankState, out: Out) -> None:
    """The last rank holding the consensus left while every survivor is still *fresh*
    (rejoined, waiting for an average to hand it the consensus). Nobody can hand it over
    any more, and a fresh rank gets neither target nor budget, so no average would ever
    come: the gate would wait forever. So the survivors are taken as they are, the
    parameters they loaded on restart (the run's latest bundle), which is what on_rejoin
    decides for a rank that finds no holder alive: they become ordinary members, heirs
    of the lost work (reassigned below, so every epoch is still tiled exactly once) and
    scheduled like any rank. What this cannot give back is what the holders' later
    averages added after that bundle: the ledger keeps those batches sealed, exactly as
    when a rank rejoins with no holder alive."""
    alive = s.alive
    if not alive or any(not x.fresh for x in alive):
        return
    for x in alive:
        x.fresh = False
    out.append(Record("fresh-adopted", {"rank": gone.rank,
                                        "ranks": [x.rank for x in alive]}))


def _unrecoverable(s: State) -> tuple[m.SaveReason, str] | None:
    alive = len(s.alive)
    missing = sum(1 for x in s.ranks if x.dead)
    limit = s.schedule.failure_limit(s.config.world_size)
    if limit is not None and missing >= limit:
        return (m.SaveReason.MAX_FAILURE_EXCEEDED,
                f"{missing} ranks dead, max_failure={s.schedule.max_failure}")
    if alive == 0:
        return m.SaveReason.ALL_RANKS_LOST, "no rank is left"
    if alive < s.schedule.min_world:
        code = m.SaveReason.SINGLE_SURVIVOR if alive == 1 else m.SaveReason.MAX_FAILURE_EXCEEDED
        return code, f"{alive} ranks alive, min_world={s.schedule.min_world}"
    return None


def _fail_over_roles(s: State, dead: RankState, out: Out) -> None:
    candidates = [x.rank for x in s.alive if not x.fresh] or [x.rank for x in s.alive]
    heir = s.elche.fastest(candidates)
    heir = heir if heir is not None else min(candidates)
    roles = s.roles
    moved = [name for name in ("epoch_fn", "eval", "checkpoint")
             if getattr(roles, name) == dead.rank]
    for name in moved:
        setattr(roles, name, heir)
    if moved:
        out.append(Record("roles-failover", {"from": dead.rank, "to": heir, "roles": moved}))
    for schedule_id, (epoch, rank) in list(s.evals.items()):
        if rank == dead.rank:
            del s.evals[schedule_id]
            s.evals_due.append(epoch)
    for pending in s.checkpoints.values():
        if pending.target == dead.rank:
            pending.tried.add(dead.rank)
    if s.phase is not Phase.TRAINING:  # no average comes any more: models agree
        duties.retry_evals(s, out)
        duties.retry_checkpoints(s, out)


def resolve_orphans(s: State, now: float, out: Out) -> None:
    """Every survivor answered the round the dead ranks may have been in: cut their
    assignments to what is in the consensus, hand the rest to survivors, rebuild."""
    orphans, s.orphans = s.orphans, []
    reassigned = 0
    for r in orphans:
        if s.round_ok and r.rank in s.round_members and not r.acked:
            r.seal(r.sync_step)  # a survivor completed that all-reduce: r was in it
        reassigned += _reassign(s, r, _truncate(s, r, out), out)
    if reassigned and s.phase is Phase.FINISHING:
        s.phase = Phase.TRAINING
    window.aggregate_ready(s, now, out)  # an epoch may have waited only for lost metrics
    rebuild(s, f"ranks {[r.rank for r in orphans]} lost", now, out)


def _truncate(s: State, r: RankState, out: Out) -> list[tuple[int, int, int]]:
    """Cut the dead rank's assignments to their part in the consensus; return the rest as
    ``(epoch, batch offset, batches)``."""
    for a in r.queue:
        if a.metrics is None:
            a.orphaned = True  # its metrics will never come
            if a.complete and not any(a is h for h in r.history):
                # trained and all in the consensus (sealed), its metrics held behind the
                # SyncAck the rank never sent: the epoch aggregates without them (an
                # unsealed plan's batches go to heirs below, whose metrics cover them)
                out.append(Record("metrics-lost", {"rank": r.rank, "epoch": a.epoch,
                                                   "batches": a.size}))
    lost: list[tuple[int, int, int]] = []
    base = r.history_base
    for a in r.history:
        keep = min(max(r.sealed - base, 0), a.size)
        base += a.size
        if keep >= a.size:
            continue
        lost.append((a.epoch, a.offset + keep, a.size - keep))
        a.orphaned, a.metrics = True, None  # metrics, if any, covered the lost batches too
        if keep == 0:
            s.pools[a.epoch].drop(a)
        else:
            a.size = a.done = keep
    r.history.clear()
    r.queue.clear()
    return lost


def _reassign(s: State, dead: RankState, lost: list[tuple[int, int, int]], out: Out) -> int:
    heirs = [x.rank for x in s.alive if not x.fresh] or [x.rank for x in s.alive]
    batch = s.schedule.batch_size
    total = 0
    for epoch, offset, size in lost:
        pool = s.pools[epoch]
        at = offset
        for rank, n in sorted(equal_split(size, heirs).items()):
            if n == 0:
                continue
            s.ranks[rank].give(pool.reassign(rank, at, n))
            out.append(Send(m.ExtendPartition(epoch=epoch, partition_offset=at * batch,
                                              partition_size=n * batch), rank=rank))
            at += n
        total += size
    # (once every range is placed: an epoch's later lost range is a gap until its turn)
    for epoch in sorted({epoch for epoch, _, _ in lost}):
        gaps = s.pools[epoch].coverage_gaps()
        if gaps:  # pragma: no cover - would be a bookkeeping bug
            out.append(Record("coverage-violation", {"epoch": epoch, "gaps": gaps}))
    if lost:
        out.append(Record("work-reassigned", {
            "rank": dead.rank, "sealed_step": dead.sealed, "batches": total,
            "ranges": [list(x) for x in lost], "to": heirs}))
    return total


def rebuild(s: State, why: str, now: float, out: Out) -> None:
    """A new communicator over the alive ranks (none while one is being minted: its
    members are recomputed when the id arrives)."""
    if s.phase not in _ACTIVE:
        return
    if s.broker:  # no communicator to rebuild: averaging goes on with whoever is alive
        if s.resync and s.phase is Phase.FINISHING:
            s.phase = Phase.TRAINING  # the left-out steps get one more average
        after_session(s, now, out)
        return
    rv = s.rendezvous
    if rv is not None and s.ranks[rv.generator].alive:
        return
    if s.resync and s.phase is Phase.FINISHING:
        s.phase = Phase.TRAINING  # one more average, after which the run finishes again
    out.append(Record("session-rebuild", {"why": why, "members": [x.rank for x in s.alive]}))
    session.start_session(s, now, out)


def after_session(s: State, now: float, out: Out) -> None:
    """A communicator formed mid-run: averaging may go on."""
    window.maybe_average(s, now, out)
    duties.maybe_finish(s, now, out)


# ------------------------------------------------------------------- grow-back


def _joinable(s: State) -> bool:
    return s.phase in (Phase.TRAINING, Phase.FORMING)


def on_rejoin(s: State, r: RankState, hello: m.Hello, now: float, out: Out) -> None:
    """A restarted incarnation of ``r`` (higher generation) asks to come back."""
    if not _joinable(s):
        session.reject(hello, f"the run is {s.phase.value}; {session.NOT_JOINABLE}", out)
        return
    problem = session.cohort_problem(s, hello)
    if problem is not None:
        session.reject(hello, problem, out)
        return
    if r.alive:
        declare_dead(s, r, f"restarted as generation {hello.generation}", now, out,
                     cause="restarted")
        if not _joinable(s):
            session.reject(hello, "the run ended with the loss of the old incarnation",
                              out)
            return
    # fresh until an average hands it the consensus (unless nobody alive holds one)
    holders = [x for x in s.alive if x.rank != r.rank and not x.fresh]
    fresh = RankState(rank=r.rank, hello=hello, alive=True, last_heard=now,
                      fresh=s.sessions > 0 and bool(holders),
                      callback_ms=dict(r.callback_ms))
    s.ranks[r.rank] = fresh
    s.rejoins += 1
    session.accept(s, hello, out)
    out.append(Record("rank-rejoined", {"rank": r.rank, "generation": hello.generation,
                                        "host": hello.host, "pid": hello.pid,
                                        "alive": [x.rank for x in s.alive]}))
    s.elche.set_ranks(x.rank for x in s.alive)
    if not s.orphans:
        rebuild(s, f"rank {r.rank} rejoined", now, out)
