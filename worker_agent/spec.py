"""The user API: a training spec in the user's own module, and what user code can call.

::

    # my_job.py
    from ddpbus.worker_agent import TrainSpec, record_scalar

    spec = TrainSpec(
        model=lambda: Net(),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        train_step=lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]),
        dataset=train_set, batch_size=64, epochs=10,
        eval_fn=accuracy, eval_dataset=test_set,
        policy="cadence", knobs={"anchor": 10},
    )

``ddpbus run my_job.py:spec --workers 2`` trains it. Everything is checked when the spec is
built: an unknown knob or a bad value raises :class:`~ddpbus.codecs.errors.ConfigError`
before any process starts.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from ddpbus.codecs import messages as m
from ddpbus.codecs.errors import ConfigError
from ddpbus.orchestrator.core.config import Schedule, schedule_from

if TYPE_CHECKING:
    import torch


MAX_PREFETCH: Final = 64
AMP_DTYPES: Final[dict[str | None, str]] = {None: "", "bf16": "bfloat16"}  # amp -> torch dtype


@dataclass(frozen=True, kw_only=True)
class TrainSpec:
    """What to train and how. Factories are called once per rank, inside its process.

    - ``model()`` -> ``torch.nn.Module`` (every rank must build the same architecture);
    - ``optimizer(params)`` -> ``torch.optim.Optimizer``;
    - ``train_step(model, batch)`` -> scalar loss tensor (ddpbus runs backward and step);
    - ``dataset``: any indexable dataset (``len`` + ``__getitem__``), or a zero-argument
      callable returning one; one with a ``stage(indices)`` method hears, from a
      background thread at each epoch's start, the samples the epoch's plans will read
      (this rank's first), to read them ahead (the coordinator's StageAdvisory);
    - ``lr_scheduler(world_size)`` -> a pure function ``step -> lr`` (global step); ddpbus
      multiplies it by the LR scale ``1 + (world - 1) * lr_scale_ratio``;
    - ``eval_fn(model, eval_dataset)`` -> float (e.g. accuracy), run on one elected rank
      on the consensus model at epoch boundaries;
    - ``checkpoint_fn(version, model)``: run on the elected checkpoint rank;
    - ``epoch_fn(epoch, ctx)``: run on the elected rank when it starts an epoch;
    - ``policy``: ``sync`` | ``cadence`` | ``async``; ``backend``: ``auto`` | ``nccl`` |
      ``gloo`` | ``broker``; ``knobs``: scheduler settings (see
      ``ddpbus.orchestrator.core.config.KNOBS``);
    - ``prefetch``: batches fetched ahead on a background thread while the rank computes
      (in pinned memory on CUDA, copied with ``non_blocking``); 0 fetches each in the
      training thread. None (the default): 2 on CUDA and for a dataset that is not an
      in-memory ``TensorDataset``, 0 for one on the CPU (indexing memory costs less than
      handing a batch between threads);
    - ``amp``: ``"bf16"`` runs ``train_step`` (the forward pass and the loss) under
      ``torch.autocast`` in bfloat16 (parameters, gradients and averages stay float32; bf16
      needs no loss scaling); None trains in the model's dtype;
    - ``cudnn_benchmark``: sets ``torch.backends.cudnn.benchmark`` in each rank (cuDNN
      picks the fastest convolution algorithms for fixed input shapes).
    """

    model: Callable[[], torch.nn.Module]
    optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
    train_step: Callable[[torch.nn.Module, Any], torch.Tensor]
    dataset: Any
    batch_size: int = 32
    epochs: int = 1
    lr_scheduler: Callable[[int], Callable[[int], float]] | None = None
    eval_fn: Callable[[torch.nn.Module, Any], float] | None = None
    eval_dataset: Any = None
    checkpoint_fn: Callable[[int, torch.nn.Module], None] | None = None
    epoch_fn: Callable[[int, WorkerContext], None] | None = None
    collate_fn: Callable[[list[Any]], Any] | None = None
    max_grad_norm: float | None = None
    policy: str = "cadence"
    backend: str = "auto"
    knobs: Mapping[str, Any] = field(default_factory=dict)
    prefetch: int | None = None
    amp: str | None = None
    cudnn_benchmark: bool = False

    def __post_init__(self) -> None:
        self._check_callables()
        self._check_data()
        self._check_speed()
        if not isinstance(self.knobs, Mapping):
            raise ConfigError("TrainSpec.knobs must be a mapping of knob name to value")
        for reserved in ("policy", "backend", "batch_size", "epochs"):
            if reserved in self.knobs:
                raise ConfigError(f"set {reserved} as TrainSpec({reserved}=...), not in knobs")
        self.schedule()  # refuse unknown knobs and bad values now, not at run time

    def _check_callables(self) -> None:
        for name in ("model", "optimizer", "train_step"):
            if not callable(getattr(self, name)):
                raise ConfigError(f"TrainSpec.{name} must be callable")
        from torch import nn  # the user's spec module imported torch already

        if isinstance(self.model, nn.Module):  # callable too, but one shared instance
            raise ConfigError("TrainSpec.model must be a factory that builds the model (e.g. "
                              f"model={type(self.model).__name__}, not model="
                              f"{type(self.model).__name__}()): every rank builds its own")
        for name in ("lr_scheduler", "eval_fn", "checkpoint_fn", "epoch_fn", "collate_fn"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise ConfigError(f"TrainSpec.{name} must be callable or None")

    def _check_data(self) -> None:
        if self.dataset is None:
            raise ConfigError("TrainSpec.dataset is required")
        for name in ("dataset", "eval_dataset"):
            value = getattr(self, name)
            if value is not None and not _indexable(value) and not callable(value):
                raise ConfigError(f"TrainSpec.{name} must be an indexable dataset (with "
                                  "__len__ and __getitem__, e.g. a torch Dataset) or a "
                                  f"function that builds one, not a {type(value).__name__}")
        if self.max_grad_norm is not None and (
                isinstance(self.max_grad_norm, bool)
                or not isinstance(self.max_grad_norm, int | float)
                or not self.max_grad_norm > 0):
            raise ConfigError(f"TrainSpec.max_grad_norm must be a number > 0, not "
                              f"{self.max_grad_norm!r}")

    def _check_speed(self) -> None:
        if self.prefetch is not None and (isinstance(self.prefetch, bool) or not isinstance(
                self.prefetch, int) or not 0 <= self.prefetch <= MAX_PREFETCH):
            raise ConfigError(f"TrainSpec.prefetch must be None or a whole number of batches "
                              f"from 0 to {MAX_PREFETCH}, not {self.prefetch!r}")
        if self.amp is not None and not (isinstance(self.amp, str) and self.amp in AMP_DTYPES):
            raise ConfigError(f"TrainSpec.amp must be 'bf16' or None, not {self.amp!r} (fp16 "
                              "would need loss scaling: bf16 has float32's range)")
        if not isinstance(self.cudnn_benchmark, bool):
            raise ConfigError(f"TrainSpec.cudnn_benchmark must be True or False, not "
                              f"{self.cudnn_benchmark!r}")

    def prefetch_depth(self, device: torch.device, dataset: Any) -> int:
        """How many batches a rank on ``device`` fetches ahead of ``dataset`` (see above)."""
        if self.prefetch is not None:
            return self.prefetch
        from torch.utils.data import TensorDataset
        return 0 if device.type == "cpu" and isinstance(dataset, TensorDataset) else 2

    def schedule(self, overrides: Mapping[str, Any] | None = None) -> Schedule:
        """The spec's settings, then ``overrides`` (command-line flags), checked."""
        base = {"policy": self.policy, "backend": self.backend,
                "batch_size": self.batch_size, "epochs": self.epochs}
        return schedule_from(base, self.knobs, overrides or {})

    def build_dataset(self) -> Any:
        return self.dataset() if callable(self.dataset) and not hasattr(
            self.dataset, "__getitem__") else self.dataset

    def build_eval_dataset(self) -> Any:
        ds = self.eval_dataset
        return ds() if callable(ds) and not hasattr(ds, "__getitem__") else ds


def load_spec(reference: str) -> TrainSpec:
    """``path/to/file.py:name``, ``package.module:name`` or ``path/to/file.py`` (name
    ``spec``) -> the :class:`TrainSpec` it names."""
    target, _, attr = reference.partition(":")
    attr = attr or "spec"
    path = Path(target)
    if target.endswith(".py") and not path.is_file():
        raise ConfigError(f"spec file {target} does not exist")
    try:
        module = _import_file(path) if path.is_file() else importlib.import_module(target)
    except ImportError as exc:
        raise ConfigError(f"cannot import spec module {target!r}: {exc}") from exc
    except (TypeError, ValueError) as exc:  # e.g. TrainSpec(...) without a required field
        raise ConfigError(f"spec module {target!r} failed to load: {_where(exc)}") from exc
    spec = getattr(module, attr, None)
    if spec is None:
        raise ConfigError(f"{target} has no attribute {attr!r}")
    if callable(spec) and not isinstance(spec, TrainSpec):
        spec = spec()
    if not isinstance(spec, TrainSpec):
        raise ConfigError(f"{reference} is a {type(spec).__name__}, not a ddpbus TrainSpec")
    return spec


def _indexable(value: Any) -> bool:
    return hasattr(value, "__getitem__") and hasattr(value, "__len__")


def _where(exc: BaseException) -> str:
    """The error and the line of the spec's own code that raised it."""
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else []
    mine = [f for f in frames if "importlib" not in f.filename] or frames
    return f"{type(exc).__name__}: {exc}" + (
        f" (at {mine[-1].filename}:{mine[-1].lineno})" if mine else "")


def _import_file(path: Path) -> Any:
    module_name = f"ddpbus_user_spec_{path.stem}"
    sys.path.insert(0, str(path.resolve().parent))  # let it import its neighbours
    loader = importlib.util.spec_from_file_location(module_name, path)
    if loader is None or loader.loader is None:
        raise ImportError(f"{path} is not an importable Python file")
    module = importlib.util.module_from_spec(loader)
    sys.modules[module_name] = module
    loader.loader.exec_module(module)
    return module


# ----------------------------------------------------------------- user calls


@dataclass
class WorkerContext:
    """What user code running on a rank can see and ask (``current()`` or epoch_fn's ctx)."""

    rank: int
    world_size: int
    epochs: int = 0  # the run's, as the coordinator set them (--epochs, a resume's total)
    batch_size: int = 0
    epoch: int = 0  # in train_step: the batch's epoch (a dead peer's older work included)
    global_step: int = 0
    local_step: int = 0
    model: Any = None
    optimizer: Any = None
    latest_metrics: m.EpochMetrics | None = None
    last_eval: tuple[int, float] | None = None
    intents: list[m.IntentKind] = field(default_factory=list)

    def request_eval(self) -> None:
        """Ask for an eval of the consensus model at the next epoch boundary."""
        self.intents.append(m.IntentKind.EVAL_NOW)

    def request_checkpoint(self) -> None:
        """Ask for a checkpoint of the consensus model at the next epoch boundary."""
        self.intents.append(m.IntentKind.CHECKPOINT_NOW)

    def poll_eval(self) -> tuple[int, float] | None:
        """The latest broadcast eval (epoch, metric), once; None when nothing new."""
        out, self.last_eval = self.last_eval, None
        return out


_local = threading.local()


def current() -> WorkerContext:
    """The running rank's context (inside train_step, eval_fn, epoch_fn, checkpoint_fn)."""
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise ConfigError("ddpbus.worker_agent.current() is only available inside a rank")
    return ctx  # type: ignore[no-any-return]


def bind_context(ctx: WorkerContext | None) -> None:
    _local.ctx = ctx


class ScalarLedger:
    """Sums of :func:`record_scalar` values for the plan being trained."""

    def __init__(self) -> None:
        self.sums: dict[str, list[float]] = {}

    def add(self, name: str, value: float) -> None:
        acc = self.sums.setdefault(name, [0.0, 0.0])
        acc[0] += value
        acc[1] += 1

    def drain(self) -> dict[str, m.ScalarSum]:
        out = {k: m.ScalarSum(sum=v[0], count=int(v[1])) for k, v in self.sums.items()}
        self.sums = {}
        return out


def bind_ledger(ledger: ScalarLedger | None) -> None:
    _local.ledger = ledger


def record_scalar(name: str, value: float) -> None:
    """Record a custom metric inside train_step; it is averaged into EpochMetrics.scalars
    (batch-weighted across ranks) and per rank into ``per_rank``."""
    ledger: ScalarLedger | None = getattr(_local, "ledger", None)
    if ledger is None:
        raise ConfigError("record_scalar() is only available inside train_step on a rank")
    ledger.add(str(name), float(value))
