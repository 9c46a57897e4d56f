"""Admission, communicator sessions and the run's end: the leaves of membership.

Pure functions over :class:`~ddpbus.orchestrator.core.state.State` that append commands to
``out``, called by every handler above them (membership, recovery, the elected ranks'
duties): a Hello's verdict (accept, or reject with the reason), asking one rank to mint a
communicator session id, ending the run, and draining it once every rank is done.
"""

from __future__ import annotations

from ddpbus.codecs import messages as m
from ddpbus.orchestrator.core.state import (
    Admit,
    Command,
    Finish,
    Phase,
    Record,
    Rendezvous,
    Send,
    State,
)

Out = list[Command]

# the end of a Reject's reason when the run takes no rank any more (ending or ended): a
# replacement rank that gets it has nothing to do (worker_agent: it waits for the summary)
NOT_JOINABLE = "no rank can join now"


CAPABLE = {"nccl": m.Backend.NCCL, "gloo": m.Backend.GLOO}  # what a rank's Hello offers


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
    capable = CAPABLE.get(hello.backend)
    if capable is None:
        return f"rank {hello.rank} offers backend {hello.backend!r}; expected nccl or gloo"
    wanted = s.schedule.backend
    if wanted is m.Backend.NCCL and capable is not m.Backend.NCCL:
        return f"backend nccl needs CUDA, rank {hello.rank} runs on {hello.device}"
    if wanted is m.Backend.AUTO and s.backend is not None and capable is not s.backend:
        return (f"backend auto resolved to {s.backend.value}, rank {hello.rank} can only use "
                f"{capable.value} ({hello.device}); pass --backend gloo for a mixed cohort")
    return None


def accept(s: State, hello: m.Hello, out: Out) -> None:
    """Accept ``hello``'s incarnation with the run's settings (first join or rejoin)."""
    run = s.run if s.run is not None else s.schedule.run_config(s.dataset_size, s.config.world_size)
    out.append(Admit(m.Accept(rank=hello.rank, generation=hello.generation,
                              world_size=s.config.world_size,
                              coordinator_generation=s.config.coordinator_generation,
                              run=run)))


def pick_generator(s: State, members: tuple[int, ...], tried: set[int]) -> int | None:
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
    generator = pick_generator(s, members, set())
    if generator is None:
        end_run(s, m.SaveReason.ALL_RANKS_LOST, "no rank left to form a session", now, out)
        return
    s.rendezvous = Rendezvous(generator=generator, members=members,
                              deadline=now + s.config.rendezvous_timeout_s)
    out.append(Send(m.RequestNewNcclId(), rank=generator))
    out.append(Record("session-requested", {"generator": generator, "members": list(members)}))


def end_run(s: State, reason: m.SaveReason, text: str, now: float, out: Out) -> None:
    """Unrecoverable: every surviving rank saves and exits (ShutdownWithSave, once)."""
    if s.phase in (Phase.DRAINING, Phase.DONE):
        return
    out.append(Send(m.ShutdownWithSave(reason=reason)))
    out.append(Record("run-aborted", {"reason": reason.name, "why": text,
                                      "resume_bundle": s.last_bundle or None}))
    s.outcome = (False, text)
    drain(s, now, out)


def shutdown(s: State, now: float, out: Out) -> None:
    """The normal end: the last average has settled everywhere."""
    out.append(Send(m.Shutdown()))
    out.append(Record("run-complete", {"epochs": len(s.aggregated), "rounds": s.rounds,
                                       "global_step": s.global_step}))
    s.outcome = (True, "completed")
    drain(s, now, out)


def drain(s: State, now: float, out: Out) -> None:
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
