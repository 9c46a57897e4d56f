"""The coordinator's asyncio shell around the pure core (``ddpbus coordinator``).

It only translates: stream deliveries (timing, metrics, join) and live heartbeats become
events, a 100 ms ticker becomes :class:`Tick`, SIGTERM/SIGINT become :class:`Stop`; the
commands :func:`~ddpbus.orchestrator.core.transition` returns become publishes (in order,
through one :class:`~ddpbus.orchestrator.transport.bus.Publisher`), event-log lines and, at the end,
the run summary. CoordHeartbeat goes out every second on live.coordinator, whatever the core
is doing. A message that fails decoding, signing or fencing is counted, logged once per
reason, and never reaches the core.

Resumability (see :mod:`.snapshot`, :mod:`.journal` and :mod:`.lease`): the shell holds the
job's leader lease while it runs, and before publishing any command it stores a write-ahead
record of the core: a full snapshot now and then, a journal segment (the events applied
since the last write, with their times) in between. A coordinator that starts on a job with
progress (a restart, or a standby taking over) re-writes the snapshot it loads (which fences
the old incarnation's stores), replays the journal segments on it, re-publishes the
unstored commands verbatim, fences the old incarnation on the bus with a control message of
its own, newer generation, and replays the stream after the covered sequence through the
same core.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import IO, Any, Final

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy
from nats.js.errors import NotFoundError

from ddpbus.codecs import Decoder, Encoder, Outbound, convert
from ddpbus.codecs import messages as m
from ddpbus.codecs import subjects as sj
from ddpbus.codecs.errors import DdpbusError
from ddpbus.orchestrator.core import bundle_meta, rounds
from ddpbus.orchestrator.core.config import describe
from ddpbus.orchestrator.core.gc_policy import Collector
from ddpbus.orchestrator.core.state import (
    Admit,
    BusRestored,
    CoreConfig,
    Event,
    Finish,
    Phase,
    Record,
    Reduce,
    Refuse,
    Send,
    Stop,
    Tick,
    Timing,
    event_of,
)
from ddpbus.orchestrator.core.summary import summarize
from ddpbus.orchestrator.core.transition import initial_state, resume, transition
from ddpbus.orchestrator.persist import bundles, journal, snapshot
from ddpbus.orchestrator.persist.lease import Holder, Lease, LeaseLost
from ddpbus.orchestrator.persist.write_ahead import JobInUse, WriteAhead
from ddpbus.orchestrator.runtime import broker_reducer
from ddpbus.orchestrator.runtime.endpoint import Endpoint
from ddpbus.orchestrator.runtime.intake import Intake
from ddpbus.orchestrator.runtime.latency import Latency
from ddpbus.orchestrator.runtime.metrics import CoordinatorMetrics
from ddpbus.orchestrator.runtime.presence import Presence
from ddpbus.orchestrator.runtime.provision import (
    JobStorage,
    consumer_configs,
    ensure_job,
    retire_consumers,
)
from ddpbus.orchestrator.runtime.retention import Compactor, Retention
from ddpbus.orchestrator.transport import bus
from ddpbus.orchestrator.transport.auth import Access

log = logging.getLogger(__name__)
events_log = logging.getLogger("ddpbus.orchestrator.events")

TICK_S = 0.1


@dataclass(frozen=True, kw_only=True)
class CoordinatorSettings:
    job: str
    nats: Access  # the URL, the coordinator identity's credentials
    key: bytes
    # a system-account login: the broker's disconnect advisories tell a dead rank at once
    system: Access | None = None
    summary_path: Path | None = None
    events_path: Path | None = None
    wire_json: bool = False
    connect_deadline: timedelta = timedelta(seconds=30)
    standby: bool = False  # wait for the lease rather than fail
    lease_ttl: float = 5.0
    resume: str | None = None  # --resume SOURCE: a bundle directory or an earlier job
    report_dir: Path | None = None  # write the run report (HTML + plots) here at the end
    metrics_port: int | None = None  # serve Prometheus /metrics here (0: any free port)
    metrics_host: str = "0.0.0.0"  # noqa: S104 - a pod's port; `ddpbus run` uses loopback
    retention: Retention = dataclasses.field(default_factory=Retention)  # what may go
    stream_max_bytes: int | None = None  # the stream's backstop limit (None: leave it)
    snapshot_every: float = journal.FULL_EVERY_S  # full snapshots at most this often


EXIT_FAILED = 1  # the run ended not ok, or a task of this coordinator failed
EXIT_DEPOSED = 3
EXIT_FINISHED = 4  # the job had already run to its end: nothing was trained
SYNC_NOW: Final = convert.BY_CLASS[m.SyncNow].type_name  # its Ddpbus-Type header
# the records that close an average (every rank answered it, or its broker round ended):
# the quiet moment for a full snapshot and a full collection. The ranks train the window
# they were given with the SyncNow, the next gate is a window away, and the thousand
# SyncAcks that follow a SyncNow are in (blocking the loop among them would delay their
# reading, and with it the reduce time El Che weighs the averaging by)
ROUND_OVER: Final = frozenset({"averaged", "update"})


def round_split(decided_at: float | None, published_at: float, acks: list[m.SyncAck]
                ) -> dict[str, float]:
    """Where an average's time went, for its "averaged" record (milliseconds):
    ``write_ahead_ms``, the SyncNow's decision to its hand-off to the publisher (the
    write-ahead record stored first); ``deliver_ms``, the decision to the SyncNow held by
    its last rank (the ranks' clocks against this one's: exact on one host);
    ``average_ms`` and ``collective_ms``, the in-place average and its collective call as
    the rank that waited least in them saw them (the others' times include waiting for a
    peer to enter). A figure is left out when a rank did not report it (an older rank, or
    a failed collective)."""
    out: dict[str, float] = {}
    if decided_at is None:
        return out
    out["write_ahead_ms"] = round((published_at - decided_at) * 1000.0, 3)
    done = [a for a in acks if not a.failed]
    if not done or len(done) < len(acks):
        return out
    arrivals = [a.received_at for a in done]
    if all(t is not None for t in arrivals):
        out["deliver_ms"] = round((max(t for t in arrivals if t is not None) - decided_at)
                                  * 1000.0, 3)
    for key in ("average_ms", "collective_ms"):
        values = [getattr(a, key) for a in done]
        if all(v is not None for v in values):
            out[key] = round(min(v for v in values if v is not None), 3)
    return out


class Coordinator:
    def __init__(self, settings: CoordinatorSettings, config: CoreConfig) -> None:
        self.settings = settings
        self.config = config
        # wall-clock seconds: a snapshot's times stay meaningful in another process or host
        self.clock = time.time
        self.state = initial_state(config, self.clock())
        self.covered_seq = 0  # stream sequence of the last input applied
        self.resumed_from: int | None = None
        self._lock = asyncio.Lock()
        self.finish: asyncio.Future[Finish] | None = None
        self._events_file: IO[str] | None = None
        # its connection's shell and its tasks: the first task to die of an unexpected
        # exception ends the coordinator (wall clock: how long the bus was away is an input)
        self.link = Endpoint("coordinator", self._failing, clock=self.clock)
        self.watch = self.link.watch
        self.metrics: CoordinatorMetrics | None = None  # with --metrics-port
        self._pending: int | None = None  # the coordinator consumer's backlog, last read
        self.latency = Latency()
        self.started_at = time.time()
        self._replay_to: int | None = None  # the stream's last sequence at a takeover
        # group commit: commands decided but not yet covered by a stored snapshot, in
        # order, and the stream times of the inputs that led to them
        self._decided: list[Outbound] = []
        self._decided_at: list[tuple[float, bool]] = []  # (stored at, while training)
        # every event applied since the last write, with the ``now`` it was decided at:
        # the next journal segment (a full snapshot covers them instead)
        self._applied: list[tuple[Event | journal.Wire, float]] = []
        self._commit_wanted = asyncio.Event()
        self._committed = asyncio.Event()  # set while nothing decided waits, no write runs
        self._committed.set()
        # when the latest SyncNow was handed to the publisher (after its snapshot): the
        # "averaged" record adds the time from there to the last SyncAck (the core's own
        # reduce_ms starts at the decision, before the write-ahead snapshot)
        self._sync_published_at: float | None = None
        # the latest SyncNow's decision (wall clock) and the SyncAcks read since: the
        # "averaged" record splits the round with them (round_split)
        self._sync_decided_at: float | None = None
        self._round_acks: list[m.SyncAck] = []
        self.replay_s: float | None = None  # lease taken to caught up with the stream
        # full passes of the cycle collector, at quiet moments (see core/gc_policy.py)
        self.collector = Collector()
        self._round_over = False  # an average is over: a quiet moment (ROUND_OVER)
        self._waited = False  # waited for the lease (a standby)

    async def run(self) -> int:
        s = self.settings
        nc = await s.nats.connect(s.job, name=f"ddpbus-{s.job}-coordinator",
                               deadline=s.connect_deadline, on_disconnect=self._bus_lost,
                               on_reconnect=self._bus_back)
        wall0, cpu0 = time.perf_counter(), time.process_time()
        try:
            return await self._run(nc)
        finally:
            # read by bench/overhead.py, beside each rank's own account
            log.info("coordinator: cpu %.3f s over %.3f s", time.process_time() - cpu0,
                     time.perf_counter() - wall0)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 5.0)
            if self._events_file is not None:
                try:
                    self._events_file.close()
                except OSError as exc:  # (a full disk: the failure said so already)
                    log.warning("could not close %s: %s", self.settings.events_path, exc)

    async def _run(self, nc: Client) -> int:
        s = self.settings
        js = nc.jetstream()
        if await bus.run_is_over(js, s.job):
            # a reinstall on the same store, or a restart after the end: never exit 0
            # having trained nothing (provision nothing, so there is nothing to retire)
            self._finished_already(" (its summary is stored)")
            await self._retire_consumers(js)  # any an interrupted end left behind
            return EXIT_FINISHED
        await ensure_job(js, s.job, self.config.world_size,
                         JobStorage(max_bytes=s.stream_max_bytes))
        kv = await js.key_value(sj.kv_bucket(s.job))
        snap = await self._take_over(js, kv)
        if snap is not None and snap.state.phase is Phase.DONE:
            await self._retire_consumers(js)  # (ensure_job above made them again)
            await self.lease.release()
            if self._waited:  # a standby: the leader ended the run while it waited
                log.info("job %s ran to its end under another coordinator; this standby "
                         "is done", s.job)
                return 0
            # ended, but its summary was not stored (the broker went at the very end)
            self._finished_already("")
            return EXIT_FINISHED
        generation = self.config.coordinator_generation
        self.encoder = Encoder(job=s.job, key=s.key, sender=sj.COORDINATOR,
                               generation=generation, wire_json=s.wire_json)
        # a rank's older incarnation is fenced: below the generation admitted last
        self.intake = Intake(Decoder(job=s.job, key=s.key, generation_floor=self._rank_floor),
                             self.config.world_size)
        # a message it gives up on (not stored after its retry deadline) leaves a gap in
        # what the ranks were told: end here, a successor re-publishes from the snapshot
        self.nc = nc
        self.publisher = self.link.publisher = bus.Publisher(
            js, on_failed=lambda exc: self.watch.fail("publisher", exc))
        self.reducer = broker_reducer.Reducer(js, s.job, nc.max_payload)
        info = await js.stream_info(sj.stream_name(s.job))
        self.compactor = Compactor(nc, s.job, s.retention, lambda: self.state.members,
                                   max_bytes=info.config.max_bytes or -1)
        if self.resumed_from is not None:
            self.compactor.stored(self.resumed_from)  # the predecessor's snapshot
        if snap is not None:
            for out in snap.outbox:  # verbatim: JetStream drops those already stored
                self.publisher.submit(out)
            # the first control message of this generation: ranks raise their fence to it,
            # so a deposed predecessor can no longer steer them
            self.publisher.submit(self.encoder.encode(sj.CONTROL_ALL.subject(s.job),
                                                      m.CoordHeartbeat()))
            again = rounds.pending_reduce(self.state)
            if again is not None:  # the predecessor died reducing: its Reduced never came
                log.warning("round %d was being reduced by the previous coordinator; "
                            "reducing it again", again.version)
                self._start_reduce(again)
        result = await self._serve(nc)
        if self.watch.failure is not None:
            return await self._abandon()
        if result is None:
            return EXIT_DEPOSED
        done, stored = result
        # the last inputs (the ranks' Exiting) led to no command, so no snapshot yet holds
        # the end: store it, for `ddpbus status` and for a coordinator started again
        await self._snapshot([])
        summary = summarize(self.state) | {"decode_rejections": dict(self.intake.rejected),
                                           "rank_rejections": {str(r): dict(c) for r, c in
                                                               self.intake.rank_rejected.items()},
                                           "snapshots": self.wal.snapshots,
                                           "journal_segments": self.wal.journal.written,
                                           "retention": self.compactor.report(),
                                           "collector": self.collector.report(),
                                           "resumed_from_seq": self.resumed_from,
                                           "replay_s": self.replay_s,
                                           "messages_handled": self.reader.delivered,
                                           **self.latency.report()}
        await bus.retry_while_away(lambda: kv.put(sj.SUMMARY_KEY, json.dumps(summary).encode()))
        # every rank has exited (or is dead): their consumers are no longer needed, and a
        # rank started from now on finds the summary above instead of its consumer
        await self._retire_consumers(js)
        if s.summary_path is not None:
            s.summary_path.parent.mkdir(parents=True, exist_ok=True)
            s.summary_path.write_text(json.dumps(summary, indent=2) + "\n")
        (log.info if done.ok else log.error)("run %s: %s", "complete" if done.ok else "ended",
                                            done.reason)
        if s.report_dir is not None:
            await self._write_report(s.report_dir)
        await self.lease.release()
        return 0 if done.ok and stored else 1

    def _finished_already(self, how: str) -> None:
        job = self.settings.job
        log.error("job %s already ran to its end%s: nothing to train. To train again, "
                  "name a new job (helm: --set job=NAME, or a new release name), or delete "
                  "this one first: ddpbus delete-job --job %s", job, how, job)

    async def _retire_consumers(self, js: Any) -> None:
        """The run is over: delete the job's durable consumers (provision.retire_consumers).
        Best effort: a coordinator started again on the finished job retires them then."""
        try:
            n = await retire_consumers(js, self.settings.job, self.config.world_size)
        except bus.TRANSIENT_ERRORS as exc:
            log.warning("could not delete the job's consumers: %s", exc)
            return
        log.info("the run is over: deleted %d consumers of job %s", n, self.settings.job)

    async def _write_report(self, out: Path) -> None:
        """The run report from the stream; a report that fails is logged, the run stands."""
        from ddpbus.orchestrator.runtime import html_report  # matplotlib: only when asked for

        s = self.settings
        try:
            index = await html_report.build(s.nats, s.job, s.key, out)
        except (DdpbusError, OSError, ValueError) as exc:
            log.error("no run report: %s", exc)  # noqa: TRY400 - the reason, said once
            return
        log.info("run report: %s", index)

    async def _take_over(self, js: Any, kv: Any) -> snapshot.Snapshot | None:
        """Hold the lease, draw a generation, and load the predecessor's snapshot."""
        s = self.settings
        self.kv, self.js = kv, js
        self.wal = WriteAhead(js, kv, s.job, s.key, world_size=self.config.world_size,
                              every=s.snapshot_every)
        self.lease = Lease(kv, f"{socket.gethostname()}:{os.getpid()}", ttl=s.lease_ttl)
        try:
            await self.lease.take(wait=s.standby, on_wait=self._waiting)
        except LeaseLost as exc:
            raise JobInUse(f"job {s.job!r}: {exc}; pass --standby to wait for it") from None
        self.started_at = time.time()  # the lease is ours: snapshot load + replay from here
        generation = await bus.next_generation(kv, sj.COORDINATOR)
        self.config = dataclasses.replace(self.config, coordinator_generation=generation)
        if s.events_path is not None:
            s.events_path.parent.mkdir(parents=True, exist_ok=True)
            self._events_file = s.events_path.open("a", encoding="utf-8")
        snap = await self.wal.load()
        if snap is not None:
            snap = await self.wal.fence(snap)
            if self.wal.replayed[0]:
                log.info("replaying %d journal segments (%d events) after the snapshot",
                         *self.wal.replayed)
        if snap is None:
            await self._start_afresh(js)
            if s.resume is not None:
                await self._adopt_bundle(js, kv, s.resume)
            self.state = initial_state(self.config, self.clock())
            await kv.put(sj.CONFIG_KEY, json.dumps(describe(self.config.schedule)).encode())
        elif snap.state.phase is not Phase.DONE:
            if s.resume is not None:
                log.info("--resume %s was applied when job %s began; continuing from its "
                         "snapshot", s.resume, s.job)
            self._restore(snap)
            await self._rewind_consumer(js, snap.stream_seq + 1)
            last = (await js.stream_info(sj.stream_name(s.job))).state.last_seq
            if last > snap.stream_seq:
                self._replay_to = last
            else:  # the snapshot covers the stream: caught up already
                self._caught_up(snap.stream_seq)
        return snap

    def _waiting(self, holder: Holder | None) -> None:
        self._waited = True  # a standby: the run went on (and may end) meanwhile
        log.info("waiting for the coordinator lease held by %s",
                 holder.holder if holder else "?")

    async def _serve(self, nc: Client) -> tuple[Finish, bool] | None:
        """Run until the core says Finish (None when deposed first)."""
        s = self.settings
        generation = self.config.coordinator_generation
        loop = asyncio.get_running_loop()
        self.finish = loop.create_future()
        reader = bus.StreamReader(nc, sj.stream_name(s.job), sj.COORDINATOR_CONSUMER,
                                  self._on_stream, entitled=self._may_read)
        self.reader = self.link.reader = reader
        live = await nc.subscribe(sj.LIVE_RANK.wildcard(s.job), cb=self._on_live)
        tasks = [self._spawn(c, n) for c, n in (
            (self.publisher.run(), "publisher"), (reader.run(), "stream-reader"),
            (self._ticker(), "ticker"), (self._beacon(), "coord-heartbeat"),
            (self._committer(), "committer"), (self.compactor.run(), "compactor"),
            (self.lease.renew(), "lease"))]
        if s.system is not None:
            self.presence = Presence(
                s.job, self.apply,
                watched=lambda: {r.connection for r in self.state.alive if r.connection},
                unplugged=lambda: {r.rank for r in self.state.alive
                                   if r.unplugged_at is not None})
            tasks.append(self._spawn(self.presence.run(s.system), "presence"))
        metrics_server = None
        if s.metrics_port is not None:
            self.metrics = CoordinatorMetrics(s.job)
            metrics_server = self.metrics.serve(s.metrics_port, s.metrics_host)
            tasks.append(self._spawn(self._watch_lag(nc), "metrics-lag"))
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._signal, sig)
        log.info("coordinator generation %d for job %s: waiting for %d ranks", generation,
                 s.job, self.config.world_size)
        deposed = asyncio.create_task(self.lease.lost.wait(), name="deposed")
        failed = asyncio.create_task(self.watch.failed.wait(), name="failed")
        try:
            # the committer ends only when deposed (or failing: _spawn); any task that
            # fails leaves nothing decided from here on publishable, or nobody reading the
            # stream, ticking or renewing: the coordinator must not go on
            committer = next(t for t in tasks if t.get_name() == "committer")
            waits: list[asyncio.Future[Any]] = [self.finish, deposed, failed]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if self.watch.failed.is_set():
                reader.silence()  # a successor rewinds the durable to its snapshot anyway
                return None
            if self.lease.lost.is_set():
                reader.silence()  # its acks would land on the successor's consumer
                log.error("deposed: another coordinator took the lease; exiting without "
                          "publishing anything more")
                return None
            done = self.finish.result()
            await self._drain(committer)
            if self.watch.failed.is_set():
                return None
            stored = await self.publisher.flush(30.0)
        finally:
            self.watch.closing = True
            deposed.cancel()
            failed.cancel()
            if metrics_server is not None:
                metrics_server.shutdown()
            for t in tasks:
                t.cancel()
            with contextlib.suppress(Exception):  # bounded: a deposed one must go at once
                await asyncio.wait_for(asyncio.gather(live.unsubscribe(), *tasks,
                                                      return_exceptions=True), 5.0)
        return done, stored

    # ---------------------------------------------------------------- resuming

    async def _adopt_bundle(self, js: Any, kv: Any, source: str) -> None:
        """``--resume``: check the bundle against this run, seed the core from its meta, and
        publish it under ``bundle.resume`` for the ranks to load."""
        manifest = await bundles.resolve(js, source)
        sched = self.config.schedule
        bundles.check_fits(manifest, seed=sched.seed, batch_size=sched.batch_size,
                           epochs=sched.epochs)
        point = bundle_meta.point(manifest.describe(), manifest.version, manifest.meta)
        self.config = dataclasses.replace(self.config, resume=point)
        await kv.put(sj.RESUME_BUNDLE_KEY, manifest.to_json())
        log.warning("job %s resumes from %s", self.settings.job, manifest.describe())
        self._record(Record("resumed-from-bundle", {
            "source": source, "job": manifest.job, "version": manifest.version,
            "epoch": point.epoch, "global_step": point.global_step,
            "world_size": point.world_size}))

    def _restore(self, snap: snapshot.Snapshot) -> None:
        now = self.clock()
        state = resume(snap.state, self.config.coordinator_generation, now)
        self.state, self.covered_seq = state, snap.stream_seq
        self.resumed_from = snap.stream_seq
        log.warning("resuming job %s from the snapshot of generation %d (stream sequence "
                    "%d, phase %s, %d unstored commands to re-publish)", self.settings.job,
                    snap.coordinator_generation, snap.stream_seq, state.phase.value,
                    len(snap.outbox))
        self._record(Record("coordinator-resumed", {
            "generation": self.config.coordinator_generation,
            "from_generation": snap.coordinator_generation, "stream_seq": snap.stream_seq,
            "phase": state.phase.value, "outbox": len(snap.outbox),
            "journal_segments": self.wal.replayed[0], "journal_events": self.wal.replayed[1],
            "away_s": round(now - snap.saved_at, 3)}))

    async def _start_afresh(self, js: Any) -> None:
        """No snapshot: nothing was ever decided in this job, since every command is
        published only after a write-ahead record that covers it, and the first record is
        always a full snapshot. A predecessor may still have read (and acked) messages
        that led to no command: a Hello dropped for a bad signature, one refused, a
        heartbeat. Starting from the initial state, they are read again from the start of
        the stream (its durable rewound to sequence 1; the compactor purges nothing below
        a stored snapshot, so the stream still holds them all) through the same core: the
        state they lead to is the one the predecessor had, and nobody was told of it."""
        info = await js.consumer_info(sj.stream_name(self.settings.job),
                                      sj.COORDINATOR_CONSUMER)
        read = max((x.stream_seq or 0 for x in (info.ack_floor, info.delivered)
                    if x is not None), default=0)
        if read:
            log.warning("job %s: an earlier coordinator read its stream up to sequence %d "
                        "but decided nothing (no snapshot): reading it again from the start",
                        self.settings.job, read)
            await self._rewind_consumer(js, 1)

    async def _rewind_consumer(self, js: Any, start_seq: int) -> None:
        """Re-create the coordinator's durable consumer to deliver from ``start_seq``."""
        stream = sj.stream_name(self.settings.job)
        config = consumer_configs(self.settings.job, self.config.world_size, JobStorage())[0]
        config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
        config.opt_start_seq = start_seq
        with contextlib.suppress(NotFoundError):
            await js.delete_consumer(stream, sj.COORDINATOR_CONSUMER)
        await js.add_consumer(stream, config)

    async def _snapshot(self, new: list[Outbound]) -> bool:
        """Store the write-ahead snapshot: the state with every command not yet stored on
        the stream; False when deposed."""
        generation = self.config.coordinator_generation
        snap = snapshot.Snapshot(state=self.state, stream_seq=self.covered_seq,
                                 outbox=[*self.publisher.unstored(), *new],
                                 coordinator_generation=generation, saved_at=self.clock(),
                                 journal=self.wal.next_base(generation))
        if not await self.wal.snapshot(snap, time.monotonic()):
            self.lease.lost.set()
            return False
        self.compactor.stored(snap.stream_seq)
        return True

    async def _append(self, events: list[tuple[Event | journal.Wire, float]],
                      new: list[Outbound]) -> bool:
        """Store a journal segment: ``events`` (everything applied since the last write)
        and the commands ``new`` they led to; False when deposed."""
        seg = journal.Segment(events=events, stream_seq=self.covered_seq, outbox=new,
                              coordinator_generation=self.config.coordinator_generation,
                              saved_at=self.clock())
        if not await self.wal.append(seg):
            self.lease.lost.set()
            return False
        self.compactor.stored(seg.stream_seq)  # the events are in the journal now
        return True

    def _rank_floor(self, sender: str) -> int:
        rank = sj.sender_rank(sender)
        r = self.state.rank(rank) if rank is not None else None
        return r.hello.generation if r is not None and r.hello is not None else 0

    # ------------------------------------------------------------------ events

    async def apply(self, event: Event, seq: int | None = None,
                    stored_at: float | None = None, wire: journal.Wire | None = None) -> bool:
        """Run one event through the core (False: not applied, the lease is lost or, for a
        tick, not proven now). Its commands are published by the committer,
        in order, once a write-ahead record that covers them is stored; meanwhile the
        next inputs are decided. ``stored_at``: the input's stream time, for the decision
        latency; ``wire``: the message as it came, which the journal keeps for it."""
        async with self._lock:
            while not await self.lease.confirm():
                # deposed, or the lease cannot be proven (paused? broker away?): decide
                # nothing; an input (not a tick) waits until the lease is proven or lost
                if self.lease.lost.is_set() or isinstance(event, Tick):
                    return False
                await asyncio.sleep(0.2)
            now = self.clock()
            self.state, commands = transition(self.state, event, now)
            self._applied.append((wire or event, now))
            if len(self._applied) > journal.MAX_EVENTS:  # long without any write
                self._applied.clear()
                self.wal.journal.force_full()
            elif len(self._applied) == journal.FLUSH_EVENTS:
                self._commit_wanted.set()  # a segment of them, ahead of the next command
            if seq is not None:
                self.covered_seq = seq
            outbound = self._carry_out(commands)
            if outbound:
                self._decided += outbound
                if stored_at is not None:
                    self._decided_at.append((stored_at, self.state.phase is Phase.TRAINING))
                self._committed.clear()
                self._commit_wanted.set()
            return True

    async def _committer(self) -> None:
        """Group commit: one write covers every command decided since the last one.

        The write is a journal segment (the events applied since the previous write: its
        cost follows the traffic, not the cohort), and a full snapshot about once every
        ``--snapshot-every`` seconds, written once an average is over (a quiet moment:
        see ``ROUND_OVER``) or when overdue; the cycle collector's full passes go there
        too (collector.py). It is encoded at once (no await between taking the batch and
        encoding: the state is exactly the one that decided it);
        while its KV write is in flight the core decides the next inputs, whose commands
        wait for the next write. So a burst of decisions (a thousand ranks' acks) costs a
        few writes, not one each."""
        while True:
            await self._commit_wanted.wait()
            self._commit_wanted.clear()
            rebase = False  # a full snapshot now, with whatever is decided meanwhile
            while True:
                if self._round_over:  # a quiet moment
                    self._round_over = False
                    rebase = rebase or self.wal.journal.wanted(time.monotonic())
                    if self.collector.quiet_due():
                        self.collector.collect()
                if not (self._decided or rebase
                        or len(self._applied) >= journal.FLUSH_EVENTS):
                    break
                self._committed.clear()  # (a write in flight: the end waits for it too)
                batch, started = self._decided, self._decided_at
                events = self._applied
                self._decided, self._decided_at, self._applied = [], [], []
                # the events since the last write, or a full snapshot (no await before
                # either encodes: the state is exactly the deciding one)
                if rebase or self.wal.journal.full_due(time.monotonic(), len(events)):
                    stored = await self._snapshot(batch)
                else:
                    stored = await self._append(events, batch)
                if not stored:
                    return  # deposed: nothing of it is published
                for out in batch:
                    self.publisher.submit(out)
                now = time.time()
                rebase = False
                kinds = {out.headers.get(sj.H_TYPE) for out in batch}
                if SYNC_NOW in kinds:
                    self._sync_published_at = now
                self.latency.published(started, now)
            self._committed.set()

    async def _drain(self, committer: asyncio.Task[None]) -> None:
        """Until every command decided so far is stored in a snapshot and submitted (or
        the committer ended: deposed; or a task failed, ``self.watch.failure``)."""
        lost = asyncio.ensure_future(self.lease.lost.wait())
        committed = asyncio.ensure_future(self._committed.wait())
        failed = asyncio.ensure_future(self.watch.failed.wait())
        try:
            await asyncio.wait([lost, committed, committer, failed],
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
            committed.cancel()
            failed.cancel()

    # ------------------------------------------------------------ supervision

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """A task under watch (:mod:`ddpbus.orchestrator.runtime.endpoint`): one that dies of
        an unexpected exception ends the coordinator (``_serve`` returns, ``_abandon``)."""
        return self.link.spawn(coro, name)

    def _failing(self, name: str, exc: BaseException) -> None:
        log.error("coordinator task %s failed: %s: %s; exiting, the lease released (a "
                  "successor resumes from the last snapshot)", name, type(exc).__name__, exc,
                  exc_info=exc)

    async def _abandon(self) -> int:
        """A task failed (``self.watch.failure``): stop whatever still runs in the background (a
        reduce, an input being applied), then give the lease up so a standby or a restart
        takes over at once, from the last write-ahead record (everything published is
        covered by one; what was decided and not stored is decided again from the stream)."""
        await self.link.stop(5.0)  # (_serve stopped its own: what is left is background)
        await self.lease.release()
        return EXIT_FAILED

    def _carry_out(self, commands: list[Any]) -> list[Outbound]:
        job = self.settings.job
        outbound: list[Outbound] = []
        for c in commands:
            if isinstance(c, Send):
                if isinstance(c.msg, m.SyncNow):
                    self._sync_decided_at, self._round_acks = time.time(), []
                subject = (sj.CONTROL_ALL.subject(job) if c.rank is None
                           else sj.CONTROL_RANK.subject(job, c.rank))
                outbound.append(self.encoder.encode(subject, c.msg))
            elif isinstance(c, Admit):
                outbound.append(self.encoder.encode(
                    sj.ADMIT_RANK.subject(job, c.msg.rank), c.msg))
            elif isinstance(c, Record):
                self._record(c)
            elif isinstance(c, Refuse):
                self.intake.refused(c)
            elif isinstance(c, Finish) and self.finish is not None and not self.finish.done():
                self.finish.set_result(c)
            elif isinstance(c, Reduce):
                self._start_reduce(c)
        return outbound

    def _start_reduce(self, cmd: Reduce) -> None:
        """Reduce off the decision loop; the result comes back as an event."""
        async def reduce() -> None:
            result = await self.reducer.run(cmd)
            await self.apply(result)
        self._spawn(reduce(), f"reduce-{cmd.version}")

    def _record(self, c: Record) -> None:
        if c.event in ROUND_OVER:
            self._round_over = True
            self._commit_wanted.set()
        if c.event == "averaged" and self._sync_published_at is not None:
            c = Record(c.event, {**c.fields, "publish_to_acks_ms": round(
                (time.time() - self._sync_published_at) * 1000.0, 3),
                **round_split(self._sync_decided_at, self._sync_published_at,
                              self._round_acks)})
        if self.metrics is not None:
            self.metrics.on_record(c)
        line = json.dumps({"t": round(self.clock(), 6), "event": c.event, **c.fields},
                          default=str)
        events_log.info("%s", line)
        if self._events_file is not None:
            self._events_file.write(line + "\n")
            self._events_file.flush()

    async def _on_stream(self, msg: Msg) -> None:
        stored_at = self.reader.handled_at  # this message's (the reader read it off)
        if stored_at is not None:
            self.latency.took_in(stored_at, time.time())
        body, msg_id = self.intake.decode(msg)
        seq = self.reader.handled_seq
        if self.metrics is not None and isinstance(body, m.Batch | m.Reports):
            latest = m.batches(body)
            if latest:  # the gauges show a rank's latest batch
                self.metrics.on_batch(latest[-1])
        if self.metrics is not None and isinstance(body, m.MetricsMsg):
            self.metrics.on_resources(body)
        if isinstance(body, m.SyncAck):
            self._round_acks.append(body)  # (its times: the "averaged" record's split)
        if body is not None:
            if not await self.apply(event_of(body, msg_id), seq, stored_at,
                                    journal.Wire(msg.subject, msg.headers or {}, msg.data,
                                                 True)):
                raise bus.NotApplied  # deposed: the successor must get it, not an ack
        else:
            self.covered_seq = max(self.covered_seq, seq)
        if self._replay_to is not None and seq >= self._replay_to:
            self._caught_up(seq)

    def _caught_up(self, seq: int) -> None:
        """A coordinator that took over has applied the stream up to where it stood at the
        takeover (nothing to replay when its snapshot covered it all)."""
        self.replay_s, self._replay_to = time.time() - self.started_at, None
        log.info("caught up with the stream (sequence %d) %.2fs after taking over", seq,
                 self.replay_s)

    async def _may_read(self) -> bool:
        """Asked by the stream reader before each pull request. A deposed coordinator (one
        paused past its lease, say) must not pull: its successor re-created the durable
        under the same name, so every message it took would be taken from the successor
        (and come back only after the ack wait, behind later ones)."""
        if await self.lease.confirm():
            return True
        if self.lease.lost.is_set():
            raise bus.NotApplied
        return False

    async def _on_live(self, msg: Msg) -> None:
        self.intake.beat(msg)  # liveness, not a decision: applied at the next tick

    async def _take_beats(self) -> None:
        for body, wire in self.intake.beats():
            if self.metrics is not None and body.rank < self.config.world_size:
                self.metrics.on_rank_rejections(body.rank, body.rejections)
            await self.apply(Timing(body), wire=wire)

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            await self._take_beats()
            if self.collector.overdue():
                self.collector.collect()
            if not self.link.down:  # without a connection, silence proves nothing
                await self.apply(Tick())
            if self.metrics is not None:
                self.metrics.refresh(self.state, batch_size=self.config.schedule.batch_size,
                                     pending=self._pending)
                self.metrics.on_rejections(self.intake.rejected + self.state.refusals)
                self.metrics.on_retention(self.compactor.report())

    async def _watch_lag(self, nc: Client) -> None:
        """The coordinator consumer's backlog, for the metrics (every 2 s)."""
        js = nc.jetstream()
        while True:
            with contextlib.suppress(*bus.TRANSIENT_ERRORS):
                info = await js.consumer_info(sj.stream_name(self.settings.job),
                                              sj.COORDINATOR_CONSUMER)
                self._pending = info.num_pending
            await asyncio.sleep(2.0)

    async def _bus_lost(self) -> None:
        if self.link.lost():
            log.warning("lost the NATS connection: no liveness judgement until it is back")

    async def _bus_back(self) -> None:
        away = await self.link.back()
        if self.finish is not None and not self.finish.done():
            # off the client's callback: apply may wait for the lock and the store
            self._spawn(self.apply(BusRestored(away)), "bus-restored")

    async def _beacon(self) -> None:
        subject = sj.LIVE_COORDINATOR.subject(self.settings.job)
        await self.link.beacon(self.nc, lambda: self.encoder.encode(subject, m.CoordHeartbeat()),
                               every=1.0)

    def _signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        log.info("%s: asking every rank to save and exit", name)
        self._stopping = self._spawn(self.apply(Stop(reason=f"stopped by {name}")), "stop")
