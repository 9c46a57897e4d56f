"""Settling an averaging round, once every alive rank acknowledged its SyncNow.

The guard's verdict on the divergences the acks carried, the lost work of ranks that died
in the round, a new communicator after a failed collective, and the run's end when nothing
is left. It sits above :mod:`window` (which takes the acks in) and :mod:`recovery` (which
it calls), so that neither of those calls back up into the other.
"""

from __future__ import annotations

from ddpbus.orchestrator.core import duties, recovery
from ddpbus.orchestrator.core.state import Command, Phase, Record, State
from ddpbus.orchestrator.core.window import compact_pools, unacked

Out = list[Command]


def settle(s: State, now: float, out: Out) -> None:
    """Once every alive rank answered the latest SyncNow: the guard's verdict, the lost work
    of ranks that died in the round, a new communicator after a failed collective."""
    all_acked = unacked(s) is None
    if not all_acked or s.settled_round >= s.rounds:
        if s.orphans and all_acked:
            recovery.resolve_orphans(s, now, out)
        return
    alive = s.alive
    s.settled_at, s.settled_round = now, s.rounds
    s.reduce_ms = (now - (s.sync_sent_at or now)) * 1000.0
    if s.round_ok is False:
        out.append(Record("averaged", {"round": s.rounds, "failed": True}))
    else:
        members = set(s.round_members)
        movers = [x for x in alive if x.rank in members]
        divergences = [x.divergence for x in movers if x.divergence is not None]
        lrs = [x.lr for x in alive if x.lr is not None]  # the ranks' LrUpdate reports
        s.pending_verdict, why = s.meta.observe(
            s.guard.observe(divergences), lr=max(lrs) if lrs else None,
            anchor=s.elche.anchor, phase=s.elche.phase)
        if why:
            out.append(Record("window-nudge", {"round": s.rounds, "why": why,
                                               "factor": round(s.pending_verdict.factor, 4),
                                               "anchor": s.elche.anchor}))
        out.append(Record("averaged", {"round": s.rounds, "reduce_ms": s.reduce_ms,
                                       "divergence": max(divergences, default=0.0),
                                       "verdict": s.pending_verdict.verdict.value}))
    if s.orphans:
        recovery.resolve_orphans(s, now, out)
    if s.resync and s.rendezvous is None and s.phase in (Phase.TRAINING, Phase.FINISHING):
        recovery.rebuild(s, "a collective failed", now, out)
    compact_pools(s)
    duties.maybe_finish(s, now, out)
