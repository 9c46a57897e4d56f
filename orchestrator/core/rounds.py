"""The broker backend's averaging round: decisions only.

No tensor passes through here. A round, version ``v`` (= the round counter):

1. the gate fires (:func:`~ddpbus.orchestrator.core.window.sync`): RequestParams{v} goes to every
   rank, the window is finalised inline exactly like a SyncNow (the El Che counters are
   taken at trigger time, so batches trained while the round is in flight count toward the
   next window), and the next window opens at once: under async ranks train on while the
   round runs (and blend the consensus in: EASGD); under the barrier-paced policies (sync,
   cadence) they wait for the consensus, exactly as a collective would make them;
2. every rank snapshots its parameters, stores them premultiplied by its mass ``n^gamma``
   and answers SnapshotReady{v, mass, digest} (mass 0: declared, nothing stored);
3. once every alive member's snapshot is in, or the snapshot deadline passed (the late
   ranks' share is soft-aborted: they keep their parameters and carry their steps into the
   next round), :class:`~ddpbus.orchestrator.core.state.Reduce` asks the shell's reducer to sum
   exactly those contributions and divide once;
4. its :class:`~ddpbus.orchestrator.core.state.Reduced` becomes Update{v, realized, accepted}
   (under sync and cadence it carries each rank's next plan: one message instead of
   two, since the ranks wait for it anyway); each rank
   applies it and answers SyncAck, which settles the round as on the collective path.

A rank that dies mid-round simply has no snapshot (its mass is not accepted, its work goes
to the survivors) or has one (it is reduced like any other and its work is kept); either way
nobody waits on a communicator.
"""

from __future__ import annotations

from ddpbus.codecs import messages as m
from ddpbus.orchestrator.core.state import (
    BrokerRound,
    Command,
    Contribution,
    Record,
    Reduce,
    Reduced,
    Refuse,
    Send,
    State,
)

Out = list[Command]


def request(s: State, now: float, out: Out) -> None:
    """Open round ``s.rounds`` over the alive ranks."""
    members = tuple(r.rank for r in s.alive)
    s.broker_round = BrokerRound(version=s.rounds, members=members,
                                 deadline=now + s.schedule.snapshot_timeout.total_seconds())
    out.append(Send(m.RequestParams(version=s.rounds)))


def on_snapshot(s: State, rank: int, msg: m.SnapshotReady, now: float, out: Out) -> None:
    rd = s.broker_round
    if rd is None or msg.version != rd.version or rd.reducing:
        current = "none" if rd is None else f"{rd.version}{' (reducing)' if rd.reducing else ''}"
        out.append(Refuse("stale-snapshot", f"SnapshotReady for round {msg.version} from rank "
                          f"{rank}; the round collecting snapshots is {current}"))
        return
    if rank not in rd.members:
        out.append(Refuse("not-in-round", f"SnapshotReady from rank {rank}, which joined after "
                          f"round {rd.version} was requested"))
        return
    if rank in rd.ready:
        out.append(Refuse("duplicate-snapshot", f"rank {rank} already sent its snapshot for "
                          f"round {rd.version}"))
        return
    rd.ready[rank] = Contribution(rank=rank, mass=msg.mass, step=msg.step_count,
                                  digest=msg.digest, nbytes=msg.nbytes)
    maybe_reduce(s, now, out)


def maybe_reduce(s: State, now: float, out: Out) -> None:
    """Every alive member's snapshot is in (a dead member's is not waited for)."""
    rd = s.broker_round
    if rd is None or rd.reducing:
        return
    waiting = [r for r in rd.members if r not in rd.ready and s.ranks[r].alive]
    if not waiting:
        _reduce(s, rd, out)


def check_deadline(s: State, now: float, out: Out) -> None:
    """Soft abort of the late ranks' share: reduce what arrived."""
    rd = s.broker_round
    if rd is None or rd.reducing or now < rd.deadline:
        return
    late = [r for r in rd.members if r not in rd.ready and s.ranks[r].alive]
    s.snapshot_aborts += len(late)
    out.append(Record("snapshot-timeout", {"round": rd.version, "late": late,
                                           "ready": sorted(rd.ready)}))
    _reduce(s, rd, out)


def _reduce(s: State, rd: BrokerRound, out: Out) -> None:
    """Accept the snapshots that are in (no more can join: ``reducing``) and reduce them."""
    rd.reducing = True
    s.round_members = tuple(sorted(rd.ready))
    cmd = _command(s, rd)
    if cmd is None:  # nothing to average: every replica keeps its state
        _update(s, rd, realized=False, out=out)
        return
    out.append(cmd)
    out.append(Record("reduce", {"round": rd.version,
                                 "ranks": [c.rank for c in cmd.contributions],
                                 "mass": sum(c.mass for c in cmd.contributions),
                                 "bytes": sum(c.nbytes for c in cmd.contributions)}))


def _command(s: State, rd: BrokerRound) -> Reduce | None:
    """The accepted contributions with mass (the zero-mass ones were declared, not stored),
    in rank order."""
    movers = tuple(sorted((c for c in rd.ready.values() if c.mass > 0), key=lambda c: c.rank))
    return Reduce(version=rd.version, contributions=movers,
                  bf16=s.schedule.bf16_wire) if movers else None


def on_reduced(s: State, ev: Reduced, now: float, out: Out) -> None:
    rd = s.broker_round
    if rd is None or not rd.reducing or ev.version != rd.version:
        out.append(Refuse("stale-reduce", f"Reduced for round {ev.version}, no such round is "
                          "being reduced"))
        return
    ok, why = ev.ok, ev.detail
    if ok and not ev.digest:  # a shell bug: no rank could check what it applies
        ok, why = False, "the reducer named no consensus digest"
        out.append(Refuse("reduce-without-digest", f"Reduced for round {ev.version}: {why}"))
    if not ok:
        out.append(Record("reduce-failed", {"round": rd.version, "why": why}))
        s.round_members = ()
        _update(s, rd, realized=False, out=out)
        return
    for rank in rd.ready:  # a member that died after its snapshot is in the consensus
        r = s.ranks[rank]
        if not r.alive:
            r.seal(rd.ready[rank].step)
    _update(s, rd, realized=True, out=out, digest=ev.digest)


def _update(s: State, rd: BrokerRound, *, realized: bool, out: Out, digest: str = "") -> None:
    accepted = tuple(sorted(rd.ready)) if realized else ()
    targets = [r for r in rd.members if s.ranks[r].alive]
    if rd.plans:  # one Update per rank, each carrying that rank's next plan
        for rank in targets:
            out.append(Send(m.Update(version=rd.version, next_plan=rd.plans.get(rank),
                                     realized=realized, accepted=accepted, digest=digest),
                            rank=rank))
    else:
        out.append(Send(m.Update(version=rd.version, realized=realized, accepted=accepted,
                                 digest=digest)))
    out.append(Record("update", {"round": rd.version, "realized": realized,
                                 "accepted": list(accepted), "folded_plans": len(rd.plans)}))
    s.broker_round = None


def fold_plans(s: State, plans: list[m.RankPlan]) -> Out:
    """Under sync and cadence every rank waits for the Update: the next window's plan (one
    per rank) rides in it instead of in a message of its own (flodl's atomic dispatch).
    Returns the StartEpochs for the plans that cannot ride (async, no round settling, a
    rank outside the round, a second plan)."""
    rd = s.broker_round
    rest: Out = []
    for p in plans:
        if (rd is not None and s.schedule.policy is not m.Policy.ASYNC
                and p.rank in rd.members and p.rank not in rd.plans):
            rd.plans[p.rank] = p.plan
        else:
            rest.append(Send(m.StartEpoch(plan=p.plan), rank=p.rank))
    return rest


def maybe_throttle(s: State, out: Out) -> None:
    """C.6: with ``max_batch_diff = M`` and every rank alive, a rank more than M steps ahead
    of the slowest in this window waits for the next average (told once per window).
    Only ranks still training count: one with nothing in flight (its share of the epoch
    done: it waits for the gate anyway) or a fresh one (no work until it holds the
    consensus) stays at its steps for good, and measuring against it would throttle
    every rank that trains, one average per M + 1 steps, to the end of the epoch."""
    limit = s.schedule.max_batch_diff
    alive = s.alive
    if limit is None or s.schedule.is_sync or len(alive) != len(s.ranks):
        return
    training = [r for r in alive if not r.fresh and r.in_flight() > 0]
    if len(training) < 2:
        return
    low = min(r.steps for r in training)
    for r in training:
        if not r.throttled and r.steps > low + limit:
            r.throttled = True
            out.append(Send(m.Throttle(), rank=r.rank))
            out.append(Record("throttle", {"rank": r.rank, "steps": r.steps, "slowest": low,
                                           "max_batch_diff": limit}))


def pending_reduce(s: State) -> Reduce | None:
    """The reduce a coordinator that took over must run again: its predecessor decided it,
    and its Reduced never came (the reducer died with that process)."""
    rd = s.broker_round
    if rd is None or not rd.reducing:
        return None
    return _command(s, rd)
