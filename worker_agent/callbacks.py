"""The control messages a trainer answers with user callbacks, saves or its exit.

Callbacks run on the training thread between batches, right where the control stream puts
them: an ExecuteEvalCallback or Checkpoint that follows a SyncNow therefore sees the
consensus model. Their wall time is measured, reported (EvalResult, CheckpointResult,
EpochFnElapsed) and kept out of the data clock, so El Che never reads it as slowness. A
failing user callback is reported with its error; it never ends the rank.
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from ddpbus.codecs import messages as m
from ddpbus.worker_agent import checkpoint
from ddpbus.worker_agent.data import Stager
from ddpbus.worker_agent.spec import TrainSpec, WorkerContext


@dataclass(slots=True)
class Outcome:
    """How a trainer's run ended: cleanly or not, why, and the save the coordinator asked."""

    clean: bool
    reason: str
    save_reason: m.SaveReason | None = None


class HostSettings(Protocol):
    """The trainer's settings these handlers read (``TrainerSettings``)."""

    @property
    def out_dir(self) -> Path | None: ...
    @property
    def final_state(self) -> Path | None: ...
    @property
    def bundle_sink(self) -> Callable[[int, dict[str, bytes], dict[str, Any]], None] | None: ...


class Trainer(Protocol):
    """What the handlers need of the trainer they serve (``trainer.Trainer`` is the one
    kind). A protocol, so that this module does not import the trainer that imports it."""

    rank: int
    world_size: int
    epoch: int | None
    step: int
    global_step: int
    ready_at: float
    unaveraged: bool
    consensus: list[torch.Tensor] | None
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    eval_dataset: Any
    ctx: WorkerContext
    stager: Stager

    @property
    def spec(self) -> TrainSpec: ...
    @property
    def settings(self) -> HostSettings: ...
    def active_run(self) -> m.RunConfig: ...
    def outbox(self, msg: m.Message, *, durable: bool = True) -> None: ...
    def send_intents(self) -> None: ...
    def consensus_view(self) -> AbstractContextManager[None]: ...
    def adopt_consensus(self) -> None: ...

log = logging.getLogger(__name__)


def _error(exc: BaseException) -> str:
    frame = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" at {frame[0].filename}:{frame[0].lineno}" if frame else ""
    return f"{type(exc).__name__}: {exc}{where}"


class _Timed:
    """Measures a callback and moves the data clock past it."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def __enter__(self) -> _Timed:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.elapsed = time.perf_counter() - self.start
        self.trainer.ready_at += self.elapsed

    @property
    def ms(self) -> float:
        return self.elapsed * 1000.0


def _targeted(trainer: Trainer, target: int, what: str) -> bool:
    if target != trainer.rank:
        log.error("rank %d: %s addressed to rank %d refused (changes nothing)", trainer.rank,
                  what, target)
        return False
    return True


UNAVERAGED = ("this rank's latest average failed: its parameters are its own, not a "
              "consensus")


def run_eval(trainer: Trainer, msg: m.ExecuteEvalCallback) -> None:
    if not _targeted(trainer, msg.target_rank, "ExecuteEvalCallback"):
        return
    metric, error = 0.0, None
    with _Timed(trainer) as t:
        if trainer.spec.eval_fn is None:
            error = "this rank's spec has no eval_fn"
        elif trainer.unaveraged:
            error = UNAVERAGED
        elif msg.adopt_consensus and trainer.consensus is None:
            error = ("adopt_consensus needs a retained consensus copy; backend "
                     f"{trainer.active_run().backend.value} averages in place, so the live model "
                     "already is the consensus")
        else:
            model = trainer.model
            model.eval()
            try:
                with torch.no_grad(), trainer.consensus_view():
                    metric = float(trainer.spec.eval_fn(model, trainer.eval_dataset))
            except Exception as exc:  # a user eval that fails is reported, not fatal
                error, metric = _error(exc), 0.0
            finally:
                model.train()
    if error:
        log.warning("rank %d: eval for epoch %d failed: %s", trainer.rank, msg.epoch, error)
    trainer.outbox(m.EvalResult(rank=trainer.rank, schedule_id=msg.schedule_id,
                                epoch=msg.epoch, metric=metric, elapsed_ms=t.ms, error=error))
    trainer.send_intents()


def run_checkpoint(trainer: Trainer, msg: m.Checkpoint) -> None:
    if not _targeted(trainer, msg.target_rank, "Checkpoint"):
        return
    error = None
    with _Timed(trainer) as t:
        if trainer.spec.checkpoint_fn is None:
            error = "this rank's spec has no checkpoint_fn"
        elif trainer.unaveraged:  # the coordinator fails over after the next average
            error = UNAVERAGED
        else:
            try:
                with trainer.consensus_view():
                    trainer.spec.checkpoint_fn(msg.version, trainer.model)
            except Exception as exc:  # reported; the coordinator fails over to another rank
                error = _error(exc)
    trainer.outbox(m.CheckpointResult(rank=trainer.rank, version=msg.version,
                                      elapsed_ms=t.ms, error=error))
    trainer.send_intents()


def run_epoch_fn(trainer: Trainer, epoch: int) -> None:
    fn = trainer.spec.epoch_fn
    if fn is None:
        return
    with _Timed(trainer) as t:
        try:
            fn(epoch, trainer.ctx)
        except Exception as exc:  # a user epoch_fn that fails is logged, training goes on
            log.warning("rank %d: epoch_fn(%d) failed: %s", trainer.rank, epoch, _error(exc))
    trainer.outbox(m.EpochFnElapsed(rank=trainer.rank, epoch=epoch, elapsed_ms=t.ms))
    trainer.send_intents()


def _meta(trainer: Trainer, **extra: Any) -> dict[str, Any]:
    return {"rank": trainer.rank, "global_step": trainer.global_step,
            "local_step": trainer.step, "epoch": trainer.epoch, "world_size":
            trainer.world_size, **extra}


def save_consensus(trainer: Trainer, msg: m.SaveConsensusModel) -> None:
    """Right after an average: the model is the consensus. Write ``consensus.safetensors``
    (with ``--out``) and, for ``version`` > 0, hand resume bundle ``version`` to the agent:
    the blobs are copied here, on the training thread (so they are this consensus), and
    stored in the background while training goes on."""
    if not _targeted(trainer, msg.target_rank, "SaveConsensusModel"):
        return
    out = trainer.settings.out_dir
    sink = trainer.settings.bundle_sink
    if out is None and (msg.version == 0 or sink is None):
        log.error("rank %d: SaveConsensusModel but this rank has no --out directory",
                  trainer.rank)
        return
    if trainer.unaveraged:
        # a bundle whose record says "epoch done" over parameters no average made would
        # resume a run without the work its peers did: none is written, the job's latest
        # bundle stays the previous one (a resume redoes the epoch)
        log.warning("rank %d: %s not saved: %s", trainer.rank,
                    f"bundle v{msg.version}" if msg.version else "the consensus model",
                    UNAVERAGED)
        return
    with _Timed(trainer), trainer.consensus_view():
        if out is not None:
            path = out / "consensus.safetensors"
            checkpoint.save_model(path, trainer.model, _meta(trainer, kind="consensus"))
            log.info("rank %d: consensus model saved to %s", trainer.rank, path)
        if msg.version > 0 and sink is not None:
            _hand_bundle(trainer, msg, sink)


def _hand_bundle(trainer: Trainer, msg: m.SaveConsensusModel,
                 sink: Callable[[int, dict[str, bytes], dict[str, Any]], None]) -> None:
    try:
        meta = json.loads(msg.bundle_meta)
    except (ValueError, RecursionError):  # signed by the coordinator, yet read defensively
        meta = None
    if not isinstance(meta, dict):
        log.error("rank %d: bundle v%d refused (nothing stored): its meta is not a JSON "
                  "record", trainer.rank, msg.version)
        return
    meta["saved_by"] = trainer.rank
    tag = {"kind": "bundle", "version": msg.version, "global_step": meta.get("global_step")}
    blobs = {"model": checkpoint.model_bytes(trainer.model, tag),
             "optim": checkpoint.optimizer_bytes(trainer.optimizer, tag)}
    sink(msg.version, blobs, meta)


def _save_rank(trainer: Trainer, reason: m.SaveReason) -> None:
    out = trainer.settings.out_dir
    if out is None:
        log.error("rank %d: ShutdownWithSave(%s) but no --out directory to save into",
                  trainer.rank, reason.name)
        return
    meta = _meta(trainer, kind="rank", reason=reason.name)
    checkpoint.save_model(out / f"rank{trainer.rank}.safetensors", trainer.model, meta)
    checkpoint.save_optimizer(out / f"rank{trainer.rank}.optim.safetensors",
                              trainer.optimizer, meta)
    log.info("rank %d: model and optimizer saved to %s (%s)", trainer.rank, out, reason.name)


def save_final(trainer: Trainer, path: Path) -> None:
    checkpoint.save_model(path, trainer.model, _meta(trainer, kind="final"))


def handle(trainer: Trainer, msg: m.ControlMsg) -> Outcome | None:
    """Control messages without a handler on the trainer itself."""

    if isinstance(msg, m.ExecuteEvalCallback):
        run_eval(trainer, msg)
    elif isinstance(msg, m.Checkpoint):
        run_checkpoint(trainer, msg)
    elif isinstance(msg, m.SaveConsensusModel):
        save_consensus(trainer, msg)
    elif isinstance(msg, m.Shutdown):
        trainer.adopt_consensus()  # broker backend: every replica ends as the consensus
        if trainer.settings.final_state is not None:
            save_final(trainer, trainer.settings.final_state)
        return Outcome(clean=True, reason="shutdown")
    elif isinstance(msg, m.ShutdownWithSave):
        _save_rank(trainer, msg.reason)
        return Outcome(clean=True, reason=f"shutdown with save ({msg.reason.name})",
                       save_reason=msg.reason)
    elif isinstance(msg, m.Update):
        log.error("rank %d: Update refused: backend %s averages with collectives, not "
                  "through the broker (changes nothing)", trainer.rank,
                  trainer.active_run().backend.value)
    elif isinstance(msg, m.StageAdvisory):
        run = trainer.active_run()
        named = trainer.stager.advise(msg, dataset_size=run.dataset_size, seed=run.seed)
        log.debug("rank %d: StageAdvisory of %d samples (%s)", trainer.rank, named,
                  "staged ahead" if trainer.stager.hook is not None
                  else "the dataset has no stage()")
    else:
        log.error("rank %d: unexpected %s refused", trainer.rank, type(msg).__name__)
    return None
