"""Membership: admission from hellos, communicator sessions, liveness and the run's end.

Pure functions over :class:`~ddpbus.orchestrator.core.state.State` that append commands to
``out``. A rank is admitted when its Hello agrees with the cohort (world size, model
signature, dataset size, a backend the cohort can share); when every rank is in, one rank is
asked to mint a communicator session id (RequestNewNcclId -> NewNcclIdGenerated ->
NewNcclSession to every member). A rank silent past the heartbeat timeout is
declared dead exactly once; one that said Exiting never is.
"""

from __future__ import annotations

import dataclasses
from typing import Final

from ddpbus.codecs import messages as m
from ddpbus.orchestrator.core import recovery, session
from ddpbus.orchestrator.core.state import (
    Command,
    Phase,
    RankState,
    Record,
    Refuse,
    Send,
    State,
)

Out = list[Command]
_JUDGED: Final = (Phase.FORMING, Phase.TRAINING, Phase.FINISHING)  # liveness is judged


def on_join(s: State, msg: m.Hello | m.Rejoin, now: float, out: Out) -> None:
    """A Hello (or a restarted rank's Rejoin): admission while the cohort gathers,
    grow-back once the run has formed."""
    hello = msg.hello if isinstance(msg, m.Rejoin) else msg
    r = s.ranks[hello.rank] if hello.rank < len(s.ranks) else None
    if r is not None and r.hello is not None and r.hello.generation == hello.generation:
        out.append(Refuse("duplicate-hello", f"rank {hello.rank} generation "
                          f"{hello.generation} is already admitted"))
        return
    if r is None:
        session.reject(hello, f"rank {hello.rank} is outside world size {s.config.world_size}",
                       out)
        return
    if r.hello is not None and hello.generation < r.hello.generation:
        session.reject(hello, f"stale incarnation: generation {r.hello.generation} already "
                       "joined", out)
        return
    if s.phase is not Phase.ADMITTING:
        recovery.on_rejoin(s, r, hello, now, out)
        return
    problem = session.cohort_problem(s, hello)
    if problem is not None:
        session.reject(hello, problem, out)
        return
    _admit(s, r, hello, now, out)


def _admit(s: State, r: RankState, hello: m.Hello, now: float, out: Out) -> None:
    if s.model_signature is None:
        s.model_signature = hello.model_signature
        s.dataset_size = hello.dataset_size
        s.total_batches = hello.dataset_size // s.schedule.batch_size
        s.elche.max_total = s.total_batches
        wanted = s.schedule.backend
        s.backend = session.CAPABLE[hello.backend] if wanted is m.Backend.AUTO else wanted
    r.hello, r.alive, r.last_heard = hello, True, now
    r.connection, r.unplugged_at, r.unplugged_why = "", None, ""  # an earlier Hello's
    backend = s.backend or m.Backend.GLOO
    run = s.schedule.run_config(s.dataset_size, s.config.world_size)
    s.run = dataclasses.replace(run, backend=backend)
    session.accept(s, hello, out)
    out.append(Record("rank-admitted", {"rank": hello.rank, "generation": hello.generation,
                                        "host": hello.host, "device": hello.device,
                                        "pid": hello.pid}))
    if all(x.alive for x in s.ranks):
        s.phase = Phase.FORMING
        session.start_session(s, now, out)


# ------------------------------------------------------------------ sessions


def on_new_id(s: State, msg: m.NewNcclIdGenerated, now: float, out: Out) -> bool:
    """True when a new session was sent to the members."""
    rv = s.rendezvous
    if rv is None:
        out.append(Refuse("no-rendezvous", f"NewNcclIdGenerated from rank {msg.rank} with no "
                          "session being minted"))
        return False
    if msg.rank != rv.generator:
        out.append(Refuse("not-generator", f"NewNcclIdGenerated from rank {msg.rank}, the "
                          f"elected generator is rank {rv.generator}"))
        return False
    members = [r.rank for r in s.alive]
    initial = s.sessions == 0  # the run's first: every replica starts from new rank 0's
    for new_rank, rank in enumerate(members):
        out.append(Send(m.NewNcclSession(uid_bytes=msg.uid_bytes, new_rank=new_rank,
                                         new_world_size=len(members), initial=initial),
                        rank=rank))
    s.rendezvous = None
    s.sessions += 1
    out.append(Record("session-formed", {"session": s.sessions, "members": members,
                                         "generator": msg.rank}))
    if not initial:
        recovery.after_session(s, now, out)
    return True


def check_rendezvous(s: State, now: float, out: Out) -> None:
    rv = s.rendezvous
    if rv is None or now < rv.deadline:
        return
    rv.tried.add(rv.generator)
    nxt = session.pick_generator(s, rv.members, rv.tried)
    out.append(Record("session-generator-timeout", {"generator": rv.generator, "next": nxt}))
    if nxt is None:
        s.rendezvous = None
        session.end_run(s, m.SaveReason.SINGLE_SURVIVOR,
                        "every id-generator candidate timed out", now, out)
        return
    rv.generator, rv.deadline = nxt, now + s.config.rendezvous_timeout_s
    out.append(Send(m.RequestNewNcclId(), rank=nxt))


# ------------------------------------------------------------------- liveness


SUSPECT_MARGIN_S = 3.0  # three heartbeat periods


def check_liveness(s: State, now: float, out: Out) -> None:
    """Ranks silent past the heartbeat timeout are dead. When one is, every rank silent for
    all but the last ``SUSPECT_MARGIN_S`` of the timeout (but at least 3/4 of it) goes in
    the same membership change: ranks that died together (a node, a switch) beat last up to
    a heartbeat period apart, and one rebuild for all of them beats one per tick. A rank
    that has missed that many beats in a row while a peer is gone is not coming back in
    the remaining seconds; a live one is never suspected without a certain death."""
    timeout = s.schedule.heartbeat_timeout.total_seconds()
    alive = s.alive
    if not any(now - r.last_heard > timeout for r in alive):
        return
    suspect = max(timeout - SUSPECT_MARGIN_S, 0.75 * timeout)
    silent = [(r, f"silent for {now - r.last_heard:.1f}s") for r in alive
              if now - r.last_heard > suspect]
    recovery.declare_dead_all(s, silent, now, out)


def declare_dead(s: State, r: RankState, why: str, now: float, out: Out) -> None:
    recovery.declare_dead(s, r, why, now, out)


#: Disconnect reasons that say nothing about the rank: the broker itself is going (its
#: clients reconnect to it or a peer; heartbeats judge them meanwhile, and the
#: coordinator's own connection goes with it: ``BusRestored`` forgives that silence).
SERVER_SIDE: Final = frozenset({"Server Shutdown"})


def on_disconnected(s: State, connection: str, reason: str, now: float, out: Out) -> None:
    """The broker closed ``connection``: if it is an alive rank's (as its last heartbeat
    named it), that rank is dead unless it reconnects within ``disconnect_grace``. Any
    other connection (an observer, a rank's rendezvous store, an older incarnation, an
    exited rank) is none of the core's business."""
    if not connection or reason in SERVER_SIDE or s.phase not in _JUDGED:
        return
    r = next((x for x in s.alive if x.connection == connection), None)
    if r is None or r.unplugged_at is not None:
        return
    r.unplugged_at, r.unplugged_why = now, reason
    out.append(Record("rank-disconnected", {
        "rank": r.rank, "generation": r.hello.generation if r.hello else 0,
        "host": r.hello.host if r.hello else "", "reason": reason,
        "grace_s": s.schedule.disconnect_grace.total_seconds()}))


def on_reconnected(s: State, rank: int, out: Out) -> None:
    """A connection named as ``rank``'s opened: if that rank's connection had closed, it
    is back (its next heartbeat names the new one)."""
    r = s.rank(rank)
    if r is None or not r.alive or r.unplugged_at is None:
        return
    r.unplugged_at, r.unplugged_why = None, ""
    out.append(Record("rank-reconnected", {"rank": rank}))


def on_connection(r: RankState, connection: str, out: Out) -> None:
    """A heartbeat named ``r``'s connection: a new one means it reconnected. Recorded, so
    an operator can find the rank in the broker's ``connz`` (and know from when on a close
    of that connection is its death)."""
    if connection and connection != r.connection:
        r.connection = connection
        r.unplugged_at, r.unplugged_why = None, ""
        out.append(Record("rank-connection", {
            "rank": r.rank, "generation": r.hello.generation if r.hello else 0,
            "connection": connection}))


def check_unplugged(s: State, now: float, out: Out) -> None:
    """Ranks whose connection closed past the grace without a reconnect are dead: one
    membership change for all of them, like ranks silent together."""
    grace = s.schedule.disconnect_grace.total_seconds()
    gone = [(r, f"its broker connection closed ({r.unplugged_why}) and did not come back "
                f"within {grace:g}s")
            for r in s.alive if r.unplugged_at is not None and now - r.unplugged_at >= grace]
    if gone:
        recovery.declare_dead_all(s, gone, now, out, cause="disconnected")


def on_exiting(s: State, r: RankState, now: float, out: Out) -> None:
    if r.exited:
        out.append(Refuse("duplicate-exiting", f"rank {r.rank} already said Exiting"))
        return
    was_alive = r.alive
    r.exited, r.alive = True, False
    out.append(Record("rank-exited", {"rank": r.rank}))
    if s.phase is Phase.DRAINING:
        session.maybe_done(s, now, out)
    elif was_alive and s.phase is Phase.ADMITTING:
        r.hello = None  # it may come back with a new Hello
    elif was_alive:
        # a graceful leave mid-run (SIGTERM, an eviction): shrink around it like a death,
        # without counting it against max_failure; it may rejoin later
        recovery.lose(s, r, now, out)


def check_formation(s: State, now: float, out: Out) -> None:
    if s.phase is Phase.ADMITTING and now - s.created_at > s.config.formation_timeout_s:
        joined = sum(1 for r in s.ranks if r.alive)
        text = (f"only {joined} of {s.config.world_size} ranks joined within "
                f"{s.config.formation_timeout_s:.0f}s")
        out.append(Send(m.Shutdown()))
        out.append(Record("formation-timeout", {"joined": joined}))
        s.outcome = (False, text)
        session.drain(s, now, out)
