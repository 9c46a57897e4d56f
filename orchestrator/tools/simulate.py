"""``ddpbus simulate``: many lightweight ranks that speak the real protocol, without training.

One process plays ``--ranks`` ranks of a job against a real coordinator over a real NATS
server, so one machine can drive the coordinator like a large cluster. Each simulated rank
bumps its KV generation, says ``Hello``, waits for ``Accept``, answers ``RequestNewNcclId``,
joins every ``NewNcclSession`` (there is no collective to form), trains the plans it is
given at its own speed inside the budget of each ``SetGlobalStep`` — one ``Batch`` report
per batch at ``rate * speed`` batches per second, a ``MetricsMsg`` per finished plan —
answers ``SyncNow`` with ``SyncAck``, callbacks with their results, beats on
``live.rank.N`` every second, and says ``Exiting`` on ``Shutdown``. Every message is
encoded, signed and fenced by the codec exactly as a worker's are. With ``kill=(COUNT,
SECONDS)`` the COUNT highest ranks die together SECONDS after the cohort's first batch, as
a rack that loses power: no Exiting, no more beats, reports or answers (what they held is
lost), for the coordinator to find by their silence.

Each rank reads its control subjects as a worker does, from its own durable consumer
(``intake="durable"``, the default: in stream order, acked, so the stream's retention sees
real ack floors), or, for the largest loads, all ranks through one core-NATS subscription
(``intake="core"``: no per-rank fan-out of ``control.all``, no acks, duplicates dropped by
``Nats-Msg-Id``). One process stands for the whole cohort, so its pauses would pause every
rank at once: ``ddpbus simulate`` freezes the cohort once it is built and makes the cycle
collector's full passes once it has answered a SyncNow (:mod:`.collector`), not wherever an
allocation crosses the threshold (30-60 ms each at 1,024 ranks, every second or two, after
which every rank sent what it held together: a burst no cluster sends).
What it leaves out, by design: tensors (no model, no collective:
``divergence`` is a small random number). The broker backend is not simulated (its
snapshots are tensors).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import logging
import os
import random
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Final, TypeVar

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from ddpbus.codecs import Decoder, Encoder, Outbound
from ddpbus.codecs import messages as m
from ddpbus.codecs import subjects as sj
from ddpbus.codecs.errors import ConfigError, DdpbusError, DecodeError
from ddpbus.orchestrator.core.coalesce import ReportBuffer
from ddpbus.orchestrator.core.gc_policy import Collector
from ddpbus.orchestrator.transport import bus

log = logging.getLogger(__name__)
T = TypeVar("T")

SIGNATURE: Final = b"\x5a" * m.MODEL_SIGNATURE_BYTES  # one model: every rank the same
HEARTBEAT_S: Final = 1.0
BEAT_SLICE_S: Final = 0.02  # the ranks' beats go out in slices this far apart
TICK_S: Final = 0.005  # the batch clock's resolution
SEEN_IDS: Final = 200_000  # control Nats-Msg-Ids remembered, for duplicates
INTAKES: Final = ("durable", "core")


def speeds(spec: str, n: int, seed: int) -> list[float]:
    """``n`` speed factors (mean about 1) from ``spec``: ``equal``; ``uniform:LO,HI``;
    ``lognormal:SIGMA``; ``slow:FRACTION,FACTOR`` (that fraction of the ranks, at least one,
    runs FACTOR times slower)."""
    rng = random.Random(seed)  # noqa: S311 - a load shape, not a secret
    kind, _, args = spec.partition(":")
    try:
        values = [float(a) for a in args.split(",")] if args else []
    except ValueError:
        raise ConfigError(f"--speeds {spec!r}: arguments must be numbers") from None
    if kind == "equal" and not values:
        return [1.0] * n
    if kind == "uniform" and len(values) == 2 and 0 < values[0] <= values[1]:
        return [rng.uniform(values[0], values[1]) for _ in range(n)]
    if kind == "lognormal" and len(values) == 1 and values[0] >= 0:
        sigma = values[0]
        return [rng.lognormvariate(-sigma * sigma / 2, sigma) for _ in range(n)]
    if kind == "slow" and len(values) == 2 and 0 < values[0] <= 1 and values[1] >= 1:
        slow = max(1, round(n * values[0]))
        return [1.0 / values[1] if r < slow else 1.0 for r in range(n)]
    raise ConfigError(f"--speeds {spec!r}: one of equal, uniform:LO,HI, lognormal:SIGMA, "
                      "slow:FRACTION,FACTOR")


@dataclass(slots=True)
class _Plan:
    epoch: int
    size: int  # batches
    done: int = 0
    started_at: float | None = None


@dataclass(slots=True)
class SimRank:
    rank: int
    rate: float  # batches per second
    encoder: Encoder | None = None
    run: m.RunConfig | None = None
    sessions: int = 0
    step: int = 0
    window_steps: int = 0
    budget: int = 0
    open: bool = False
    throttled: bool = False
    plans: deque[_Plan] = field(default_factory=deque)
    exited: bool = False
    scheduled: bool = False  # on the batch clock
    reports: ReportBuffer = field(init=False)  # Batch reports not yet sent (coalesced)

    def __post_init__(self) -> None:
        self.reports = ReportBuffer(self.rank)

    def can_train(self) -> bool:
        return (not self.exited and self.sessions > 0 and self.open and not self.throttled
                and self.window_steps < self.budget and bool(self.plans))


class SimulatedCohort:
    """``world`` simulated ranks of ``job`` on connection ``nc``; :meth:`run` until every
    rank has exited (or the task is cancelled)."""

    def __init__(self, nc: Client, job: str, key: bytes, world: int, *, rate: float = 10.0,
                 speed: list[float] | None = None, dataset_size: int = 0,
                 join_timeout: float = 60.0, intake: str = "durable",
                 kill: tuple[int, float] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 collector: Collector | None = None) -> None:
        if world < 1 or rate <= 0:
            raise ConfigError("simulate needs at least one rank and a positive rate")
        if kill is not None and not (0 < kill[0] < world and kill[1] >= 0):
            raise ConfigError(f"kill {kill[0]}@{kill[1]}: between 1 and {world - 1} ranks "
                              "(one must survive), at 0 seconds or later")
        self.kill = kill
        # with a collector (``ddpbus simulate``, whose process leaves full collections
        # to it) the cohort makes them once its SyncAcks are out: one process stands for
        # a thousand hosts, and a full pass (30-60 ms here) at any other moment paused
        # every simulated rank at once, to send what it held together, a burst no cluster
        # sends
        self.collector = collector
        self._collecting = False  # a pass is scheduled
        self.killed: list[int] = []  # the ranks that died together
        self._first_batch_at: float | None = None
        if intake not in INTAKES:
            raise ConfigError(f"intake must be one of {', '.join(INTAKES)}, got {intake!r}")
        self.intake = intake
        self.nc, self.js, self.job, self.key = nc, nc.jetstream(), job, key
        self.world, self.clock, self.join_timeout = world, clock, join_timeout
        factors = speed or [1.0] * world
        self.ranks = [SimRank(rank=r, rate=rate * factors[r]) for r in range(world)]
        self.dataset_size = dataset_size or world * 64 * 20
        self._floor = 0  # the coordinator generation of the Accepts
        self.decoder = Decoder(job=job, key=key, generation_floor=self._fence)
        self._due: list[tuple[float, int]] = []  # (when, rank): the batch clock
        self.sent: Counter[str] = Counter()
        self.received: Counter[str] = Counter()  # per rank it was for
        self.refused: Counter[str] = Counter()
        self._pending: set[asyncio.Task[None]] = set()
        self._all_exited = asyncio.Event()
        self._rng = random.Random(world)  # noqa: S311 - simulated divergences
        self._seen: set[str] = set()  # Nats-Msg-Ids of the control messages handled
        self._order: deque[str] = deque(maxlen=SEEN_IDS)
        self.duplicates = 0

    def _fence(self, sender: str) -> int:
        return self._floor if sender == sj.COORDINATOR else 0

    # ------------------------------------------------------------------ wiring

    async def run(self) -> None:
        kv = await self._bucket()
        gens = await asyncio.gather(*(bus.next_generation(kv, f"rank-{r.rank}")
                                      for r in self.ranks))
        for r, gen in zip(self.ranks, gens, strict=True):
            r.encoder = Encoder(job=self.job, key=self.key, sender=f"rank-{r.rank}",
                                generation=gen)
        subs, readers = [], []
        if self.intake == "core":
            subs = [await self.nc.subscribe(sj.job_wildcard(self.job, kind), cb=self._on_control,
                                            pending_msgs_limit=0, pending_bytes_limit=0)
                    for kind in ("control", "admit")]
        else:
            stream = sj.stream_name(self.job)
            await self._consumers(stream)
            readers = [asyncio.create_task(bus.StreamReader(
                self.nc, stream, sj.rank_consumer(r.rank), self._reader_for(r)).run())
                for r in self.ranks]
        await self.nc.flush()
        for r, gen in zip(self.ranks, gens, strict=True):
            self._send(r, m.Hello(rank=r.rank, generation=gen, host="simulated",
                                  device="cpu", model_signature=SIGNATURE,
                                  world_size=self.world, pid=os.getpid(), backend="gloo",
                                  dataset_size=self.dataset_size), durable=True)
        beats = asyncio.create_task(self._beat())
        clock = asyncio.create_task(self._batch_clock())
        try:
            await self._all_exited.wait()
            await asyncio.gather(*self._pending)
            await self.nc.flush()
        finally:
            beats.cancel()
            clock.cancel()
            if self.collector is not None:
                log.info("full collections, after the SyncAcks: %s", self.collector.report())
            for t in readers:
                t.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
            for s in subs:
                with contextlib.suppress(Exception):
                    await s.unsubscribe()

    async def _made(self, what: str, probe: Callable[[], Awaitable[T]]) -> T:
        """``probe()`` once the coordinator has made what it reads, polled for until
        ``join_timeout`` seconds: like a worker, the cohort may start before its coordinator
        has made the job's resources."""
        deadline = self.clock() + self.join_timeout
        while True:
            try:
                return await probe()
            except (BucketNotFoundError, NotFoundError):
                if self.clock() > deadline:
                    raise DdpbusError(f"job {self.job!r} has no {what}; start its "
                                      "coordinator (with a world size of at least "
                                      f"{self.world}) or `ddpbus init-job`") from None
                await asyncio.sleep(0.2)  # poll interval of a deadline-bound wait

    async def _bucket(self) -> KeyValue:
        return await self._made(f"KV bucket {sj.kv_bucket(self.job)}",
                                lambda: self.js.key_value(sj.kv_bucket(self.job)))

    async def _consumers(self, stream: str) -> None:
        for r in self.ranks:
            name = sj.rank_consumer(r.rank)
            await self._made(f"consumer {name}", functools.partial(
                self.js.consumer_info, stream, name))

    def _reader_for(self, r: SimRank) -> Callable[[Msg], Awaitable[None]]:
        async def handler(msg: Msg) -> None:
            await self._on_control(msg, only=r)
        return handler

    def _send(self, r: SimRank, msg: m.Message, *, durable: bool = False) -> None:
        """Publish one of ``r``'s messages: a JetStream publish with an ack where a worker
        waits for one (``durable``), else a plain publish (the stream still stores it).
        Batch reports held back for coalescing go first, as a worker sends them."""
        if not isinstance(msg, m.Heartbeat):  # (core NATS, outside the stream's order)
            self._flush_reports(r)
        self._emit(r, msg, durable=durable)

    @staticmethod
    def _interval(r: SimRank) -> float:
        return r.run.report_interval_ms if r.run is not None else 0.0

    def _report(self, r: SimRank, batch: m.Batch, now: float, *, closing: bool) -> None:
        """A Batch report, coalesced as a worker's (:mod:`ddpbus.orchestrator.core.coalesce`)."""
        if r.reports.add([batch], now, self._interval(r), closing=closing):
            self._flush_reports(r, durable=closing)

    def _flush_reports(self, r: SimRank, *, durable: bool = False) -> None:
        if r.reports.items:
            self._emit_all(r, r.reports.take(self._interval(r), durable=durable))

    def _emit(self, r: SimRank, msg: m.Message, *, durable: bool) -> None:
        if r.encoder is None:
            raise ConfigError(f"simulated rank {r.rank} sends before it has a generation")
        spec = (sj.LIVE_RANK if isinstance(msg, m.Heartbeat) else
                sj.JOIN_RANK if isinstance(msg, m.Hello) else
                sj.METRICS_RANK if isinstance(msg, m.MetricsMsg) else sj.TIMING_RANK)
        out = r.encoder.encode(spec.subject(self.job, r.rank), msg)
        self.sent[type(msg).__name__] += 1
        task = asyncio.create_task(self._publish(out, durable=durable))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _publish(self, out: Outbound, *, durable: bool) -> None:
        if durable:
            await bus.retry_while_away(lambda: bus.publish(self.js, out))
        else:
            await self.nc.publish(out.subject, out.payload, headers=out.headers)

    async def _on_control(self, msg: Msg, only: SimRank | None = None) -> None:
        """One control or admit message: for ``only`` (read from its durable, in stream
        order, deduplicated by the stream) or, from the core subscription, for every rank
        it names."""
        try:
            env = self.decoder.decode(msg.subject, msg.headers, msg.data)
        except DecodeError as exc:
            self.refused[exc.reason] += 1
            return
        if only is not None:
            if not only.exited:
                self.handle(only, env.message)
            return
        if env.msg_id:
            # a core subscription sees a re-published command again (a coordinator that
            # took over re-sends its snapshot's outbox): drop what the stream dropped
            if env.msg_id in self._seen:
                self.duplicates += 1
                return
            if len(self._order) == self._order.maxlen:
                self._seen.discard(self._order[0])
            self._order.append(env.msg_id)
            self._seen.add(env.msg_id)
        kind = sj.parse_subject(msg.subject, self.job)
        targets = self.ranks if kind.rank is None else (
            [self.ranks[kind.rank]] if kind.rank < self.world else [])
        for r in targets:
            if not r.exited:
                self.handle(r, env.message)

    # ---------------------------------------------------------------- protocol

    def handle(self, r: SimRank, msg: object) -> None:  # noqa: C901, PLR0912 - one dispatch
        if isinstance(msg, m.Accept):
            r.run = msg.run
            self._floor = max(self._floor, msg.coordinator_generation)
        elif isinstance(msg, m.Reject):
            log.error("simulated rank %d rejected: %s", r.rank, msg.reason)
            self._exit(r, say=False)
        elif isinstance(msg, m.RequestNewNcclId):
            self._send(r, m.NewNcclIdGenerated(rank=r.rank,
                                               uid_bytes=os.urandom(m.NCCL_ID_BYTES)),
                       durable=True)
        elif isinstance(msg, m.NewNcclSession):
            r.sessions += 1
        elif isinstance(msg, m.SetGlobalStep):
            r.open = True
            r.budget = msg.step_budget[r.rank] if r.rank < len(msg.step_budget) else (
                2**62 if not msg.step_budget else 0)
            for p in msg.plans:  # the window's plans: this rank's, as StartEpochs
                if p.rank == r.rank:
                    self.handle(r, m.StartEpoch(plan=p.plan))
        elif isinstance(msg, m.StartEpoch | m.ExtendPartition):
            epoch = msg.plan.epoch if isinstance(msg, m.StartEpoch) else msg.epoch
            size = (msg.plan.partition_size if isinstance(msg, m.StartEpoch)
                    else msg.partition_size)
            batch = r.run.batch_size if r.run is not None else 1
            r.plans.append(_Plan(epoch=epoch, size=size // batch))  # whole batches
        elif isinstance(msg, m.SyncNow):
            self._send(r, m.SyncAck(rank=r.rank, step_count=r.step,
                                    divergence=self._rng.uniform(0.0, 0.02)), durable=True)
            self._after_ack(r)
            r.open, r.window_steps, r.throttled = False, 0, False
            self._quiet_moment()
        elif isinstance(msg, m.Throttle):
            r.throttled = True
        elif isinstance(msg, m.DeclareDead):
            if msg.rank == r.rank:
                self._exit(r, say=False)
        elif isinstance(msg, m.ExecuteEvalCallback) and msg.target_rank == r.rank:
            self._send(r, m.EvalResult(rank=r.rank, schedule_id=msg.schedule_id,
                                       epoch=msg.epoch, metric=0.0, elapsed_ms=0.0),
                       durable=True)
        elif isinstance(msg, m.Checkpoint) and msg.target_rank == r.rank:
            self._send(r, m.CheckpointResult(rank=r.rank, version=msg.version,
                                             elapsed_ms=0.0), durable=True)
        elif isinstance(msg, m.Shutdown | m.ShutdownWithSave):
            self._exit(r, say=True)
        # the rest (CoordHeartbeat, EpochAggregated, EvalBroadcast, SetEpochCallbackRole,
        # SaveConsensusModel, StageAdvisory, ...) carry nothing a rank without a model acts
        # on: counted, like everything received
        self.received[type(msg).__name__] += 1
        self._schedule(r)

    def _after_ack(self, r: SimRank) -> None:
        """The metrics held since the window closed: now (interval 0), or behind the next
        reports or at their due time, as a worker sends them."""
        now = self.clock()
        self._emit_all(r, r.reports.acked(now, self._interval(r)))
        if r.reports.due is not None:
            asyncio.get_running_loop().call_later(max(0.0, r.reports.due - now),
                                                  self._send_overdue, r)

    def _send_overdue(self, r: SimRank) -> None:
        if not r.exited:
            self._emit_all(r, r.reports.overdue(self.clock()))

    def _emit_all(self, r: SimRank, msgs: list[tuple[m.Message, bool]]) -> None:
        for msg, durable in msgs:
            self._emit(r, msg, durable=durable)

    def _exit(self, r: SimRank, *, say: bool) -> None:
        if say:
            self._flush_reports(r)
            self._emit_all(r, r.reports.release())
            self._send(r, m.Exiting(rank=r.rank), durable=True)
        r.exited = True
        if all(x.exited for x in self.ranks):
            self._all_exited.set()

    def _schedule(self, r: SimRank) -> None:
        if not r.scheduled and r.can_train():
            r.scheduled = True
            heapq.heappush(self._due, (self.clock() + 1.0 / r.rate, r.rank))

    def train_one(self, r: SimRank, now: float) -> None:
        """One batch of ``r``'s head plan: its Batch report, and the plan's MetricsMsg
        when it is the last."""
        plan = r.plans[0]
        if self._first_batch_at is None:
            self._first_batch_at = now
        if plan.started_at is None:
            plan.started_at = now
        plan.done += 1
        r.step += 1
        r.window_steps += 1
        finished = plan.done >= plan.size
        closing = r.window_steps >= r.budget or (finished and len(r.plans) == 1)
        self._report(r, m.Batch(rank=r.rank, batch_ms=1000.0 / r.rate, data_ms=0.0,
                                step_count=r.step, batch_loss=1.0 / (1.0 + 0.01 * r.step)),
                     now, closing=closing)
        if finished:
            r.plans.popleft()
            batch = r.run.batch_size if r.run is not None else 1
            metrics = m.MetricsMsg(rank=r.rank, epoch=plan.epoch,
                                   avg_loss=1.0 / (1.0 + 0.01 * r.step),
                                   batches_processed=plan.done,
                                   epoch_ms=(now - plan.started_at) * 1000.0,
                                   samples_processed=plan.done * batch)
            for msg, durable in r.reports.metrics(metrics):  # now, or held (reports.py)
                self._send(r, msg, durable=durable)

    def _maybe_kill(self, now: float) -> None:
        """The ``kill`` ranks die, at once, when their moment has come."""
        if (self.kill is None or self.killed or self._first_batch_at is None
                or now < self._first_batch_at + self.kill[1]):
            return
        for r in self.ranks[self.world - self.kill[0]:]:
            if not r.exited:
                r.reports.items.clear()  # held, never sent: lost with the rank
                self.killed.append(r.rank)
                self._exit(r, say=False)
        log.info("simulated ranks %s died together", self.killed)

    async def _batch_clock(self) -> None:
        while True:
            now = self.clock()
            self._maybe_kill(now)
            while self._due and self._due[0][0] <= now:
                due, rank = heapq.heappop(self._due)
                r = self.ranks[rank]
                r.scheduled = False
                if r.can_train():
                    self.train_one(r, now)
                    if r.can_train():
                        r.scheduled = True  # keep the rank's own pace, not the clock's
                        heapq.heappush(self._due, (max(due + 1.0 / r.rate, now), rank))
                    else:  # idle now: nothing of its stays behind
                        self._flush_reports(r)
            await asyncio.sleep(TICK_S)

    def _quiet_moment(self) -> None:
        """An average asked for: a full collection if one is due, once every rank has
        answered it and the answers are on the wire (the coordinator times the averaging
        by them; the ranks then wait for the window's plans, which come with the SyncNow)."""
        if self.collector is not None and not self._collecting and self.collector.quiet_due():
            self._collecting = True
            task = asyncio.ensure_future(self._collect())
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def _collect(self) -> None:
        try:
            with contextlib.suppress(*bus.TRANSIENT_ERRORS):
                await self.nc.flush(timeout=1)
            if self.collector is not None:
                self.collector.collect()
        finally:
            self._collecting = False

    async def _beat(self) -> None:
        """Every rank beats once a ``HEARTBEAT_S``, rank r at phase r / ranks of it: real
        workers start at different moments and their timers never line up (all of them
        at once would be a burst no cluster sends)."""
        n = len(self.ranks)
        slices = min(n, round(HEARTBEAT_S / BEAT_SLICE_S))
        while True:
            started = self.clock()
            if self.collector is not None and self.collector.overdue():
                self.collector.collect()
            for k in range(slices):
                for r in self.ranks[k * n // slices:(k + 1) * n // slices]:
                    if not r.exited and r.encoder is not None and r.run is not None:
                        self._send(r, m.Heartbeat(rank=r.rank, step_count=r.step))
                await asyncio.sleep(max(0.0, started + (k + 1) * HEARTBEAT_S / slices
                                        - self.clock()))
