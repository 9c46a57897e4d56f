"""A hand-fed coordinator core for the rule tests: build events, move a fake clock."""

from __future__ import annotations

from typing import Any

from ddpbus.codecs import messages as m
from ddpbus.orchestrator.core.config import schedule_from
from ddpbus.orchestrator.core.state import (
    Admit,
    Command,
    CoreConfig,
    Event,
    Joined,
    Metrics,
    Record,
    Refuse,
    Send,
    Timing,
)
from ddpbus.orchestrator.core.transition import initial_state, transition

SIG = b"\x11" * m.MODEL_SIGNATURE_BYTES
UID = b"\x22" * m.NCCL_ID_BYTES


def hello(rank: int, *, world: int = 2, generation: int = 1, sig: bytes = SIG,
          dataset: int = 640, backend: str = "gloo", device: str = "cpu") -> m.Hello:
    return m.Hello(rank=rank, generation=generation, host="h", device=device,
                   model_signature=sig, world_size=world, backend=backend,
                   dataset_size=dataset)


class Core:
    """One core fed by hand; ``now`` only moves when a test says so."""

    def __init__(self, world: int = 2, now: float = 0.0, **knobs: Any) -> None:
        schedule = schedule_from({"batch_size": 8, **knobs})
        self.world = world
        self.now = now
        self.state = initial_state(CoreConfig(schedule=schedule, world_size=world), now)
        self.steps = [0] * world

    def feed(self, event: Event, at: float | None = None) -> list[Command]:
        if at is not None:
            self.now = at
        self.state, out = transition(self.state, event, self.now)
        return out

    def join(self, rank: int, **kw: Any) -> list[Command]:
        return self.feed(Joined(hello(rank, world=self.world, **kw)))

    def admit_all(self) -> list[Command]:
        return [c for r in range(self.world) for c in self.join(r)]

    def form(self) -> list[Command]:
        self.admit_all()
        return self.feed(Timing(m.NewNcclIdGenerated(rank=0, uid_bytes=UID)))

    def batch(self, rank: int, ms: float = 1.0) -> list[Command]:
        self.steps[rank] += 1
        return self.feed(Timing(m.Batch(rank=rank, batch_ms=ms, data_ms=0.0,
                                        step_count=self.steps[rank])))

    def train(self, rank: int, n: int, ms: float = 1.0, *, metrics: bool = True
              ) -> list[Command]:
        """``n`` batches; the MetricsMsg of every plan they finish follows (with ``metrics``)."""
        out: list[Command] = []
        for _ in range(n):
            head = next((a for a in self.state.ranks[rank].queue if not a.complete), None)
            out += self.batch(rank, ms)
            if metrics and head is not None and head.complete:
                out += self.metrics(rank, head.epoch, head.size)
        return out

    def metrics(self, rank: int, epoch: int, batches: int) -> list[Command]:
        return self.feed(Metrics(m.MetricsMsg(rank=rank, epoch=epoch, avg_loss=1.0,
                                              batches_processed=batches, epoch_ms=1.0,
                                              samples_processed=batches * 8)))

    def ack(self, rank: int) -> list[Command]:
        step = self.state.ranks[rank].sync_step  # the step the rank averaged at
        return self.feed(Timing(m.SyncAck(rank=rank, step_count=step, divergence=0.01)))

    def exiting(self, rank: int, at: float | None = None) -> list[Command]:
        return self.feed(Timing(m.Exiting(rank=rank)), at)


def sends(out: list[Command], cls: type[Any]) -> list[Send]:
    return [c for c in out if isinstance(c, Send) and isinstance(c.msg, cls)]


def records(out: list[Command], event: str) -> list[dict[str, Any]]:
    return [c.fields for c in out if isinstance(c, Record) and c.event == event]


def refusals(out: list[Command]) -> list[str]:
    return [c.reason for c in out if isinstance(c, Refuse)]


def rejected(out: list[Command]) -> list[str]:
    return [c.msg.reason for c in out if isinstance(c, Admit) and isinstance(c.msg, m.Reject)]


def accepted(out: list[Command]) -> bool:
    return any(isinstance(c, Admit) and isinstance(c.msg, m.Accept) for c in out)


def formed(**knobs: Any) -> Core:
    core = Core(**knobs)
    core.form()
    return core
