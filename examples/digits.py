"""Handwritten digits with ddpbus: ``ddpbus run examples/digits.py:spec --workers 2``.

scikit-learn's bundled digits (1,797 real 8x8 handwritten digits, no download), split once
into 1,438 training and 359 held-out test images with a fixed seed. A small MLP, SGD with
momentum and a cosine LR schedule; the eval metric is test accuracy. Copy this file to
start your own spec: everything ddpbus needs is the ``spec`` object at the bottom.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional
from torch.utils.data import TensorDataset

from ddpbus.worker_agent import TrainSpec, current, record_scalar

SPLIT_SEED = 0
TEST_FRACTION = 0.2
EPOCHS = 20
BASE_LR = 0.05


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """``sklearn.datasets.load_digits(return_X_y=True)``, read from the CSV file that
    scikit-learn ships without importing scikit-learn: that import (SciPy with it) costs as
    much as torch's, in the coordinator and in every worker."""
    found = importlib.util.find_spec("sklearn")  # finds the package, runs none of it
    csv = Path(found.origin).parent / "datasets" / "data" / "digits.csv.gz" \
        if found is not None and found.origin is not None else None
    if csv is None or not csv.exists():  # another layout: the documented way
        from sklearn.datasets import load_digits as load

        x, y = load(return_X_y=True)
        return x, y
    data = np.loadtxt(csv, delimiter=",")
    return data[:, :-1], data[:, -1].astype(np.int64)


def _split() -> tuple[TensorDataset, TensorDataset]:
    x_np, y_np = load_digits()
    x = torch.tensor(x_np, dtype=torch.float32) / 16.0
    y = torch.tensor(y_np, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_test = int(len(y) * TEST_FRACTION)
    test, train = order[:n_test], order[n_test:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


TRAIN, TEST = _split()


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(),
                         nn.Linear(64, 10))


def make_optimizer(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=BASE_LR, momentum=0.9)  # type: ignore[arg-type]


def train_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    record_scalar("train_accuracy", float((logits.argmax(1) == y).float().mean()))
    return functional.cross_entropy(logits, y)


def accuracy(model: nn.Module, dataset: TensorDataset) -> float:
    device = next(model.parameters()).device  # the rank's device (cpu or cuda:N)
    x, y = (t.to(device) for t in dataset.tensors)
    return float((model(x).argmax(1) == y).float().mean())


def cosine(world_size: int) -> Callable[[int], float]:
    """LR by global step: cosine from BASE_LR to 5 % of it over the whole run, as long as
    the run's settings make it (``--epochs``, ``--batch-size``, a resumed run's total)."""

    def lr(step: int) -> float:
        run = current()  # called on the rank, between batches
        total = max(1, run.epochs * (len(TRAIN) // run.batch_size))
        t = min(step / total, 1.0)
        return BASE_LR * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t)))

    del world_size  # the schedule is per global step; ddpbus applies the LR scale
    return lr


spec = TrainSpec(
    model=make_model,
    optimizer=make_optimizer,
    train_step=train_step,
    dataset=TRAIN,
    batch_size=32,
    epochs=EPOCHS,
    lr_scheduler=cosine,
    eval_fn=accuracy,
    eval_dataset=TEST,
    policy="cadence",
    knobs={"lr_scale_ratio": 0.5},
)
