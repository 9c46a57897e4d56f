"""A discrete-event cohort for pure-core tests: simulated ranks against the real core.

Each simulated rank follows the worker agent's protocol rules (train only inside an open
window and within its step budget, one Batch per batch, one MetricsMsg per finished plan,
SyncAck after each SyncNow, callbacks when targeted, Exiting on Shutdown) with a per-batch
cost, and every message takes ``latency`` seconds to arrive. The clock is fake, so a run of
hundreds of averages takes milliseconds and is exactly repeatable.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ddpbus.codecs import messages as m
from ddpbus.orchestrator.core.config import Schedule
from ddpbus.orchestrator.core.state import (
    Admit,
    Command,
    CoreConfig,
    Disconnected,
    Event,
    Finish,
    Joined,
    Metrics,
    Reconnected,
    Record,
    Refuse,
    ResumePoint,
    Send,
    Tick,
    Timing,
)
from ddpbus.orchestrator.core.transition import initial_state, transition

SIG = b"\x11" * m.MODEL_SIGNATURE_BYTES
UID = b"\x22" * m.NCCL_ID_BYTES


@dataclass
class SimRank:
    rank: int
    ms_per_batch: float
    callback_ms: float = 0.0
    fail_checkpoint: bool = False
    plans: deque[list[int]] = field(default_factory=deque)  # [epoch, first, size, done]
    budget: int = 0
    steps: int = 0  # since the last average
    step: int = 0
    busy: bool = False
    trained: Counter[tuple[int, int]] = field(default_factory=Counter)  # (epoch, batch)
    batches: int = 0
    idle_ms: float = 0.0
    idle_since: float | None = 0.0
    exited: bool = False
    silent: bool = False  # stops answering (a hung process)
    killed: bool = False  # the process is gone: its collectives fail at once for peers
    generation: int = 1
    uid: bytes | None = None  # the communicator it is in
    unsealed: list[tuple[int, int]] = field(default_factory=list)  # trained, not averaged
    admitted: bool = True  # a restarted incarnation drops control traffic until its Accept
    received: list[m.ControlMsg] = field(default_factory=list)
    inbox: deque[m.ControlMsg] = field(default_factory=deque)  # read between batches
    held: list[m.MetricsMsg] = field(default_factory=list)  # behind the window's SyncAck
    connects: int = 0  # how often its NATS connection was opened again (its client id)

    @property
    def connection(self) -> str:
        """Its NATS connection as its heartbeats name it (unique per incarnation and
        reconnect, like a server's client ids)."""
        return f"SIMSERVER/{self.rank * 10_000 + self.generation * 100 + self.connects}"


class Sim:
    """Drive :func:`transition` with simulated ranks until the core says Finish."""

    def __init__(self, schedule: Schedule, speeds: Iterable[float], *, latency: float = 0.0005,
                 dataset_size: int = 640, has_eval: bool = False,
                 has_checkpoint_fn: bool = False, has_epoch_fn: bool = False,
                 tick: float = 0.1, resume: ResumePoint | None = None,
                 lose_batch_report: Callable[[int, int], bool] | None = None) -> None:
        speeds = list(speeds)
        self.config = CoreConfig(schedule=schedule, world_size=len(speeds), has_eval=has_eval,
                                 has_checkpoint_fn=has_checkpoint_fn, has_epoch_fn=has_epoch_fn,
                                 resume=resume)
        self.now = 0.0
        self.state = initial_state(self.config, self.now)
        self.ranks = [SimRank(rank=i, ms_per_batch=ms) for i, ms in enumerate(speeds)]
        self.latency = latency
        self.dataset_size = dataset_size
        self.tick = tick
        # (rank, step) -> True: that Batch report is lost on the way (published unacked)
        self.lose_batch_report = lose_batch_report
        self.commands: list[Command] = []
        self.finish: Finish | None = None
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.sent: list[tuple[float, int | None, m.ControlMsg]] = []
        self.delivered: list[tuple[float, Event]] = []  # every event fed to the core
        self.batch_log: list[tuple[float, int, int, int]] = []  # (time, rank, epoch, batch)
        # the model's content: how often each (epoch, batch) went into a completed average
        self.consensus: Counter[tuple[int, int]] = Counter()
        self.sessions: dict[bytes, int] = {}  # uid -> world size
        self.broken: set[bytes] = set()  # communicators a member of which died
        self.pending: dict[bytes, list[SimRank]] = {}  # ranks inside a collective
        self.collective_timeout = schedule.effective_collective_timeout.total_seconds()
        self._uids = itertools.count(1)

    # ----------------------------------------------------------------- plumbing

    def at(self, when: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (when, next(self._seq), fn))

    def to_core(self, event: Event, delay: float | None = None) -> None:
        self.at(self.now + (self.latency if delay is None else delay),
                lambda: self._deliver(event))

    def _deliver(self, event: Event) -> None:
        self.delivered.append((self.now, event))
        self.state, out = transition(self.state, event, self.now)
        self.commands += out
        for c in out:
            if isinstance(c, Send):
                self.sent.append((self.now, c.rank, c.msg))
                targets = [c.rank] if c.rank is not None else range(len(self.ranks))
                for t in targets:
                    self.at(self.now + self.latency, lambda t=t, msg=c.msg: self._rank_gets(t, msg))
            elif isinstance(c, Finish):
                self.finish = c
            elif isinstance(c, Admit) and isinstance(c.msg, m.Accept):
                r = self.ranks[c.msg.rank]
                if r.generation == c.msg.generation:
                    self.at(self.now + self.latency, lambda r=r: setattr(r, "admitted", True))

    def _ticker(self) -> None:
        if self.finish is None:
            self._deliver(Tick())
            self.at(self.now + self.tick, self._ticker)

    def _heartbeats(self) -> None:
        # every live rank beacons once a second (live.rank.N), whatever it is doing
        if self.finish is None:
            for r in self.ranks:
                if not (r.exited or r.silent):
                    self.to_core(Timing(m.Heartbeat(rank=r.rank, step_count=r.step,
                                                    connection=r.connection)))
            self.at(self.now + 1.0, self._heartbeats)

    def run(self, until: float = 1e6) -> Finish:
        for r in self.ranks:
            hello = m.Hello(rank=r.rank, generation=1, host="sim", device="cpu",
                            model_signature=SIG, world_size=len(self.ranks), backend="gloo",
                            dataset_size=self.dataset_size)
            self.to_core(Joined(hello))
        self.at(self.tick, self._ticker)
        self.at(1.0, self._heartbeats)
        while self._events and self.finish is None:
            when, _, fn = heapq.heappop(self._events)
            if when > until:
                break
            self.now = when
            fn()
        if self.finish is None:
            raise AssertionError(f"no Finish by t={self.now:.3f}s; phase {self.state.phase}")
        return self.finish

    # -------------------------------------------------------------------- ranks

    # ------------------------------------------------------------------- faults

    def kill(self, rank: int) -> None:
        """The rank's process dies: what it trained since its last average is lost, peers
        inside a collective with it fail at once (gloo sees the socket close)."""
        r = self.ranks[rank]
        r.silent = r.killed = True
        r.unsealed.clear()
        if r.uid is not None:
            self.broken.add(r.uid)
            self._fail(r.uid)

    def unplug(self, rank: int, reason: str = "Client Closed") -> None:
        """The broker's disconnect advisory for the rank's connection reaches the core
        (with a system login, the coordinator's presence watcher hands it on)."""
        self.to_core(Disconnected(connection=self.ranks[rank].connection, reason=reason))

    def blip(self, rank: int, away: float = 0.005) -> None:
        """The broker drops the rank's connection and nats-py reconnects ``away`` later:
        a disconnect advisory, then a connect one, then heartbeats on the new connection."""
        r = self.ranks[rank]
        self.unplug(rank, "Kicked")
        self.at(self.now + away, lambda: setattr(r, "connects", r.connects + 1))
        self.to_core(Reconnected(rank=rank), delay=away + self.latency)

    def hang(self, rank: int) -> None:
        """The rank stops (SIGSTOP): peers' collectives time out."""
        self.ranks[rank].silent = True

    def restart(self, rank: int) -> None:
        """A new incarnation of a dead rank joins with the next generation."""
        old = self.ranks[rank]
        if not old.killed:
            self.kill(rank)
        r = self.ranks[rank] = SimRank(rank=rank, ms_per_batch=old.ms_per_batch,
                                       generation=old.generation + 1, admitted=False)
        self.to_core(Joined(m.Hello(rank=rank, generation=r.generation, host="sim",
                                    device="cpu", model_signature=SIG,
                                    world_size=len(self.ranks), backend="gloo",
                                    dataset_size=self.dataset_size)))

    def _enter_collective(self, r: SimRank) -> None:
        if r.uid is None or r.uid in self.broken:
            self._ack(r, failed=True)
            return
        inside = self.pending.setdefault(r.uid, [])
        inside.append(r)
        r.busy = True
        if len(inside) == self.sessions[r.uid]:
            del self.pending[r.uid]
            for x in inside:
                self.consensus.update(x.unsealed)
                x.unsealed.clear()
                x.busy = False
                self._ack(x, failed=False)
                self._drain(x)
            return
        uid = r.uid
        self.at(self.now + self.collective_timeout, lambda: self._fail(uid, only=r))

    def _fail(self, uid: bytes, only: SimRank | None = None) -> None:
        inside = self.pending.get(uid, [])
        if only is not None and only not in inside:
            return  # that collective completed (or failed) already
        self.pending.pop(uid, None)
        self.broken.add(uid)
        for x in inside:
            x.busy = False
            x.uid = None
            if not x.killed:
                self._ack(x, failed=True)  # keeps its unsealed batches for the next round
                self._drain(x)

    def _ack(self, r: SimRank, *, failed: bool) -> None:
        self.to_core(Timing(m.SyncAck(rank=r.rank, step_count=r.step, divergence=0.01,
                                      pre_norm=1.0, post_norm=1.0, failed=failed)))
        r.steps = 0
        self._send_held(r)

    def _send_held(self, r: SimRank) -> None:
        """Like the agent (orchestrator/core/coalesce.py): the metrics of the plan a closing
        batch finished go after the SyncAck (a moment later; a rank killed meanwhile loses
        them)."""
        held, r.held = r.held, []
        for msg in held:
            self.at(self.now + 0.01, lambda msg=msg: None if r.exited or r.silent
                    else self.to_core(Metrics(msg)))

    def _rank_gets(self, index: int, msg: m.ControlMsg) -> None:
        r = self.ranks[index]
        if r.exited or r.silent or not r.admitted:
            return
        r.received.append(msg)
        r.inbox.append(msg)
        self._drain(r)

    def _drain(self, r: SimRank) -> None:
        # like the agent's trainer thread: control messages are handled between batches
        while r.inbox and not r.busy and not r.exited:
            self._handle(r, r.inbox.popleft())
        self._maybe_train(r)

    def _handle(self, r: SimRank, msg: m.ControlMsg) -> None:
        if isinstance(msg, m.RequestNewNcclId):
            uid = next(self._uids).to_bytes(m.NCCL_ID_BYTES, "big")
            self.to_core(Timing(m.NewNcclIdGenerated(rank=r.rank, uid_bytes=uid)))
        elif isinstance(msg, m.NewNcclSession):
            self.sessions[msg.uid_bytes] = msg.new_world_size
            r.uid = msg.uid_bytes
        elif isinstance(msg, m.DeclareDead):
            if msg.rank == r.rank:
                r.silent = True  # fenced: a rank declared dead exits
            else:
                r.uid = None  # leaves the process group until the next session
        elif isinstance(msg, m.ExtendPartition):
            bs = self.config.schedule.batch_size
            r.plans.append([msg.epoch, msg.partition_offset // bs, msg.partition_size // bs,
                            0])
        elif isinstance(msg, m.SetGlobalStep):
            r.budget = msg.step_budget[r.rank] if msg.step_budget else 10**9
            bs = self.config.schedule.batch_size
            r.plans += [[p.plan.epoch, p.plan.partition_offset // bs,
                         p.plan.partition_size // bs, 0] for p in msg.plans if p.rank == r.rank]
        elif isinstance(msg, m.StartEpoch):
            p = msg.plan
            bs = self.config.schedule.batch_size
            r.plans.append([p.epoch, p.partition_offset // bs, p.partition_size // bs, 0])
        elif isinstance(msg, m.SyncNow):
            r.budget = 0
            self._enter_collective(r)
        elif isinstance(msg, m.ExecuteEvalCallback):
            self._callback(r, lambda: Timing(m.EvalResult(
                rank=r.rank, schedule_id=msg.schedule_id, epoch=msg.epoch, metric=0.9,
                elapsed_ms=r.callback_ms)))
        elif isinstance(msg, m.Checkpoint):
            self._callback(r, lambda: Timing(m.CheckpointResult(
                rank=r.rank, version=msg.version, elapsed_ms=r.callback_ms,
                error="disk full" if r.fail_checkpoint else None)))
        elif isinstance(msg, m.Shutdown | m.ShutdownWithSave):
            r.exited = True
            self.to_core(Timing(m.Exiting(rank=r.rank)))

    def _callback(self, r: SimRank, result: Callable[[], Event]) -> None:
        # a callback blocks the rank for callback_ms; its result follows
        r.busy = True

        def done() -> None:
            r.busy = False
            if r.silent:
                return  # it died (or hangs) during the callback: no result comes
            self.to_core(result())
            self._drain(r)
        self.at(self.now + r.callback_ms / 1000.0, done)

    def _maybe_train(self, r: SimRank) -> None:
        if r.busy or r.exited or r.silent or r.inbox:
            return
        if not r.plans or r.steps >= r.budget:
            if r.idle_since is None:
                r.idle_since = self.now
            return
        if r.idle_since is not None:
            r.idle_ms += (self.now - r.idle_since) * 1000.0
            r.idle_since = None
        r.busy = True
        self.at(self.now + r.ms_per_batch / 1000.0, lambda: self._batch_done(r))

    def _batch_done(self, r: SimRank) -> None:
        r.busy = False
        if r.exited or r.silent:
            return
        plan = r.plans[0]
        epoch, first, size, done = plan
        r.trained[(epoch, first + done)] += 1
        r.unsealed.append((epoch, first + done))
        self.batch_log.append((self.now, r.rank, epoch, first + done))
        plan[3] += 1
        r.step += 1
        r.steps += 1
        r.batches += 1
        # like the agent: the report after which the rank stops is stored with an ack (and
        # retried), so only the others can be lost
        closing = r.steps >= r.budget or (plan[3] == size and len(r.plans) == 1)
        if closing or self.lose_batch_report is None or not self.lose_batch_report(r.rank,
                                                                                   r.step):
            self.to_core(Timing(m.Batch(rank=r.rank, batch_ms=r.ms_per_batch, data_ms=0.0,
                                        step_count=r.step, batch_loss=1.0)))
        if plan[3] == size:
            r.plans.popleft()
            metrics = m.MetricsMsg(
                rank=r.rank, epoch=epoch, avg_loss=1.0, batches_processed=size,
                epoch_ms=size * r.ms_per_batch, samples_processed=size * 8,
                share_complete_ms=size * r.ms_per_batch, compute_only_ms=size * r.ms_per_batch,
                scalars={"acc": m.ScalarSum(sum=0.5 * size, count=size)})
            if closing or r.held:
                r.held.append(metrics)
            else:
                self.to_core(Metrics(metrics))
        self._drain(r)

    # ------------------------------------------------------------------ queries

    def records(self, event: str) -> list[dict[str, Any]]:
        return [c.fields for c in self.commands if isinstance(c, Record) and c.event == event]

    def refusals(self) -> list[Refuse]:
        return [c for c in self.commands if isinstance(c, Refuse)]

    def timings_of(self, cls: type[Any]) -> list[tuple[float, Any]]:
        """(delivery time, msg) of every TimingMsg of type ``cls`` the core received."""
        return [(t, e.msg) for t, e in self.delivered
                if isinstance(e, Timing) and isinstance(e.msg, cls)]

    def sent_of(self, cls: type[Any]) -> list[tuple[float, int | None, Any]]:
        return [x for x in self.sent if isinstance(x[2], cls)]
