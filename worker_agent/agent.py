"""The worker agent's asyncio shell: NATS in and out, liveness, and the training thread.

One agent per GPU (``ddpbus worker``). It joins the job (Hello on join.rank.N, Accept or
Reject on its own consumer), then forwards every control message, in stream order, to its
:class:`~ddpbus.worker_agent.trainer.Trainer` thread and publishes what the trainer reports.
It never waits for a batch or a collective: beacons (Heartbeat every second on live.rank.N)
and the coordinator-liveness watchdog keep running while the trainer is busy. A message
that fails decoding, signing or fencing is counted, logged once per reason, and dropped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import faulthandler
import hashlib
import json
import logging
import os
import signal
import socket
import time
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.client import JetStreamContext
from nats.js.errors import BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from ddpbus.codecs import DecodeError, Decoder, Encoder, Outbound
from ddpbus.codecs import messages as m
from ddpbus.codecs import subjects as sj
from ddpbus.codecs.errors import ConfigError, DdpbusError
from ddpbus.orchestrator.core.session import NOT_JOINABLE
from ddpbus.orchestrator.persist import bundles
from ddpbus.orchestrator.runtime.endpoint import Endpoint
from ddpbus.orchestrator.transport import bus
from ddpbus.orchestrator.transport.auth import Access
from ddpbus.worker_agent import checkpoint
from ddpbus.worker_agent.callbacks import Outcome
from ddpbus.worker_agent.rendezvous import NatsKVStore
from ddpbus.worker_agent.spec import TrainSpec
from ddpbus.worker_agent.trainer import Consensus, Trainer, TrainerSettings

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_REJECTED = 0, 1, 2
STOP_GRACE_S = 5.0  # for the agent's tasks to end once cancelled, at exit


def _log_cpu(rank: int, trainer: Trainer, started: tuple[float, float, float]) -> None:
    """Where this process's CPU went while it trained: the training thread, this agent's
    loop (NATS, the codec, publishing) and the rest (torch's and gloo's own threads); and
    the training thread's wall time not spent on batches: waiting for the coordinator, in
    averages. What ``bench/overhead.py`` reads to say where the time goes."""
    wall0, process0, loop0 = started
    spent = trainer.account
    process = time.process_time() - process0
    loop = time.thread_time() - loop0
    log.info("rank %d: cpu %.3f s over %.3f s: training thread %.3f s, agent loop %.3f s, "
             "other threads %.3f s; the training thread waited %.3f s for the coordinator "
             "and averaged for %.3f s", rank, process, time.perf_counter() - wall0,
             spent.cpu_s, loop, max(0.0, process - spent.cpu_s - loop), spent.waited_s,
             spent.averaging_s)


@dataclass(frozen=True, kw_only=True)
class WorkerSettings:
    job: str
    rank: int
    world_size: int
    nats: Access  # the URL, this rank identity's credentials
    key: bytes
    out_dir: Path | None = None
    final_state: Path | None = None
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    slowdown: float = 1.0
    torch_threads: int | None = None
    wire_json: bool = False
    join_timeout: timedelta = timedelta(seconds=300)
    heartbeat_interval: timedelta = timedelta(seconds=1)
    exit_grace: timedelta | None = None  # the CLI's process: at most this long to exit
    bundle_dir: Path | None = None  # resume bundles here (a shared volume), not the Object Store
    bundle_timeout: timedelta = timedelta(seconds=120)  # to store the last bundle before exit

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is not in 0..{self.world_size - 1}")
        if self.slowdown < 1.0:
            raise ConfigError("slowdown must be >= 1 (a factor by which batches get slower)")


def _rate(size: int, seconds: float) -> str:
    """Bundle transfer progress for the log: size, time, throughput."""
    mib = size / 2**20
    return f"{mib:.1f} MiB in {seconds:.2f} s, {mib / max(seconds, 1e-6):.0f} MiB/s"


def resolve_device(name: str, rank: int) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", rank % torch.cuda.device_count())
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name} requested but CUDA is not available")
    return device


def model_signature(model: torch.nn.Module) -> bytes:
    """32-byte digest of every parameter and buffer name, shape and dtype."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}\n".encode())
    return h.digest()


class WorkerAgent:
    def __init__(self, settings: WorkerSettings, spec: TrainSpec) -> None:
        self.settings = settings
        self.spec = spec
        self.rank = settings.rank
        self.rejected: Counter[str] = Counter()
        self._admitted: asyncio.Future[m.Accept] | None = None
        self._last_coordinator = time.monotonic()
        self._closing = False  # set as the agent closes its connection at exit
        self._done: asyncio.Future[Outcome] | None = None
        self._floor = 0  # coordinator generation fence, from Accept
        self.dropped_before_accept = 0
        self.resume_seq = 0  # this rank's consumer had acked this far: a restart
        self.reader: bus.StreamReader | None = None
        # the run was ending without this incarnation: refused as not joinable, or its
        # Shutdown came before this rank's Accept
        self._too_late = False
        self._bundles: list[concurrent.futures.Future[None]] = []  # bundle writes in flight
        self._bundle_lock: asyncio.Lock | None = None  # one at a time, in version order
        self._rounds: ObjectStore | None = None  # the broker backend's round bucket
        # its connection's shell and its tasks: the first task to die of an unexpected
        # exception ends the rank
        self.link = Endpoint(f"rank {self.rank}", self._failing)
        self.watch = self.link.watch

    # ------------------------------------------------------------------ entry

    async def run(self) -> int:
        s = self.settings
        if s.torch_threads:
            torch.set_num_threads(s.torch_threads)
        device = resolve_device(s.device, s.rank)
        torch.manual_seed(self.spec.schedule().seed)  # same initial weights everywhere
        trainer = Trainer(self.spec, TrainerSettings(
            rank=s.rank, device=device, store_factory=self._store, out_dir=s.out_dir,
            final_state=s.final_state, slowdown=s.slowdown, bundle_sink=self._bundle_sink,
            contribution_sink=self._contribution_sink, refusal_sink=self._trainer_refused),
            self._outbox_threadsafe)
        self.trainer = trainer
        self.loop = asyncio.get_running_loop()
        nc = await s.nats.connect(s.job, name=sj.rank_connection_name(s.job, s.rank),
                               deadline=s.join_timeout, on_disconnect=self._bus_lost,
                               on_reconnect=self._bus_back)
        try:
            return await self._run(nc, trainer, device)
        finally:
            self._closing = True  # the close's disconnect is ours, not an outage
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 5.0)
            if getattr(self, "_kv_store", None) is not None:
                self._kv_store.close()

    def _store(self) -> NatsKVStore:
        """The rendezvous store, opened on first use by the training thread."""
        if getattr(self, "_kv_store", None) is None:
            self._kv_store = NatsKVStore(self.settings.nats, self.settings.job,
                                         name=f"ddpbus-store-rank-{self.rank}")
        return self._kv_store

    async def _run(self, nc: Client, trainer: Trainer, device: torch.device) -> int:
        s = self.settings
        js = nc.jetstream()
        kv = await self._wait_for_job(js)
        if kv is None:
            log.info("rank %d: job %s is over (its coordinator wrote the run's summary): "
                     "nothing to join", s.rank, s.job)
            return EXIT_OK
        self.generation = await bus.next_generation(kv, sj.rank_consumer(s.rank))
        self.encoder = Encoder(job=s.job, key=s.key, sender=sj.rank_consumer(s.rank),
                               generation=self.generation, wire_json=s.wire_json)
        self.decoder = Decoder(job=s.job, key=s.key,
                               generation_floor=lambda sender: self._floor
                               if sender == sj.COORDINATOR else 0)
        # a report it gives up on (not stored after its retry deadline) is a gap the
        # coordinator never hears of: the rank ends, and restarted it rejoins
        self.nc, self.js = nc, js
        self.publisher = self.link.publisher = bus.Publisher(
            js, on_failed=lambda exc: self.watch.fail("publisher", exc))
        self._admitted = self.loop.create_future()
        self._done = self.loop.create_future()
        reader = bus.StreamReader(nc, sj.stream_name(s.job), sj.rank_consumer(s.rank),
                                  self._on_control)
        self.reader = self.link.reader = reader
        live = await nc.subscribe(sj.LIVE_COORDINATOR.subject(s.job), cb=self._on_live)
        for c, n in ((self.publisher.run(), "publisher"), (reader.run(), "control-reader")):
            self._spawn(c, n)
        self._install_signals()
        try:
            code = await self._lifecycle(trainer, device)
            return EXIT_FAILED if self.watch.failure is not None else code
        finally:
            self.watch.closing = True
            await live.unsubscribe()
            # bounded: a task that swallows its cancellation (as the stream reader's wait
            # once did, see StreamReader._wait) must not keep an exiting rank alive; one that
            # does is named in the log with its stack
            await self.link.stop(STOP_GRACE_S)

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """One of the agent's tasks under watch (:mod:`ddpbus.orchestrator.runtime.endpoint`):
        one that dies of an unexpected exception ends the rank, rather than leave it beaconing while
        nobody reads its control messages or publishes its reports (the coordinator would
        never time it out, and its share of the work would wait forever)."""
        return self.link.spawn(coro, name)

    def _failing(self, name: str, exc: BaseException) -> None:
        log.error("rank %d: task %s failed: %s: %s; ending this rank (restarted, it "
                  "rejoins)", self.rank, name, type(exc).__name__, exc, exc_info=exc)
        reason = f"task {name} failed: {type(exc).__name__}: {exc}"
        for t in list(self.link.tasks):  # silent at once: the coordinator declares it dead
            if t.get_name() == "heartbeat":
                t.cancel()
        if self._admitted is not None and not self._admitted.done():
            self._admitted.set_exception(DdpbusError(reason))
        elif self._done is not None and not self._done.done():
            self.trainer.halt(reason, clean=False)
            self._done.set_result(Outcome(clean=False, reason=reason))

    async def _lifecycle(self, trainer: Trainer, device: torch.device) -> int:
        s = self.settings
        # a restarted incarnation continues from its run's latest bundle (on any host);
        # loaded once admitted, after the run's settings scaled the learning rate
        own = await self._find_bundle(sj.LATEST_BUNDLE_KEY) if self.resume_seq else None
        loaded = int(own.meta.get("global_step", 0)) if own is not None else (
            self._warm_start(trainer))
        hello = m.Hello(rank=s.rank, generation=self.generation, host=socket.gethostname(),
                        device=str(device), model_signature=model_signature(trainer.model),
                        world_size=s.world_size, pid=os.getpid(),
                        backend="nccl" if device.type == "cuda" else "gloo",
                        torch_version=torch.__version__, dataset_size=len(trainer.dataset))
        if self.resume_seq:  # this rank's consumer has progress: a restarted incarnation
            self._send(m.Rejoin(hello=hello, resume_stream_seq=self.resume_seq,
                                checkpoint_version=loaded))
        else:
            self._send(hello)
        log.info("rank %d: %s sent (generation %d, %s)", s.rank,
                 "rejoin" if self.resume_seq else "hello", self.generation, device)
        accept = await self._await_admission()
        if accept is None:
            if self.watch.failure is not None:
                return EXIT_FAILED
            if self._too_late and await self._run_ends_ok():
                # a replacement (a pod its Job made) that came as the run was ending: refused,
                # or its Hello still unanswered at the Shutdown; the run ended well without
                # it, so its Job succeeds (exit 2 would fail a finished workload)
                log.info("rank %d: job %s ended without this incarnation: nothing to join",
                         s.rank, s.job)
                return EXIT_OK
            return EXIT_REJECTED
        # beacons start once admitted: before that the coordinator does not know this rank
        self._spawn(self._beacon(), "heartbeat")
        if not loaded:
            await asyncio.to_thread(self._run_weights, trainer, accept.run)
        trainer.configure(accept.run, accept.world_size)
        if not await self._load_bundle(trainer, own):
            return EXIT_FAILED
        self._coordinator_timeout = accept.run.coordinator_timeout_s
        trainer.on_done = self._trainer_done
        started = (time.perf_counter(), time.process_time(), time.thread_time())
        trainer.start()
        watchdog = self._spawn(self._watch_coordinator(), "coordinator-watchdog")
        try:
            outcome = await self._done_future()
        finally:
            watchdog.cancel()
        if s.exit_grace is not None:
            # the exit is decided: whatever hangs from here on (a native thread, teardown
            # at interpreter exit) must not keep the process, and a pod's restart, waiting:
            # past the grace every thread's stack goes to stderr and the process exits 1
            faulthandler.dump_traceback_later(s.exit_grace.total_seconds(), exit=True)
        trainer.join(timeout=30)
        stored = await self._settle_bundles()
        if outcome.clean:
            self._send(m.Exiting(rank=s.rank))
        # (the publisher may be the task that failed: then nothing more is stored)
        flushed = await self.publisher.flush(30.0 if self.watch.failure is None else 5.0)
        log.info("rank %d: %s (%s)", s.rank, "exiting" if outcome.clean else "failed",
                 outcome.reason)
        _log_cpu(s.rank, trainer, started)
        if not flushed:
            log.error("rank %d: some reports were not stored before exit", s.rank)
        return EXIT_OK if outcome.clean and flushed and stored else EXIT_FAILED

    def _warm_start(self, trainer: Trainer) -> int:
        """A restarted incarnation (its consumer has progress) starts from the consensus
        model in ``--out``; a fresh rank never does, whatever that file holds (a previous
        run's model). Returns the loaded model's global step (Rejoin's checkpoint_version),
        0 if none was loaded."""
        if self.resume_seq:
            return trainer.load_consensus()
        path = trainer.consensus_path()
        if path is not None and path.exists():
            log.warning("rank %d: ignoring %s: a fresh rank starts from the run's initial "
                        "weights (only a restarted one resumes from that model)", self.rank,
                        path)
        return 0

    def _run_weights(self, trainer: Trainer, run: m.RunConfig) -> None:
        """The model was built under the spec's seed; a run with another one (``--knob
        seed=N``) starts every rank from that seed's weights instead."""
        if run.seed != self.spec.schedule().seed:
            log.info("rank %d: initial weights from the run's seed %d", self.rank, run.seed)
            trainer.reinitialise(run.seed)

    # ---------------------------------------------------------------- bundles

    async def _find_bundle(self, key: str) -> bundles.Manifest | None:
        try:
            return await bus.retry_while_away(lambda: bundles.latest(self.js, self.settings.job,
                                                                     key), deadline=60.0)
        except bundles.BundleError as exc:
            log.warning("rank %d: ignoring %s: %s", self.rank, key, exc)
            return None

    async def _load_bundle(self, trainer: Trainer, own: bundles.Manifest | None) -> bool:
        """Load this run's latest bundle (a restart) or the bundle the run resumes from.
        A resumed run's bundle that cannot be loaded is fatal (training from anything else
        would break the coverage proof); a restart's own bundle falls back to the consensus
        of the next average."""
        manifest, required = own, False
        if manifest is None:
            manifest, required = await self._find_bundle(sj.RESUME_BUNDLE_KEY), True
        if manifest is None:
            return True
        started = time.monotonic()
        try:
            blobs = await bus.retry_while_away(lambda: bundles.read_blobs(self.js, manifest),
                                               deadline=120.0)
            await asyncio.to_thread(trainer.load_bundle, blobs, manifest)
        except (bundles.BundleError, checkpoint.CheckpointError) as exc:
            if required:
                log.error("rank %d: cannot load the bundle this run resumes from: %s",  # noqa: TRY400
                          self.rank, exc)
                return False
            log.warning("rank %d: not loading %s (%s); the next average hands this rank the "
                        "consensus", self.rank, manifest.describe(), exc)
            return True
        log.info("rank %d: loaded %s (%s)", self.rank, manifest.describe(),
                 _rate(sum(len(b) for b in blobs.values()), time.monotonic() - started))
        return True

    def _bundle_sink(self, version: int, blobs: dict[str, bytes], meta: dict[str, Any]
                     ) -> None:
        """From the training thread: store bundle ``version`` in the background."""
        self._bundles.append(asyncio.run_coroutine_threadsafe(
            self._store_bundle(version, blobs, meta), self.loop))

    async def _store_bundle(self, version: int, blobs: dict[str, bytes],
                            meta: dict[str, Any]) -> None:
        s = self.settings
        if self._bundle_lock is None:
            self._bundle_lock = asyncio.Lock()
        async with self._bundle_lock:  # FIFO: bundle.latest never goes back a version
            started = time.monotonic()
            manifest = await bus.retry_while_away(lambda: bundles.write(
                self.js, s.job, version, blobs, meta, directory=s.bundle_dir))
        log.info("rank %d: stored %s (%s)", s.rank, manifest.describe(),
                 _rate(sum(len(b) for b in blobs.values()), time.monotonic() - started))

    async def _settle_bundles(self) -> bool:
        """Wait for bundle writes in flight (the final one must land before exit)."""
        pending = [asyncio.wrap_future(f) for f in self._bundles]
        if not pending:
            return True
        done, late = await asyncio.wait(pending,
                                        timeout=self.settings.bundle_timeout.total_seconds())
        ok = not late
        for f in late:
            f.cancel()
        for f in done:
            if (exc := f.exception()) is not None:
                log.error("rank %d: a resume bundle was not stored: %s", self.rank, exc)
                ok = False
        if late:
            log.error("rank %d: %d resume bundle(s) not stored within %s", self.rank,
                      len(late), self.settings.bundle_timeout)
        return ok

    # ------------------------------------------------------ the broker backend

    def _contribution_sink(self, version: int, blob: bytes | None, mass: float,
                           step: int) -> None:
        """From the training thread: store this rank's contribution to round ``version``
        (in the background; training goes on) and announce it with SnapshotReady."""
        asyncio.run_coroutine_threadsafe(self._ship(version, blob, mass, step), self.loop)

    async def _ship(self, version: int, blob: bytes | None, mass: float, step: int) -> None:
        digest, started = "", time.monotonic()
        if blob is not None:
            try:
                store = await self._rounds_store()
                digest = await bus.put_object(store, sj.round_contribution(
                    version, self.rank), blob, bus.object_chunk(self.nc.max_payload))
            except bus.TRANSIENT_ERRORS as exc:
                # no SnapshotReady: the round's deadline leaves this rank out, it carries
                log.warning("rank %d: round %d: storing the snapshot failed: %s", self.rank,
                            version, exc)
                return
            log.debug("rank %d: round %d snapshot stored (%s)", self.rank, version,
                      _rate(len(blob), time.monotonic() - started))
        self._send(m.SnapshotReady(rank=self.rank, version=version, mass=mass,
                                   step_count=step, digest=digest,
                                   nbytes=len(blob) if blob is not None else 0))

    async def _rounds_store(self) -> ObjectStore:
        if self._rounds is None:
            self._rounds = await bus.rounds_store(self.js, self.settings.job)
        return self._rounds

    async def _fetch_consensus(self, update: m.Update) -> Consensus:
        """The Update with its consensus, fetched here so the training thread never
        waits on the broker (messages after it wait in the stream meanwhile)."""
        if not update.realized:
            return Consensus(update=update, blob=None)
        try:
            store = await self._rounds_store()
        except bus.TRANSIENT_ERRORS as exc:
            return Consensus(update=update, blob=None, error=f"fetching the consensus: {exc}")
        arrived = await fetch_consensus(store, update)
        if arrived.refused:
            self.rejected[arrived.refused] += 1
        return arrived

    def _done_future(self) -> asyncio.Future[Outcome]:
        if self._done is None:
            raise DdpbusError("agent not started")
        return self._done

    async def _await_admission(self) -> m.Accept | None:
        if self._admitted is None:
            raise DdpbusError("agent not started")
        try:
            accept = await asyncio.wait_for(self._admitted,
                                            self.settings.join_timeout.total_seconds())
        except TimeoutError:
            log.error("rank %d: no Accept within %s (is the coordinator running?)",  # noqa: TRY400
                      self.rank, self.settings.join_timeout)
            return None
        except DdpbusError as exc:
            log.error("rank %d: %s", self.rank, exc)  # noqa: TRY400 - the reason, said once
            return None
        self._floor = accept.coordinator_generation
        log.info("rank %d: admitted (coordinator generation %d, %s/%s)", self.rank,
                 accept.coordinator_generation, accept.run.policy.value,
                 accept.run.backend.value)
        return accept

    # -------------------------------------------------------------- messaging

    async def _run_ends_ok(self) -> bool:
        """Refused because the run takes no rank any more: whether it ends well (its
        summary stored, ok) within the coordinator's deadline."""
        deadline = time.monotonic() + self.settings.join_timeout.total_seconds()
        while time.monotonic() < deadline:
            with contextlib.suppress(*bus.TRANSIENT_ERRORS):
                if await bus.run_is_over(self.js, self.settings.job):
                    kv = await self.js.key_value(sj.kv_bucket(self.settings.job))
                    summary = json.loads((await kv.get(sj.SUMMARY_KEY)).value or b"{}")
                    return bool(summary.get("ok"))
            await asyncio.sleep(0.5)
        return False

    async def _wait_for_job(self, js: JetStreamContext) -> KeyValue | None:
        """The job's stream, bucket and this rank's durable consumer are made by the
        coordinator (or ``ddpbus init-job``): a rank may read its consumer, never create or
        change one (its NATS permissions say the same). Where the consumer's acks stand
        is where a restarted incarnation resumes. None: the job's run is over (its summary
        is stored and the consumers are gone, provision.retire_consumers)."""
        deadline = time.monotonic() + self.settings.join_timeout.total_seconds()
        stream, consumer = sj.stream_name(self.settings.job), sj.rank_consumer(self.rank)
        while True:
            try:
                info = await js.consumer_info(stream, consumer)
                kv = await js.key_value(sj.kv_bucket(self.settings.job))
            except (NotFoundError, BucketNotFoundError):
                if await bus.run_is_over(js, self.settings.job):
                    return None
                if time.monotonic() > deadline:
                    raise DdpbusError(f"job {self.settings.job!r} has no consumer {consumer} "
                                      f"on stream {stream}; start its coordinator (with a "
                                      "world size above this rank) or `ddpbus init-job`"
                                      ) from None
                await asyncio.sleep(0.2)  # poll until the coordinator made them (deadline)
                continue
            floor = info.ack_floor.stream_seq if info.ack_floor is not None else 0
            self.resume_seq = floor or 0
            return kv

    def _send(self, msg: m.Message, durable: bool = True) -> None:
        s = self.settings
        if isinstance(msg, m.MetricsMsg):
            subject = sj.METRICS_RANK.subject(s.job, s.rank)
        elif isinstance(msg, m.Hello | m.Rejoin):
            subject = sj.JOIN_RANK.subject(s.job, s.rank)
        else:
            subject = sj.TIMING_RANK.subject(s.job, s.rank)
        # most per-batch reports skip the store ack (the trainer says which): the coordinator
        # books batches by step count, so a lost Batch costs one timing sample, never a batch
        self.publisher.submit(self.encoder.encode(subject, msg), acked=durable)

    def _outbox_threadsafe(self, msg: m.Message, durable: bool) -> None:
        self.loop.call_soon_threadsafe(self._send, msg, durable)

    def _trainer_done(self, outcome: Outcome) -> None:
        def settle() -> None:
            if self._done is not None and not self._done.done():
                self._done.set_result(outcome)
        self.loop.call_soon_threadsafe(settle)

    def _trainer_refused(self, reason: str) -> None:
        """From the training thread: it refused a control message (it said why)."""
        self.loop.call_soon_threadsafe(self.rejected.update, [reason])

    def _refused(self, exc: DecodeError) -> None:
        self.rejected[exc.reason] += 1
        if self.rejected[exc.reason] == 1:
            log.warning("rank %d: dropped a message (%s); further %s drops are counted only",
                        self.rank, exc, exc.reason)

    async def _on_control(self, msg: Msg) -> None:
        arrived = time.time()  # (a SyncNow's SyncAck reports it: its delivery)
        try:
            env = self.decoder.decode(msg.subject, msg.headers, msg.data)
        except DecodeError as exc:
            self._refused(exc)
            return
        self._last_coordinator = time.monotonic()
        if env.sender == sj.COORDINATOR and env.generation > self._floor and self._floor:
            # a newer coordinator took over (its lease): its predecessor is fenced from now on
            log.warning("rank %d: coordinator generation %d took over from %d", self.rank,
                        env.generation, self._floor)
            self._floor = env.generation
        body = env.message
        if isinstance(body, m.Accept | m.Reject):
            self._on_admit(body)
        elif isinstance(body, m.CoordHeartbeat):
            return
        elif isinstance(body, m.Shutdown | m.ShutdownWithSave) and self._waiting_admission():
            self._too_late = True
            self._admitted.set_exception(  # type: ignore[union-attr]
                DdpbusError("the run ended before this rank was admitted"))
        elif self._waiting_admission():
            # traffic before this incarnation's Accept was for an older one (a restart
            # replays its consumer's unacked tail); the coordinator reassigned that work
            self.dropped_before_accept += 1
        elif isinstance(body, m.Update):
            self.trainer.inbox.put(await self._fetch_consensus(body))
        elif isinstance(body, m.ControlMsg):
            self.trainer.deliver(body, arrived)
            if isinstance(body, m.DeclareDead) and body.rank != self.rank:
                # after the put: the training thread may be blocked in a collective with the
                # dead rank (gloo on a stopped peer, NCCL on any): release it now
                self.trainer.release_collective(body.rank)

    def _waiting_admission(self) -> bool:
        return self._admitted is not None and not self._admitted.done()

    def _on_admit(self, body: m.Accept | m.Reject) -> None:
        fut = self._admitted
        if body.generation != self.generation or fut is None or fut.done():
            log.info("rank %d: ignoring %s for generation %d", self.rank, type(body).__name__,
                     body.generation)
            return
        if isinstance(body, m.Reject):
            self._too_late = NOT_JOINABLE in body.reason
            fut.set_exception(DdpbusError(f"rejected by the coordinator: {body.reason}"))
        else:
            fut.set_result(body)

    async def _on_live(self, msg: Msg) -> None:
        try:
            env = self.decoder.decode(msg.subject, msg.headers, msg.data)
        except DecodeError as exc:
            self._refused(exc)
            return
        if isinstance(env.message, m.CoordHeartbeat):
            self._last_coordinator = time.monotonic()

    async def _beacon(self) -> None:
        await self.link.beacon(self.nc, self._heartbeat_message,
                               every=self.settings.heartbeat_interval.total_seconds())

    def _heartbeat_message(self) -> Outbound:
        s = self.settings
        return self.encoder.encode(sj.LIVE_RANK.subject(s.job, s.rank),
                                   m.Heartbeat(rank=s.rank, step_count=self.trainer.step,
                                               rejections=dict(self.rejected),
                                               connection=bus.connection_id(self.nc)))

    async def _bus_lost(self) -> None:
        if self._closing:
            return
        if self.link.lost():
            log.warning("rank %d: lost the NATS connection; training on, reconnecting",
                        self.rank)

    async def _bus_back(self) -> None:
        # the coordinator could not be heard either: its deadline starts again now (before
        # the reader re-attaches, so a watchdog check meanwhile finds a fresh deadline)
        self._last_coordinator = time.monotonic()
        if self._admitted is not None and self._admitted.done() and self.watch.failure is None:
            # at once, before the reader re-attaches (JetStream requests): the coordinator
            # forgave silence until now, and until this names the new connection a kill
            # of this process is noticed only by the heartbeat timeout
            await self.link.announce(self.nc, self._heartbeat_message())
        await self.link.back()

    async def _watch_coordinator(self) -> None:
        limit = self._coordinator_timeout
        while True:
            await asyncio.sleep(min(1.0, limit / 4))
            if self.link.down:
                continue  # nobody can be heard without a connection: not the coordinator's fault
            silent = time.monotonic() - self._last_coordinator
            if silent > limit:
                log.error("rank %d: no word from the coordinator for %.0fs; giving up",
                          self.rank, silent)
                self.trainer.halt(f"coordinator silent for {silent:.0f}s", clean=False)
                return

    def _install_signals(self) -> None:
        def stop(signum: int) -> None:
            log.info("rank %d: %s: finishing the current step, then exiting", self.rank,
                     signal.Signals(signum).name)
            self.trainer.halt(f"stopped by {signal.Signals(signum).name}", clean=True)
            if self._admitted is not None and not self._admitted.done():
                self._admitted.set_exception(DdpbusError("stopped before admission"))
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                self.loop.add_signal_handler(sig, stop, sig)


async def fetch_consensus(store: ObjectStore, update: m.Update) -> Consensus:
    """Round ``update.version``'s consensus from the round bucket, only if it is the object
    the signed Update names: anyone who can write the bucket could have replaced it."""
    name = sj.round_consensus(update.version)
    try:
        digest = str((await store.get_info(name)).digest or "")
        if digest == update.digest:  # checked first: a replaced object is never read
            blob, digest = await bus.read_object(store, name)
    except bus.TRANSIENT_ERRORS as exc:
        return Consensus(update=update, blob=None, error=f"fetching the consensus: {exc}")
    if digest != update.digest:
        return Consensus(update=update, blob=None, refused="consensus-digest", error=(
            f"the stored consensus ({digest}) is not the one the Update names "
            f"({update.digest})"))
    return Consensus(update=update, blob=blob)
