"""The coordinator's event intake, fuzzed: mutated, re-signed messages into the real core.

The messages go through the service's own intake code, :meth:`Coordinator._on_stream`
and :meth:`Coordinator._on_live` with the ticker's :meth:`Coordinator._take_beats`
(decode, fence, message -> event, ``apply``, the
commands carried out and encoded for publishing), on a :class:`Coordinator` whose I/O is
cut away: no lease to renew, no KV snapshot write, no publisher, no reducer. Each example
starts from a core state of one phase (forming, training with a round in flight, the broker
round, finishing, ...) and feeds realistic messages for that state (the ranks it knows,
their steps, the round's version, the eval and checkpoint ids it waits for), most of them
mutated and signed again with the job key.

Checked: nothing raises (decoding, the core's transition, encoding its commands), every
refusal the core makes is counted in ``state.refusals`` with a reason and a detail, and the
state still makes a write-ahead snapshot that loads. A forged message (another key, no
signature, an old generation) is refused by the decoder and leaves the state exactly as it
was (byte-equal snapshot) with no command.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import random
from collections import Counter
from types import SimpleNamespace
from typing import Any

import fuzz_corpus as fc
import fuzz_states
import pytest
from fuzz_mutate import Mutator
from hypothesis import given
from hypothesis import strategies as st

from ddpbus.codecs import Decoder, Encoder, Outbound, convert
from ddpbus.codecs import messages as m
from ddpbus.codecs import subjects as sj
from ddpbus.orchestrator.core.state import Command, Reduce, Reduced, Refuse, State, Tick
from ddpbus.orchestrator.persist import snapshot
from ddpbus.orchestrator.runtime.coordinator import Coordinator, CoordinatorSettings
from ddpbus.orchestrator.runtime.intake import Intake as ServiceIntake

B = fc.BUDGET
SIG = b"\x11" * m.MODEL_SIGNATURE_BYTES  # the simulated ranks' model signature
UID = b"\x33" * m.NCCL_ID_BYTES
PER_EXAMPLE = 12  # messages fed per example (each costs a few envelope decodes)


class _Lease:
    """Always held: ``apply`` decides at once."""

    def __init__(self) -> None:
        self.lost = asyncio.Event()

    async def confirm(self) -> bool:
        return True


def _settings() -> CoordinatorSettings:
    """Settings with the job and key; the connection fields (whatever they are called) stay
    None: nothing here connects."""
    given = {"job": fc.JOB, "key": fc.KEY}
    needed = {f.name for f in dataclasses.fields(CoordinatorSettings)
              if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    return CoordinatorSettings(**given, **dict.fromkeys(needed - given.keys()))


class Intake(Coordinator):
    """The service's intake with its I/O cut away (see the module doc)."""

    def __init__(self, state: State, now: float) -> None:
        super().__init__(_settings(), state.config)
        self.state, self.now = state, now
        self.clock = lambda: self.now
        self.encoder = Encoder(job=fc.JOB, key=fc.KEY, sender=sj.COORDINATOR,
                               generation=state.config.coordinator_generation)
        self.intake = ServiceIntake(Decoder(job=fc.JOB, key=fc.KEY,
                                            generation_floor=self._rank_floor),
                                    state.config.world_size)
        self.lease = _Lease()  # type: ignore[assignment]
        self.published: list[Outbound] = []
        self.publisher = SimpleNamespace(submit=self.published.append,  # type: ignore[assignment]
                                         unstored=list)
        self.reader = SimpleNamespace(handled_seq=0, handled_at=None)  # type: ignore[assignment]
        self.decided: list[list[Command]] = []
        self.reduces: list[Reduce] = []

    @property
    def rejected(self) -> Counter[str]:
        return self.intake.rejected

    def _carry_out(self, commands: list[Any]) -> list[Outbound]:
        self.decided.append(commands)
        return super()._carry_out(commands)

    async def _snapshot(self, new: list[Outbound]) -> bool:
        return True  # the write-ahead snapshot is checked once per example instead

    def _start_reduce(self, cmd: Reduce) -> None:
        self.reduces.append(cmd)

    async def deliver(self, x: fc.Inbound) -> list[Command] | None:
        """One message through the service's intake: the commands it led to (None: the
        decoder refused it, the core never saw it)."""
        msg = SimpleNamespace(subject=x.subject, headers=x.headers, data=x.payload)
        self.reader.handled_seq += 1
        before = len(self.decided)
        refused = self.rejected.total()
        if ".live." in x.subject:
            await self._on_live(msg)  # type: ignore[arg-type]
            await self._take_beats()  # (the service's ticker applies them)
        else:
            await self._on_stream(msg)  # type: ignore[arg-type]
        if self.rejected.total() > refused:
            return None
        return [c for batch in self.decided[before:] for c in batch]


# ------------------------------------------------------------ realistic traffic


def _floats(rng: random.Random) -> float:
    return rng.choice((1.0, 2.5, 40.0, 0.0, -1.0, math.nan, math.inf, 1e300, 5e-324))


def _timing(rng: random.Random, s: State, rank: int, step: int) -> Any:
    r = s.ranks[rank % len(s.ranks)]
    head = next(iter(r.queue), None)
    makers = (
        lambda: m.Batch(rank=rank, batch_ms=_floats(rng), data_ms=_floats(rng),
                        step_count=step, batch_loss=rng.choice((None, 0.5, math.nan))),
        lambda: m.SyncAck(rank=rank, step_count=r.sync_step, divergence=_floats(rng),
                          pre_norm=1.0, post_norm=1.0, failed=rng.random() < 0.2),
        lambda: m.Heartbeat(rank=rank, step_count=step),
        lambda: m.Exiting(rank=rank),
        lambda: m.LrUpdate(rank=rank, lr=_floats(rng)),
        lambda: m.Intent(rank=rank, kind=rng.choice(list(m.IntentKind))),
        lambda: m.SnapshotReady(
            rank=rank, version=s.broker_round.version if s.broker_round else rng.randrange(3),
            mass=float(max(1, r.sync_step - r.sealed)), step_count=r.sync_step,
            digest="SHA-256=q83vEjRWeJA=", nbytes=256),
        lambda: m.NewNcclIdGenerated(rank=s.rendezvous.generator if s.rendezvous else rank,
                                     uid_bytes=UID),
        lambda: m.EvalResult(rank=rank, schedule_id=rng.choice([*s.evals, 1, 99]),
                             epoch=s.epoch, metric=_floats(rng), elapsed_ms=3.0,
                             error=rng.choice((None, "boom"))),
        lambda: m.CheckpointResult(rank=rank, version=rng.choice([*s.checkpoints, 1, 7]),
                                   elapsed_ms=2.0, error=rng.choice((None, "disk full"))),
        lambda: m.EpochFnElapsed(rank=rank, epoch=s.epoch, elapsed_ms=_floats(rng)),
        lambda: m.MetricsMsg(rank=rank, epoch=head.epoch if head else s.epoch,
                             avg_loss=_floats(rng), batches_processed=head.size if head else 3,
                             epoch_ms=_floats(rng), samples_processed=8 * (head.size if head
                                                                           else 3),
                             scalars={"acc": m.ScalarSum(sum=_floats(rng), count=3)}),
    )
    return rng.choice(makers)()


def _join(rng: random.Random, s: State, rank: int) -> Any:
    r = s.ranks[rank % len(s.ranks)]
    old = r.hello.generation if r.hello is not None else 0
    hello = m.Hello(rank=rank, generation=old + rng.choice((0, 1, 1, 2)), host="sim",
                    device="cpu", model_signature=rng.choice((SIG, SIG, b"\x12" * 32)),
                    world_size=rng.choice((fc.WORLD, fc.WORLD, fc.WORLD + 1)),
                    backend="gloo", dataset_size=rng.choice((s.dataset_size or 640, 641)))
    if rng.random() < 0.5:
        return hello
    return m.Rejoin(hello=hello, resume_stream_seq=rng.randrange(10_000),
                    checkpoint_version=rng.randrange(3))


def realistic(rng: random.Random, s: State, *, key: bytes = fc.KEY, rank: int | None = None,
              generation: int | None = None) -> fc.Inbound:
    """A message a rank of ``s`` (``rank``, or any, sometimes one it does not have) could
    send now, signed (by ``key``, at ``generation``)."""
    if rank is None:
        rank = rng.randrange(fc.WORLD) if rng.random() < 0.95 else rng.choice((fc.WORLD, 9))
    r = s.ranks[rank] if rank < len(s.ranks) else None
    step = max(0, (r.step if r else 0) + rng.choice((1, 1, 1, 0, -1, 7, 10_000)))
    msg = _join(rng, s, rank) if rng.random() < 0.12 else _timing(rng, s, rank, step)
    family = convert.BY_CLASS[type(msg)].family.DESCRIPTOR.name
    if generation is None:
        generation = r.hello.generation if r is not None and r.hello is not None else 1
    seen = s.seen_ids.get(rank)
    seq = max(1, (seen.high if seen else 1) + rng.choice((1, 1, 2, 0, -1, -300)))
    return fc.sign_message(family, msg, wire_json=rng.random() < 0.2, live=rng.random() < 0.3,
                           seq=seq, generation=generation, key=key)


# --------------------------------------------------------------------- checks


def _check_decided(before: Counter[str], after: Counter[str], out: list[Command]) -> None:
    refusals = [c for c in out if isinstance(c, Refuse)]
    assert all(c.reason and c.detail for c in refusals), refusals
    assert after - before == Counter(c.reason for c in refusals)


def frozen(state: State) -> bytes:
    """The state as its snapshot's bytes: equal bytes, equal state."""
    return snapshot.encode(snapshot.Snapshot(state=state, stream_seq=0, outbox=[],
                                             coordinator_generation=0, saved_at=0.0), fc.KEY)


async def _feed(intake: Intake, rng: random.Random, mutator: Mutator, count: int,
                seen: Counter[str]) -> None:
    for _ in range(count):
        x = realistic(rng, intake.state)
        if rng.random() < 0.7:
            x = mutator.mutate(x, resign=True)
        intake.now += rng.choice((0.001, 0.01, 0.1, 0.5, 3.0))
        before = intake.state.refusals.copy()
        try:
            out = await intake.deliver(x)
        except Exception as exc:
            raise fc.Crash(f"{type(exc).__name__}: {exc} on {fc.shown(x)} in phase "
                           f"{intake.state.phase}") from exc
        if out is None:
            continue  # refused by the decoder: counted in intake.rejected
        _check_decided(before, intake.state.refusals, out)
        refused = [c.reason for c in out if isinstance(c, Refuse)]
        # "quiet": taken without a command (after the end, a tick or a last heartbeat)
        seen[f"core-refused:{refused[0]}" if refused else "accepted" if out else "quiet"] += 1
        if intake.reduces and rng.random() < 0.3:
            cmd = intake.reduces.pop()
            ok = rng.random() < 0.7
            await intake.apply(Reduced(version=cmd.version, ok=ok,
                                       digest="SHA-256=fuzz" if ok else ""))
        if rng.random() < 0.05:
            await intake.apply(Tick())


@pytest.fixture
def quiet_service(caplog: pytest.LogCaptureFixture) -> None:
    # every core refusal is a warning line: keep the captured log small over 100k messages
    caplog.set_level(logging.ERROR, logger="ddpbus.orchestrator.runtime")


@pytest.mark.usefixtures("quiet_service")
@pytest.mark.parametrize("phase", fuzz_states.PHASES)
def test_mutated_traffic_never_crashes_the_intake_and_every_refusal_counts(phase: str
                                                                            ) -> None:
    seen: Counter[str] = Counter()
    decoded: Counter[str] = Counter()
    # the intake is one family: the budget is shared out over the phases
    payloads = -(-B.payloads // len(fuzz_states.PHASES))
    per_example = min(PER_EXAMPLE, payloads)
    donors = tuple(x for _, x in fc.every_seed())

    @B.settings(examples=-(-payloads // per_example))
    @given(seed=st.integers(0, 2**64 - 1))
    def run(seed: int) -> None:
        rng = random.Random(seed)
        intake = Intake(fuzz_states.fresh(phase), now=1000.0)
        asyncio.run(_feed(intake, rng, Mutator(rng, donors), per_example, seen))
        decoded.update(intake.rejected)
        snapshot.decode(frozen(intake.state), fc.KEY)  # the write-ahead snapshot still works
        ranks_view = Decoder(job=fc.JOB, key=fc.KEY)
        for out in intake.published:  # what the core decided, as the ranks receive it
            assert not isinstance(fc.decode(ranks_view, fc.Inbound.of(out)), Exception)

    run()
    outcomes = Counter({k: v for k, v in seen.items() if v}) + Counter(
        {f"decoder:{k}": v for k, v in decoded.items()})
    fc.TALLY.add("CoordinatorIntake", phase, outcomes)
    assert outcomes.total() >= payloads
    assert any(k.startswith("core-refused:") for k in outcomes), outcomes
    if phase == "done":  # the run is over: nothing is acted on any more
        assert not outcomes["accepted"]
        assert outcomes["core-refused:run-over"] > 0
    else:
        assert outcomes["accepted"] + outcomes["quiet"] > 0


@pytest.mark.parametrize("phase", fuzz_states.PHASES)
@pytest.mark.parametrize("forgery", ["another-key", "no-signature", "old-generation"])
def test_a_forged_message_changes_nothing(phase: str, forgery: str) -> None:
    state = fuzz_states.fresh(phase)
    admitted = [r for r in state.ranks if r.hello is not None and r.hello.generation >= 1]
    intake = Intake(state, now=1000.0)
    before = frozen(state)
    rng = random.Random(f"{phase}/{forgery}")
    sent = 0
    for _ in range(40):
        if forgery == "another-key":
            x = realistic(rng, state, key=fc.OTHER_KEY)
        elif forgery == "no-signature":
            x = realistic(rng, state)
            x = fc.Inbound(x.subject, {k: v for k, v in x.headers.items()
                                       if k != sj.H_SIG}, x.payload)
        elif admitted:
            r = rng.choice(admitted)
            x = realistic(rng, state, rank=r.rank,
                          generation=r.hello.generation - 1)  # type: ignore[union-attr]
        else:
            continue
        assert asyncio.run(intake.deliver(x)) is None
        sent += 1
    assert frozen(state) == before
    assert not intake.decided
    assert not intake.published
    expected = {"another-key": "bad-signature", "no-signature": "bad-signature",
                "old-generation": "stale-generation"}[forgery]
    assert set(intake.rejected) <= {expected}
    assert intake.rejected.total() == sent
    assert sent or (forgery == "old-generation" and not admitted)


def test_a_refusal_is_warned_once_per_reason_and_every_one_counted(
        caplog: pytest.LogCaptureFixture) -> None:
    # after the run, every input is refused (run-over): at a thousand ranks that is a
    # thousand lines a second unless each reason is warned about once
    intake = Intake(fuzz_states.fresh("done"), now=1000.0)
    before = Counter(intake.state.refusals)
    rng = random.Random("refusals")
    with caplog.at_level(logging.DEBUG, logger="ddpbus.orchestrator.runtime"):
        for _ in range(30):
            asyncio.run(intake.deliver(realistic(rng, intake.state)))
    made = Counter(intake.state.refusals) - before
    assert made["run-over"] >= 5
    lines = [(r.levelno, r.getMessage()) for r in caplog.records
             if r.getMessage().startswith("refused (")]
    warned = Counter(msg.partition(")")[0][len("refused ("):] for level, msg in lines
                     if level == logging.WARNING)
    assert warned == Counter(dict.fromkeys(made, 1))
    assert sum(level == logging.DEBUG for level, _ in lines) == made.total() - len(made)
