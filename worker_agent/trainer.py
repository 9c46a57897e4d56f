"""The training thread of a worker agent: plans, batches, averages and callbacks.

The agent's asyncio loop receives control messages and puts them into :attr:`Trainer.inbox`
in stream order; this thread takes them out between batches (never during one), so the
NATS side never waits for a batch or a collective. Rules it keeps:

- it trains only inside an open window: SetGlobalStep opens one with a per-rank step
  budget, SyncNow closes it; it never takes more steps than the budget;
- it trains exactly the samples of each plan (StartEpoch / ExtendPartition), batch by batch,
  refusing (and counting) a plan that is empty or leaves the dataset, and reports a Batch
  after every batch and a MetricsMsg after every plan; per-batch reports
  (Batch, LrUpdate) that come faster than the run's report interval travel together as one
  Reports, and the Batch that closes a window ends one at once (the gate waits on it);
- its data clock stops while a callback runs and while it waits for the coordinator
  (neither is ever read as slowness).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store  # typed re-exports of dist.*

from ddpbus.codecs import messages as m
from ddpbus.orchestrator.core.coalesce import ReportBuffer
from ddpbus.worker_agent import averaging, callbacks, checkpoint
from ddpbus.worker_agent.callbacks import Outcome
from ddpbus.worker_agent.data import BatchFetcher, Prefetcher, Stager, plan_indices
from ddpbus.worker_agent.rendezvous import STORE_TIMEOUT, Interruptible
from ddpbus.worker_agent.resources import ResourceProbe
from ddpbus.worker_agent.spec import (
    AMP_DTYPES,
    ScalarLedger,
    TrainSpec,
    WorkerContext,
    bind_context,
    bind_ledger,
)
from ddpbus.worker_agent.timing import Span, clock_for

if TYPE_CHECKING:
    from ddpbus.orchestrator.persist.bundles import Manifest

log = logging.getLogger(__name__)

Outbox = Callable[[m.Message, bool], None]
"""``outbox(msg, durable)``: hand a report to the agent; ``durable=False`` lets it skip the
stream's store ack (per-batch reports only)."""


# the process groups left with a released collective in flight (_forget_groups): held for
# the process's life, never freed. Freeing one runs its destructor, which joins the backend
# threads still waiting on the dead peer, until the collective timeout: a process that
# holds any must leave with os._exit (commands/worker.py), not through the interpreter's
# finalization, which would free them
GRAVEYARD: list[object] = []


def _forget_groups(graveyard: list[object]) -> None:
    """Unregister every process group, as ``destroy_process_group()`` does, without its
    ``shutdown()`` (which waits for the collectives in flight): a group whose collective was
    released waits on a dead or stopped peer until the collective timeout, and a new session
    must form meanwhile. The groups go to ``graveyard``, referenced for the process's life.
    The registry is torch's own (torch 2.13, the pinned version; the fields
    destroy_process_group clears)."""
    c10d: Any = dist.distributed_c10d
    world = c10d._world
    graveyard.extend(world.pg_map)
    c10d._update_default_pg(None)
    for table in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config,
                  world.pg_to_tag, world.tags_to_pg, world.pg_coalesce_state):
        table.clear()
    c10d._unregister_all_process_groups()


# TORCH_NCCL_ASYNC_ERROR_HANDLING: torch's default (3) tears the process down when its
# watchdog sees a failed or timed-out collective; 1 aborts the communicator, then does the
# same. A ddpbus rank must survive a dead peer: the coordinator declares it dead, the
# survivors abort their communicator (or the watchdog does, at the collective timeout) and
# form a new session. So 2: abort the communicator only. Set unless the operator set it.
NCCL_ERROR_HANDLING: Final = "2"


def nccl_error_handling() -> str:
    """Choose TORCH_NCCL_ASYNC_ERROR_HANDLING before a NCCL group is made (read then)."""
    chosen = os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", NCCL_ERROR_HANDLING)
    if chosen != NCCL_ERROR_HANDLING:
        log.warning("TORCH_NCCL_ASYNC_ERROR_HANDLING=%s (set outside ddpbus): with 1 or 3 a "
                    "dead peer's failed collective ends this process instead of letting it "
                    "join the survivors' next session", chosen)
    return chosen


def _abort_nccl() -> None:
    """Abort the NCCL communicators of the default group (``ncclCommAbort``), from a thread
    other than the one blocked in the collective: its kernel then returns with an error
    instead of spinning until the watchdog's timeout. Not run on a GPU yet (no device was
    lent to this project)."""
    try:
        dist.distributed_c10d._abort_process_group()  # torch >= 2.6
    except Exception:  # an abort of a group already broken may raise; it is gone either way
        log.warning("aborting the NCCL process group failed", exc_info=True)


def restart_group_names() -> None:
    """torch names a default process group by a per-process counter, part of every store
    key its rendezvous uses; a *failed* ``init_process_group`` advances it and only
    destroying a formed group resets it. Two ranks whose failures differed (one timed out
    on a session its dead peer never joined) would then wait on different keys in every
    later session, forever. Each session has its own store prefix, so every rank starts
    each one from zero, as a fresh process would."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and isinstance(getattr(world, "group_count", None), int):
        world.group_count = 0


@dataclass(frozen=True, slots=True)
class Halt:
    """Put into the inbox by the agent: stop at the next batch boundary."""

    reason: str
    clean: bool  # True: exit like a Shutdown (say Exiting); False: an error exit


@dataclass(frozen=True, slots=True)
class Consensus:
    """Put into the inbox by the agent, in the Update's place in the stream: the Update and
    the consensus blob it names, already fetched (None when the round was not realized, or
    when fetching failed: ``error``)."""

    update: m.Update
    blob: bytes | None
    error: str = ""
    refused: str = ""  # the rejection reason when the fetched object was refused


@dataclass(frozen=True, kw_only=True)
class TrainerSettings:
    rank: int
    device: torch.device
    store_factory: Callable[[], Store]
    out_dir: Path | None = None
    final_state: Path | None = None
    slowdown: float = 1.0  # simulate a slower device: every batch takes this many times longer
    # hands a resume bundle (version, {"model", "optim"} blobs, meta) to the agent to store
    bundle_sink: Callable[[int, dict[str, bytes], dict[str, Any]], None] | None = None
    # broker backend: hands (version, contribution blob or None, mass, local step) to the
    # agent, which stores it and answers SnapshotReady
    contribution_sink: Callable[[int, bytes | None, float, int], None] | None = None
    # counts a control message this rank refused, by reason (the agent's Heartbeat.rejections)
    refusal_sink: Callable[[str], None] | None = None


@dataclass(slots=True)
class Plan:
    """One EpochPlan being trained: its sample indices and running totals for MetricsMsg."""

    epoch: int
    indices: np.ndarray[Any, np.dtype[np.int64]]
    batch_size: int
    pos: int = 0
    batches: int = 0
    loss_sum: float = 0.0
    compute_ms: float = 0.0
    data_ms: float = 0.0
    started_at: float | None = None
    ahead: int = 0  # the start of its next batch not yet asked of the prefetcher

    @property
    def done(self) -> bool:
        return self.pos + self.batch_size > len(self.indices)

    def take(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        out = self.indices[self.pos:self.pos + self.batch_size]
        self.pos += self.batch_size
        return out


# batches launched on the GPU whose report waits for their compute to end (timing.py):
# one, so the host queues the next batch while the GPU finishes this one
IN_FLIGHT: Final = 1


@dataclass
class _Launched:
    """A batch whose optimizer step was queued: what its report needs once it is over."""
    plan: Plan
    step: int
    loss: torch.Tensor
    span: Span
    data_ms: float
    norm: float | None
    update: m.LrUpdate | None
    closing: bool


@dataclass
class _Window:
    open: bool = False
    budget: int = 0
    steps: int = 0  # optimizer steps since the last average


@dataclass
class Account:
    """Where the training thread's time went, for the rank's exit log: its CPU seconds (set
    as it ends) and the wall seconds it stood waiting for the coordinator once training
    (for a window, a plan, a SyncNow) and spent inside averages (the collectives)."""
    cpu_s: float = 0.0
    waited_s: float = 0.0
    averaging_s: float = 0.0


class Trainer(threading.Thread):
    """Owns the model, the optimizer and the process group of one rank."""

    def __init__(self, spec: TrainSpec, settings: TrainerSettings, outbox: Outbox) -> None:
        super().__init__(name=f"ddpbus-trainer-{settings.rank}", daemon=True)
        self.spec, self.settings, self._outbox = spec, settings, outbox
        self._held: list[tuple[m.Message, bool]] = []
        self._reports = ReportBuffer(settings.rank)  # per-batch reports not yet sent
        self.rank = settings.rank
        self.inbox: queue.SimpleQueue[m.ControlMsg | Halt | Consensus] = queue.SimpleQueue()
        # when each SyncNow queued here reached the agent (wall clock), in queue order:
        # its SyncAck carries the time back (deliver)
        self._sync_arrivals: deque[float] = deque()
        self.device = settings.device
        self.resources = ResourceProbe(self.device)
        self._setup_data(spec)
        self._setup_compute(spec)
        self.model = spec.model().to(self.device)
        self.flat = averaging.FlatModel(self.model)
        self.optimizer = spec.optimizer(self.model.parameters())
        self.run_config: m.RunConfig | None = None
        self.world_size = 0
        self.ctx = WorkerContext(rank=self.rank, world_size=0, model=self.model,
                                 optimizer=self.optimizer)
        self.ledger = ScalarLedger()
        self.plans: deque[Plan] = deque()
        self.window = _Window()
        self.step = 0
        self.global_step = 0
        self.epoch: int | None = None  # the newest epoch entered (ctx.epoch, epoch_fn)
        self.epoch_fn_role: int | None = None
        self.group_ready = False
        self.sessions = 0
        # a collective with a peer declared dead is released at once, not at its timeout:
        # the agent counts each DeclareDead (of another rank) it queues here and sets the
        # wait's event; while it has queued more than this thread has handled, the group
        # is broken (release_collective)
        self._release_lock = threading.Lock()
        self._deaths_queued = 0
        self._deaths_handled = 0
        self._released_by = ""
        self._collective_wake: threading.Event | None = None
        # the store of a session being formed: a DeclareDead meanwhile interrupts its waits
        # (a member that died before it wrote its address would hold them to the timeout)
        self._forming: Interruptible | None = None
        self.released = 0  # collectives released that way
        self.abandoned_sessions = 0  # sessions whose forming a DeclareDead ended
        self._abandoned = False  # the group has a released collective still in flight
        self.throttled = False
        self.ready_at = time.perf_counter()
        self.outcome: Outcome | None = None
        self.account = Account()

        self.on_done: Callable[[Outcome], None] = lambda _o: None
        self._schedule: Callable[[int], float] | None = None
        self._lr_scale = 1.0
        self._group_ratios: list[float] = []
        self._last_lr: float | None = None
        self._carry = 0  # steps of failed averages, carried into the next one
        # broker backend: the snapshot of the round in flight, callbacks that need its
        # consensus (deferred until the Update), and the last realized consensus
        self._round: averaging.Snapshot | None = None
        self._deferred: list[m.ControlMsg] = []
        self.consensus: list[torch.Tensor] | None = None
        # the latest average left this rank out (its collective failed, or the broker's
        # consensus did not take it): its parameters are its own, not a consensus, until
        # the next average; what needs a consensus (eval, checkpoint, bundle) is refused
        self.unaveraged = False
        self._refused: set[str] = set()  # reasons already warned about

    # ------------------------------------------------------------------ set-up

    def _setup_compute(self, spec: TrainSpec) -> None:
        # bf16 autocast around train_step (spec.amp); cuDNN's algorithm search
        self._amp = getattr(torch, AMP_DTYPES[spec.amp]) if spec.amp else None
        if spec.cudnn_benchmark:
            torch.backends.cudnn.benchmark = True
        self.clock = clock_for(self.device)  # a batch's compute time, read once it is over
        self._launched: deque[_Launched] = deque()

    def _setup_data(self, spec: TrainSpec) -> None:
        self.dataset = spec.build_dataset()
        self.stager = Stager(self.dataset)  # StageAdvisory's reader-ahead
        self.eval_dataset = spec.build_eval_dataset()
        self.fetch = BatchFetcher(self.dataset, spec.collate_fn)
        self.loader = Prefetcher(self.fetch, depth=spec.prefetch_depth(self.device,
                                                                        self.dataset),
                                 pin_memory=self.device.type == "cuda")

    def configure(self, run: m.RunConfig, world_size: int) -> None:
        """The run settings from Accept (before the thread starts)."""
        if len(self.dataset) != run.dataset_size:
            raise ValueError(f"this rank's dataset has {len(self.dataset)} samples, the run "
                             f"{run.dataset_size}")
        self.run_config, self.world_size = run, world_size
        self.ctx.world_size = world_size
        self.ctx.epochs, self.ctx.batch_size = run.epochs, run.batch_size
        self._lr_scale = 1.0 + (world_size - 1) * run.lr_scale_ratio
        base = [float(g["lr"]) for g in self.optimizer.param_groups]
        self._group_ratios = [b / base[0] if base[0] else 1.0 for b in base]
        if self.spec.lr_scheduler is not None:
            self._schedule = self.spec.lr_scheduler(world_size)
        else:
            for g in self.optimizer.param_groups:
                g["lr"] = float(g["lr"]) * self._lr_scale
        torch.manual_seed(run.seed + 1 + self.rank)  # per-rank randomness (dropout, ...)
        if run.backend is m.Backend.BROKER:
            # no communicator: every replica starts from the same seeded initial weights
            # (or a bundle), and averaging needs only the broker
            self.sessions, self.group_ready = 1, True

    def consensus_path(self) -> Path | None:
        """Where this rank writes (and a restart reads) the consensus model."""
        out = self.settings.out_dir
        return out / "consensus.safetensors" if out is not None else None

    def load_consensus(self) -> int:
        """A restarted rank starts from the latest consensus model in ``out_dir`` if there
        is one (a warm start: it takes no work before an average hands it the live
        consensus anyway). Returns that model's global step, 0 if none was loaded."""
        path = self.consensus_path()
        if path is None or not path.exists():
            return 0
        try:
            meta = checkpoint.load_model(path, self.model)
        except checkpoint.CheckpointError as exc:
            log.warning("rank %d: not resuming from %s: %s", self.rank, path, exc)
            return 0
        log.info("rank %d: loaded the consensus model of global step %s from %s", self.rank,
                 meta.get("global_step"), path)
        return int(meta.get("global_step") or 0)

    def reinitialise(self, seed: int) -> None:
        """The run's initial weights under ``seed`` (the run's seed is not the spec's:
        ``--knob seed=N``): the model built again, its state copied into the live one, whose
        parameters stay views of the flat buffers. Every fresh rank does the same."""
        torch.manual_seed(seed)
        self.model.load_state_dict(self.spec.model().state_dict())

    def load_bundle(self, blobs: dict[str, bytes], manifest: Manifest) -> None:
        """Start from a resume bundle: its parameters, its optimizer state (keeping the
        learning rates this run's settings gave each group) and its global step."""
        what = manifest.describe()
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        checkpoint.load_model_bytes(blobs["model"], self.model, what)
        checkpoint.load_optimizer_bytes(blobs["optim"], self.optimizer, what)
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        self.global_step = self.ctx.global_step = int(manifest.meta.get("global_step", 0))

    def outbox(self, msg: m.Message, *, durable: bool = True) -> None:
        """Queue a report, after the per-batch reports made before it (the stream keeps
        the order they were made in); :meth:`release` hands the queue to the agent."""
        self._settle()
        self.flush_reports()
        self._held.append((msg, durable))
        if isinstance(msg, m.SyncAck):  # the window is over: its held metrics go soon
            self._held += self._reports.acked(time.perf_counter(),
                                              self.active_run().report_interval_ms)

    def _report(self, items: list[m.Batch | m.LrUpdate], now: float, *, closing: bool) -> None:
        """Per-batch reports, coalesced (:mod:`ddpbus.orchestrator.core.coalesce`)."""
        if self._reports.add(items, now, self.active_run().report_interval_ms, closing=closing):
            self.flush_reports(durable=closing)
        else:
            self._held += self._reports.overdue(now)

    def flush_reports(self, *, durable: bool = False) -> None:
        """Queue the held per-batch reports (one Reports, or a lone one as itself)."""
        if self._reports.items:
            self._held += self._reports.take(self.active_run().report_interval_ms, durable=durable)

    def release(self) -> None:
        """Hand queued reports to the agent's loop. Called while this thread is about to
        run GIL-free torch work or to block, so the loop's publishing never stalls a
        batch: a Batch report leaves right after the next batch's data is fetched, or at
        once when the window ends."""
        held, self._held = self._held, []
        for msg, durable in held:
            self._outbox(msg, durable)

    def halt(self, reason: str, *, clean: bool) -> None:
        self.inbox.put(Halt(reason=reason, clean=clean))

    def run(self) -> None:
        bind_context(self.ctx)
        bind_ledger(self.ledger)
        try:
            self.outcome = self._loop()
        except Exception as exc:  # a failure ends the rank; it must not say Exiting
            log.exception("rank %d: training failed", self.rank)
            self.outcome = Outcome(clean=False, reason=f"{type(exc).__name__}: {exc}")
        finally:
            self.account.cpu_s = time.thread_time()  # this thread's CPU, for the exit's account
            self.loader.close()
            with contextlib.suppress(Exception):  # (a failed GPU: nothing more to read)
                self._settle()
            self.flush_reports()
            self._held += self._reports.release()  # before the agent's Exiting
            self.release()
            self._leave_group()
            self.on_done(self.outcome or Outcome(clean=False, reason="stopped"))

    # -------------------------------------------------------------------- loop

    def _can_train(self) -> bool:
        w = self.window
        # a rank keeps training inside its window while a lost peer's communicator is
        # rebuilt (sessions > 0): only the collective needs the group
        # barrier-paced policies (sync, cadence) train from the consensus, as with a
        # collective; async trains on while its round is in flight (and blends)
        waiting = self._round is not None and self.active_run().policy is not m.Policy.ASYNC
        return (self.sessions > 0 and w.open and w.steps < w.budget and bool(self.plans)
                and not self.throttled and not waiting)

    def _loop(self) -> Outcome:
        while True:
            while True:
                try:
                    msg = self.inbox.get_nowait()
                except queue.Empty:
                    break
                self._settle()  # a message is handled with every batch reported
                done = self._handle(msg)
                self.release()
                if done is not None:
                    return done
            if self._can_train():
                self._train_batch()
                continue
            self._settle()
            self.flush_reports()  # going idle: nothing of this rank's stays behind
            self.release()
            waiting = time.perf_counter()
            msg = self._next_input()
            # waiting for the coordinator (a plan, a window, a round) is not data time
            self.ready_at = time.perf_counter()
            if self.step and isinstance(msg, _CYCLE):  # mid-run, not its start or end
                self.account.waited_s += self.ready_at - waiting
            done = self._handle(msg)
            self.release()
            if done is not None:
                return done

    def _next_input(self) -> m.ControlMsg | Halt | Consensus:
        """The next input, waited for; the metrics held since the window closed go out
        meanwhile once their time comes (:mod:`ddpbus.orchestrator.core.coalesce`)."""
        while (due := self._reports.due) is not None:
            try:
                return self.inbox.get(timeout=max(0.0, due - time.perf_counter()))
            except queue.Empty:
                self._held += self._reports.overdue(time.perf_counter())
                self.release()
        return self.inbox.get()

    def _handle(self, msg: m.ControlMsg | Halt | Consensus) -> Outcome | None:
        if isinstance(msg, Halt):
            return Outcome(clean=msg.clean, reason=msg.reason)
        if isinstance(msg, Consensus):
            return self._on_consensus(msg)
        if self._round is not None and isinstance(msg, _NEED_CONSENSUS):
            self._deferred.append(msg)  # it is for the consensus of the round in flight
            return None
        handler = _HANDLERS.get(type(msg))
        if handler is None:
            return callbacks.handle(self, msg)
        return handler(self, msg)

    # ---------------------------------------------------------- control messages

    def _on_session(self, msg: m.NewNcclSession) -> None:
        run = self.active_run()
        self._leave_group()
        backend = "nccl" if run.backend is m.Backend.NCCL else "gloo"
        prefix = f"pg/{msg.uid_bytes[:16].hex()}/"
        # a collective with a dead or hung peer fails after this (then SyncAck{failed})
        timeout = timedelta(seconds=run.collective_timeout_s or run.coordinator_timeout_s + 30.0)
        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            kwargs["device_id"] = self.device
            nccl_error_handling()
        store = Interruptible(self.settings.store_factory(), STORE_TIMEOUT)
        with self._release_lock:
            self._forming = store
            if self._deaths_queued > self._deaths_handled:  # one came after this session
                store.interrupt(f"{self._released_by} was declared dead")
        try:
            dist.init_process_group(backend, store=PrefixStore(prefix, store),
                                    rank=msg.new_rank, world_size=msg.new_world_size,
                                    timeout=timeout, **kwargs)
            if msg.initial:
                averaging.broadcast_from_root(self.flat)  # every replica starts from rank 0's
        except Exception:  # a member died while the group formed: the next session
            if store.reason:
                self.abandoned_sessions += 1
                log.warning("rank %d: forming session (rank %d of %d) abandoned: %s",
                            self.rank, msg.new_rank, msg.new_world_size, store.reason)
            else:
                log.exception("rank %d: forming session (rank %d of %d) failed", self.rank,
                              msg.new_rank, msg.new_world_size)
            self._leave_group()
            return
        finally:
            with self._release_lock:
                self._forming = None
        self.sessions += 1
        self.group_ready = True
        self.ready_at = time.perf_counter()
        log.info("rank %d: session %d formed (%s, rank %d of %d)", self.rank, self.sessions,
                 backend, msg.new_rank, msg.new_world_size)

    def _leave_group(self) -> None:
        if dist.is_initialized() and self._abandoned:
            # destroy_process_group would wait for the released collective, which waits on
            # the dead peer until its timeout (measured: 29 s of a 30 s hang)
            _forget_groups(GRAVEYARD)
        elif dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a broken group may fail to tear down; it is gone either way
                log.warning("rank %d: tearing down the process group failed", self.rank,
                            exc_info=True)
        self._abandoned = False
        restart_group_names()
        self.group_ready = False

    def _on_declare_dead(self, msg: m.DeclareDead) -> Outcome | None:
        if msg.rank == self.rank:
            # fenced: the cohort has moved on without this incarnation (it was stopped or
            # cut off); its work was reassigned, so it must not train or average again
            log.error("rank %d: the coordinator declared this rank dead; exiting", self.rank)
            return Outcome(clean=False, reason="declared dead by the coordinator")
        log.warning("rank %d: rank %d declared dead; leaving the process group until a new "
                    "session", self.rank, msg.rank)
        with self._release_lock:
            self._deaths_handled += 1
        self._leave_group()
        return None

    def _on_request_id(self, _msg: m.RequestNewNcclId) -> None:
        self.outbox(m.NewNcclIdGenerated(rank=self.rank, uid_bytes=os.urandom(m.NCCL_ID_BYTES)))

    def _on_global_step(self, msg: m.SetGlobalStep) -> None:
        self.global_step = msg.global_step
        self.ctx.global_step = msg.global_step
        w = self.window
        w.open = True
        w.budget = msg.step_budget[self.rank] if self.rank < len(msg.step_budget) else (
            2**62 if not msg.step_budget else 0)
        for p in msg.plans:  # the window's plans, broadcast: this rank's, in order
            if p.rank == self.rank:
                self._on_start_epoch(m.StartEpoch(plan=p.plan))

    def _on_start_epoch(self, msg: m.StartEpoch) -> None:
        p = msg.plan
        self._add_plan("StartEpoch", p.epoch, p.partition_offset, p.partition_size)

    def _on_extend(self, msg: m.ExtendPartition) -> None:
        """A dead peer's lost batches: a plan of its own (its own MetricsMsg)."""
        self._add_plan("ExtendPartition", msg.epoch, msg.partition_offset, msg.partition_size)

    def _add_plan(self, what: str, epoch: int, offset: int, size: int) -> None:
        """Queue samples ``[offset, offset + size)`` of ``epoch``'s permutation; a slice
        that is empty or leaves the dataset is refused (training it would train an empty or
        short batch, and report samples that do not exist)."""
        run = self.active_run()
        if size <= 0 or offset < 0 or offset + size > run.dataset_size:
            self._refuse("plan-out-of-range", f"{what} for epoch {epoch}, samples "
                         f"[{offset}, {offset + size}), refused: the dataset has "
                         f"{run.dataset_size} samples (nothing trained)")
            return
        idx = plan_indices(run.dataset_size, run.seed, epoch, offset, size)
        self.plans.append(Plan(epoch=epoch, indices=idx, batch_size=run.batch_size))

    def _refuse(self, reason: str, detail: str) -> None:
        """A control message this rank does not carry out: warned about once per reason
        (the rest at debug level), every one counted by the agent."""
        level = logging.DEBUG if reason in self._refused else logging.WARNING
        self._refused.add(reason)
        log.log(level, "rank %d: %s", self.rank, detail)
        if self.settings.refusal_sink is not None:
            self.settings.refusal_sink(reason)

    def deliver(self, msg: m.ControlMsg, arrived: float) -> None:
        """Queue one control message for this thread (the agent's loop); ``arrived``: the
        wall clock when the agent took it in, which a SyncNow's SyncAck reports."""
        if isinstance(msg, m.SyncNow):
            self._sync_arrivals.append(arrived)
        self.inbox.put(msg)

    def _on_sync(self, _msg: m.SyncNow) -> None:
        received_at = self._sync_arrivals.popleft() if self._sync_arrivals else None
        run = self.active_run()
        if run.backend is m.Backend.BROKER:
            log.error("rank %d: SyncNow refused: backend broker averages through snapshots, "
                      "there is no collective (changes nothing)", self.rank)
            return
        steps = self.window.steps + self._carry
        began = time.perf_counter()
        try:
            result = self._average(steps, run)
        except Exception as exc:  # a peer died or hung: keep our parameters, say so
            self.account.averaging_s += time.perf_counter() - began
            log.warning("rank %d: averaging failed (%s); carrying %d steps to the next one",
                        self.rank, exc, steps)
            self._leave_group()
            self._carry, self.unaveraged = steps, True
            self.outbox(m.SyncAck(rank=self.rank, step_count=self.step, divergence=0.0,
                                  failed=True))
        else:
            took = time.perf_counter() - began
            self.account.averaging_s += took
            self._carry, self.unaveraged = 0, False
            self.outbox(m.SyncAck(rank=self.rank, step_count=self.step,
                                  divergence=result.divergence, post_norm=result.post_norm,
                                  pre_norm=result.pre_norm, received_at=received_at,
                                  average_ms=took * 1000.0,
                                  collective_ms=result.collective_ms))
        self.window = _Window()  # closed until the SetGlobalStep that follows
        self.throttled = False
        self.ready_at = time.perf_counter()

    def _average(self, steps: int, run: m.RunConfig) -> averaging.AverageResult:
        if not self.group_ready:
            raise RuntimeError("no communicator session (a peer was lost)")
        wake = threading.Event()
        with self._release_lock:
            if self._deaths_queued > self._deaths_handled:  # its DeclareDead is queued
                raise averaging.CollectiveReleased(f"{self._released_by} was declared dead")
            self._collective_wake = wake
        try:
            return averaging.average(self.flat, steps, gamma=run.gamma,
                                     measure=run.policy is not m.Policy.SYNC,
                                     device=self.device, wake=wake)
        except averaging.CollectiveReleased:
            self.released += 1
            self._abandoned = True
            averaging.abandon_buffers(self.flat)  # the abandoned collective may write there
            raise
        finally:
            with self._release_lock:
                self._collective_wake = None

    def release_collective(self, dead_rank: int) -> None:
        """Called by the agent (its own thread) as it queues a DeclareDead of another rank:
        a collective in flight is released now (its group is broken; the DeclareDead that
        follows in the inbox leaves it), and so is any begun before that DeclareDead is
        handled."""
        with self._release_lock:
            self._deaths_queued += 1
            self._released_by = f"rank {dead_rank}"
            wake = self._collective_wake
            if self._forming is not None:  # the session being formed cannot form now
                self._forming.interrupt(f"rank {dead_rank} was declared dead")
        if wake is not None:
            wake.set()
        if wake is not None and dist.is_initialized() and dist.get_backend() == "nccl":
            _abort_nccl()  # a kernel waits on the dead peer: only an abort frees the stream

    # ------------------------------------------------------ the broker backend

    def _on_request_params(self, msg: m.RequestParams) -> None:
        run = self.active_run()
        if run.backend is not m.Backend.BROKER or self.settings.contribution_sink is None:
            log.error("rank %d: RequestParams refused: backend %s averages with collectives "
                      "(changes nothing)", self.rank, run.backend.value)
            return
        if self._round is not None:
            log.warning("rank %d: RequestParams %d while round %d is unanswered; its steps "
                        "carry into this one", self.rank, msg.version, self._round.version)
            self._carry += self._round.steps
        steps = self.window.steps + self._carry
        snap, blob = averaging.snapshot(self.flat, version=msg.version, steps=steps,
                                        step=self.step, gamma=run.gamma, bf16=run.bf16_wire)
        self._round, self._carry = snap, 0
        self.window = _Window()  # closed until the SetGlobalStep that follows
        self.ready_at = time.perf_counter()
        self.settings.contribution_sink(msg.version, blob, snap.mass, snap.step)

    def _on_consensus(self, arrived: Consensus) -> Outcome | None:
        msg, snap = arrived.update, self._round
        if snap is None or msg.version != snap.version:
            log.warning("rank %d: Update %d ignored: the round in flight is %s", self.rank,
                        msg.version, "none" if snap is None else snap.version)
            return None
        self._round, self.throttled = None, False
        run = self.active_run()
        alpha = 1.0 if snap.mass == 0 else run.easgd_alpha  # idle: nothing of its own to keep
        usable = msg.realized and arrived.blob is not None and (
            self.rank in msg.accepted or snap.mass == 0)
        if usable:
            result, self.consensus = averaging.apply_consensus(
                self.flat, snap, arrived.blob or b"", alpha=alpha,
                measure=run.policy is not m.Policy.SYNC)
            self.unaveraged = False
            self.outbox(m.SyncAck(rank=self.rank, step_count=snap.step,
                                  divergence=result.divergence, post_norm=result.post_norm,
                                  pre_norm=result.pre_norm))
        elif not msg.realized and snap.mass == 0:  # nobody moved: nothing to change
            self.outbox(m.SyncAck(rank=self.rank, step_count=snap.step, divergence=0.0))
        else:  # not in the consensus (late, lost, or the reduce failed): keep and carry
            log.warning("rank %d: round %d left this rank out (%s); carrying %d steps",
                        self.rank, msg.version, arrived.error or "snapshot not accepted",
                        snap.steps)
            self._carry += snap.steps
            self.unaveraged = True
            self.outbox(m.SyncAck(rank=self.rank, step_count=snap.step, divergence=0.0,
                                  failed=True))
        self.ready_at = time.perf_counter()
        if msg.next_plan is not None:
            self._on_start_epoch(m.StartEpoch(plan=msg.next_plan))
        deferred, self._deferred = self._deferred, []
        for later in deferred:
            done = self._handle(later)
            if done is not None:
                return done
        return None

    @contextlib.contextmanager
    def consensus_view(self) -> Iterator[None]:
        """The last realized consensus in place of the live parameters for the duration
        (broker backend: the live model has trained on, or is an EASGD blend); the live
        parameters come back verbatim."""
        if self.consensus is None:
            yield
            return
        with torch.no_grad():
            live = [f.clone() for f in self.flat.flats]
            for f, c in zip(self.flat.flats, self.consensus, strict=True):
                f.copy_(c)
        try:
            yield
        finally:
            with torch.no_grad():
                for f, x in zip(self.flat.flats, live, strict=True):
                    f.copy_(x)

    def adopt_consensus(self) -> None:
        """Become the last realized consensus for good (the run's end: equal replicas)."""
        if self.consensus is not None:
            with torch.no_grad():
                for f, c in zip(self.flat.flats, self.consensus, strict=True):
                    f.copy_(c)

    def _on_throttle(self, _msg: m.Throttle) -> None:
        self.throttled = True  # until SyncNow, Update or Shutdown

    def _on_role(self, msg: m.SetEpochCallbackRole) -> None:
        self.epoch_fn_role = msg.rank

    def _on_aggregated(self, msg: m.EpochAggregated) -> None:
        self.ctx.latest_metrics = msg.metrics

    def _on_eval_broadcast(self, msg: m.EvalBroadcast) -> None:
        self.ctx.last_eval = (msg.epoch, msg.metric)

    def active_run(self) -> m.RunConfig:
        if self.run_config is None:
            raise RuntimeError("control message before the run configuration (Accept)")
        return self.run_config

    # ------------------------------------------------------------------ training

    def _set_lr(self) -> float:
        if self._schedule is None:
            return float(self.optimizer.param_groups[0]["lr"])
        lr = float(self._schedule(self.global_step + self.window.steps)) * self._lr_scale
        for g, ratio in zip(self.optimizer.param_groups, self._group_ratios, strict=True):
            g["lr"] = lr * ratio
        return lr

    def _train_batch(self) -> None:
        plan = self.plans[0]
        # an older epoch's reassigned work (ExtendPartition after plans of the next) trains
        # under its own epoch (its permutation, its MetricsMsg, ctx.epoch while train_step
        # runs), but the rank stays in the newest: epoch_fn runs once per epoch
        if self.epoch is None or plan.epoch > self.epoch:
            self._enter_epoch(plan.epoch)
        self.ctx.epoch = plan.epoch
        run = self.active_run()
        t0 = time.perf_counter()
        if plan.started_at is None:
            plan.started_at = t0
        batch = _to_device(self.loader.take(plan), self.device)
        self.loader.ahead(self.plans)  # the next batches are read while this one computes
        t1 = time.perf_counter()
        self.release()  # the previous batch's reports go out while this one computes
        lr = self._set_lr()
        self.optimizer.zero_grad(set_to_none=True)
        begun = self.clock.begin()
        if self._amp is None:
            loss = self.spec.train_step(self.model, batch)
        else:
            with torch.autocast(device_type=self.device.type, dtype=self._amp):
                loss = self.spec.train_step(self.model, batch)
        loss.backward()  # type: ignore[no-untyped-call]
        if self.spec.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.max_grad_norm)
        self.optimizer.step()
        t2 = time.perf_counter()
        if self.settings.slowdown > 1.0:
            time.sleep((t2 - t1) * (self.settings.slowdown - 1.0))
            t2 = time.perf_counter()
        span = self.clock.end(begun, (t2 - t1) * 1000.0)  # on CUDA: read once it is over
        self.step += 1
        self.window.steps += 1
        self.ctx.local_step = self.step
        every = run.param_norm_every
        norm = math.sqrt(sum(float(torch.linalg.vector_norm(f)) ** 2 for f in self.flat.flats)) \
            if every and self.step % every == 0 else None
        # the report after which this rank stops (budget reached, or no plan left) is stored
        # with an ack: the coordinator's gate waits on it; the others may be lost harmlessly
        closing = self.window.steps >= self.window.budget or (plan.done and len(self.plans) == 1)
        update = None
        if lr != self._last_lr:
            self._last_lr = lr
            update = m.LrUpdate(rank=self.rank, lr=lr)
        self._launched.append(_Launched(
            plan=plan, step=self.step, loss=loss.detach(), span=span,
            data_ms=max(0.0, (t1 - self.ready_at) * 1000.0), norm=norm, update=update,
            closing=closing))
        # the window's last batch, a plan's, and one whose train_step said an intent are
        # reported at once (in step order); any other once its compute is over
        self._settle(every=closing or plan.done or bool(self.ctx.intents))
        if plan.done:
            self._finish_plan(plan, t2)
        self.send_intents()
        self.ready_at = t2

    def _settle(self, *, every: bool = True) -> None:
        """Report the launched batches whose compute is over (``every``: all of them,
        waiting for the GPU if it must), oldest first; at most ``IN_FLIGHT`` stay behind."""
        while self._launched and (every or len(self._launched) > IN_FLIGHT
                                  or self._launched[0].span.ready()):
            b = self._launched.popleft()
            batch_ms = b.span.ms()
            loss_value = float(b.loss)
            reports: list[m.Batch | m.LrUpdate] = [m.Batch(
                rank=self.rank, batch_ms=batch_ms, data_ms=b.data_ms, step_count=b.step,
                param_norm=b.norm,
                batch_loss=loss_value if math.isfinite(loss_value) else None)]
            if b.update is not None:
                reports.append(b.update)
            self._report(reports, time.perf_counter(), closing=b.closing)
            b.plan.batches += 1
            b.plan.loss_sum += loss_value
            b.plan.compute_ms += batch_ms
            b.plan.data_ms += b.data_ms

    def _finish_plan(self, plan: Plan, now: float) -> None:
        self.plans.popleft()
        run = self.active_run()
        metrics = m.MetricsMsg(
            rank=self.rank, epoch=plan.epoch,
            avg_loss=plan.loss_sum / plan.batches if plan.batches else math.nan,
            batches_processed=plan.batches,
            epoch_ms=(now - (plan.started_at or now)) * 1000.0,
            samples_processed=plan.batches * run.batch_size,
            share_complete_ms=plan.compute_ms + plan.data_ms,
            compute_only_ms=plan.compute_ms, data_starve_ms=plan.data_ms,
            scalars=self.ledger.drain(), resources=self.resources.sample())
        for msg, durable in self._reports.metrics(metrics):  # now, or held (reports.py)
            self.outbox(msg, durable=durable)

    def _enter_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.ctx.epoch = epoch
        if self.spec.epoch_fn is not None and self.epoch_fn_role == self.rank:
            callbacks.run_epoch_fn(self, epoch)

    def send_intents(self) -> None:
        while self.ctx.intents:
            self.outbox(m.Intent(rank=self.rank, kind=self.ctx.intents.pop(0)))


def _to_device(batch: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple | list):
        return type(batch)(_to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch


_NEED_CONSENSUS = (m.ExecuteEvalCallback, m.Checkpoint, m.SaveConsensusModel)
# what a rank waits for between batches in a run's steady state (the exit's account)
_CYCLE = (m.SetGlobalStep, m.SyncNow, m.StartEpoch, m.ExtendPartition)

_HANDLERS: dict[type[Any], Callable[[Trainer, Any], Outcome | None]] = {
    m.NewNcclSession: Trainer._on_session,
    m.DeclareDead: Trainer._on_declare_dead,
    m.RequestNewNcclId: Trainer._on_request_id,
    m.SetGlobalStep: Trainer._on_global_step,
    m.StartEpoch: Trainer._on_start_epoch,
    m.ExtendPartition: Trainer._on_extend,
    m.SyncNow: Trainer._on_sync,
    m.Throttle: Trainer._on_throttle,
    m.RequestParams: Trainer._on_request_params,
    m.SetEpochCallbackRole: Trainer._on_role,
    m.EpochAggregated: Trainer._on_aggregated,
    m.EvalBroadcast: Trainer._on_eval_broadcast,
}
