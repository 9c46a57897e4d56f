"""Membership: admission from hellos, communicator sessions, liveness and the run's end.

Pure functions over :class:`~ddpbus.orchestrator.state.State` that append commands to
``out``. A rank is admitted when its Hello agrees with the cohort (world size, model
signature, dataset size, a backend the cohort can share); when every rank is in, one rank is
asked to mint a communicator session id (RequestNewNcclId -> NewNcclIdGenerated ->
NewNcclSession to every member, reference D.3). A rank silent past the heartbeat timeout is
declared dead exactly once; one that said Exiting never is.
"""

from __future__ import annotations

import dataclasses

from ddpbus.codecs import messages as m
from ddpbus.orchestrator import recovery
from ddpbus.orchestrator.state import (
    Admit,
    Command,
    Finish,
    Phase,
    RankState,
    Record,
    Refuse,
    Rendezvous,
    Send,
    State,
)

Out = list[Command]

_CAPABLE = {"nccl": m.Backend.NCCL, "gloo": m.Backend.GLOO}  # what a rank's Hello offers


def reject(hello: m.Hello, reason: str, out: Out) -> None:
    out.append(Admit(m.Reject(rank=hello.rank, generation=hello.generation, reason=reason)))
    out.append(Record("rank-rejected", {"rank": hello.rank, "generation": hello.generation,
                                        "reason": reason}))


def cohort_problem(s: State, hello: m.Hello) -> str | None:
    """Why this Hello cannot join the cohort, or None."""
    world = s.config.world_size
    if hello.world_size != world:
        return (f"rank {hello.rank} was started for world size {hello.world_size}, the job "
                f"has {world}")
    if s.model_signature is not None and hello.model_signature != s.model_signature:
        return (f"rank {hello.rank}'s model signature {hello.model_signature.hex()[:16]}… differs "
                f"from the cohort's {s.model_signature.hex()[:16]}… (another model or version)")
    batch = s.schedule.batch_size
    if hello.dataset_size < batch:
        return (f"rank {hello.rank}'s dataset has {hello.dataset_size} samples, fewer than "
                f"one batch of {batch}")
    resumed = s.config.resume
    if resumed is not None and resumed.dataset_size and hello.dataset_size != \
            resumed.dataset_size:
        return (f"rank {hello.rank}'s dataset has {hello.dataset_size} samples, the resumed "
                f"bundle's run {resumed.dataset_size} (its coverage would not apply)")
    if s.dataset_size and hello.dataset_size != s.dataset_size:
        return (f"rank {hello.rank}'s dataset has {hello.dataset_size} samples, the cohort's "
                f"{s.dataset_size}")
    capable = _CAPABLE.get(hello.backend)
    if capable is None:
        return f"rank {hello.rank} offers backend {hello.backend!r}; expected nccl or gloo"
    wanted = s.schedule.backend
    if wanted is m.Backend.NCCL and capable is not m.Backend.NCCL:
        return f"backend nccl needs CUDA, rank {hello.rank} runs on {hello.device}"
    if wanted is m.Backend.AUTO and s.backend is not None and capable is not s.backend:
        return (f"backend auto resolved to {s.backend.value}, rank {hello.rank} can only use "
                f"{capable.value} ({hello.device}); pass --backend gloo for a mixed cohort")
    return None


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
        reject(hello, f"rank {hello.rank} is outside world size {s.config.world_size}", out)
        return
    if r.hello is not None and hello.generation < r.hello.generation:
        reject(hello, f"stale incarnation: generation {r.hello.generation} already joined", out)
        return
    if s.phase is not Phase.ADMITTING:
        recovery.on_rejoin(s, r, hello, now, out)
        return
    problem = cohort_problem(s, hello)
    if problem is not None:
        reject(hello, problem, out)
        return
    _admit(s, r, hello, now, out)


def _admit(s: State, r: RankState, hello: m.Hello, now: float, out: Out) -> None:
    if s.model_signature is None:
        s.model_signature = hello.model_signature
        s.dataset_size = hello.dataset_size
        s.total_batches = hello.dataset_size // s.schedule.batch_size
        s.elche.max_total = s.total_batches
        wanted = s.schedule.backend
        s.backend = _CAPABLE[hello.backend] if wanted is m.Backend.AUTO else wanted
    r.hello, r.alive, r.last_heard = hello, True, now
    backend = s.backend or m.Backend.GLOO
    run = s.schedule.run_config(s.dataset_size, s.config.world_size)
    s.run = dataclasses.replace(run, backend=backend)
    accept(s, hello, out)
    out.append(Record("rank-admitted", {"rank": hello.rank, "generation": hello.generation,
                                        "host": hello.host, "device": hello.device,
                                        "pid": hello.pid}))
    if all(x.alive for x in s.ranks):
        s.phase = Phase.FORMING
        start_session(s, now, out)


def accept(s: State, hello: m.Hello, out: Out) -> None:
    """Accept ``hello``'s incarnation with the run's settings (first join or rejoin)."""
    run = s.run if s.run is not None else s.schedule.run_config(s.dataset_size, s.config.world_size)
    out.append(Admit(m.Accept(rank=hello.rank, generation=hello.generation,
                              world_size=s.config.world_size,
                              coordinator_generation=s.config.coordinator_generation,
                              run=run)))


# ------------------------------------------------------------------ sessions


def _pick_generator(s: State, members: tuple[int, ...], tried: set[int]) -> int | None:
    """Fastest untried survivor by the current speed estimates (ties and unmeasured ranks:
    lowest rank first)."""
    candidates = [r for r in members if r not in tried and s.ranks[r].alive]
    if not candidates:
        return None
    fastest = s.elche.fastest(candidates)
    return fastest if fastest is not None else candidates[0]


def start_session(s: State, now: float, out: Out) -> None:
    members = tuple(r.rank for r in s.alive)
    if s.broker:  # ranks only talk to the broker: there is no communicator to form
        s.sessions += 1
        out.append(Record("session-formed", {"session": s.sessions, "members": list(members),
                                             "backend": "broker"}))
        return
    generator = _pick_generator(s, members, set())
    if generator is None:
        end_run(s, m.SaveReason.ALL_RANKS_LOST, "no rank left to form a session", now, out)
        return
    s.rendezvous = Rendezvous(generator=generator, members=members,
                              deadline=now + s.config.rendezvous_timeout_s)
    out.append(Send(m.RequestNewNcclId(), rank=generator))
    out.append(Record("session-requested", {"generator": generator, "members": list(members)}))


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
    nxt = _pick_generator(s, rv.members, rv.tried)
    out.append(Record("session-generator-timeout", {"generator": rv.generator, "next": nxt}))
    if nxt is None:
        s.rendezvous = None
        end_run(s, m.SaveReason.SINGLE_SURVIVOR, "every id-generator candidate timed out",
                now, out)
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


def on_exiting(s: State, r: RankState, now: float, out: Out) -> None:
    if r.exited:
        out.append(Refuse("duplicate-exiting", f"rank {r.rank} already said Exiting"))
        return
    was_alive = r.alive
    r.exited, r.alive = True, False
    out.append(Record("rank-exited", {"rank": r.rank}))
    if s.phase is Phase.DRAINING:
        maybe_done(s, now, out)
    elif was_alive and s.phase is Phase.ADMITTING:
        r.hello = None  # it may come back with a new Hello
    elif was_alive:
        # a graceful leave mid-run (SIGTERM, an eviction): shrink around it like a death,
        # without counting it against max_failure; it may rejoin later
        recovery.lose(s, r, now, out)


def end_run(s: State, reason: m.SaveReason, text: str, now: float, out: Out) -> None:
    """Unrecoverable: every surviving rank saves and exits (ShutdownWithSave, once)."""
    if s.phase in (Phase.DRAINING, Phase.DONE):
        return
    out.append(Send(m.ShutdownWithSave(reason=reason)))
    out.append(Record("run-aborted", {"reason": reason.name, "why": text,
                                      "resume_bundle": s.last_bundle or None}))
    s.outcome = (False, text)
    _drain(s, now, out)


def shutdown(s: State, now: float, out: Out) -> None:
    """The normal end: the last average has settled everywhere."""
    out.append(Send(m.Shutdown()))
    out.append(Record("run-complete", {"epochs": len(s.aggregated), "rounds": s.rounds,
                                       "global_step": s.global_step}))
    s.outcome = (True, "completed")
    _drain(s, now, out)


def _drain(s: State, now: float, out: Out) -> None:
    s.phase = Phase.DRAINING
    s.drain_started_at = now
    s.finished_at = now
    s.rendezvous = None
    maybe_done(s, now, out)


def maybe_done(s: State, now: float, out: Out) -> None:
    if s.phase is not Phase.DRAINING:
        return
    waiting = [r.rank for r in s.ranks if r.hello is not None and not (r.exited or r.dead)]
    started = s.drain_started_at if s.drain_started_at is not None else now
    timed_out = now - started > s.config.exit_timeout_s
    if waiting and not timed_out:
        return
    ok, reason = s.outcome or (False, "ended")
    if waiting:
        reason += f"; ranks {waiting} did not say Exiting within {s.config.exit_timeout_s:.0f}s"
    s.phase = Phase.DONE
    out.append(Finish(ok=ok, reason=reason))


def check_formation(s: State, now: float, out: Out) -> None:
    if s.phase is Phase.ADMITTING and now - s.created_at > s.config.formation_timeout_s:
        joined = sum(1 for r in s.ranks if r.alive)
        text = (f"only {joined} of {s.config.world_size} ranks joined within "
                f"{s.config.formation_timeout_s:.0f}s")
        out.append(Send(m.Shutdown()))
        out.append(Record("formation-timeout", {"joined": joined}))
        s.outcome = (False, text)
        _drain(s, now, out)
