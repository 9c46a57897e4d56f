"""Compute-bound training: a 0.4 M-parameter MLP on synthetic data.

``BENCH_BATCH`` (default 256) sets the batch size; ``BENCH_EPOCHS`` (default 6) the epochs;
``BENCH_PREFETCH`` (default: the spec's own default, 0 for this in-memory dataset on the CPU)
the batches read ahead.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.nn import functional
from torch.utils.data import TensorDataset

from ddpbus.worker_agent import TrainSpec

SAMPLES, FEATURES = 51_200, 256
BATCH = int(os.environ.get("BENCH_BATCH", "256"))
g = torch.Generator().manual_seed(3)
X = torch.randn(SAMPLES, FEATURES, generator=g)
Y = X[:, :10].argmax(1)


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 10))


def step(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return functional.cross_entropy(m(b[0]), b[1])


DATASET = TensorDataset(X, Y)
LR = 0.01

spec = TrainSpec(
    model=model,
    optimizer=lambda params: torch.optim.SGD(params, lr=LR),
    train_step=step,
    dataset=DATASET,
    batch_size=BATCH,
    epochs=int(os.environ.get("BENCH_EPOCHS", "6")),
    policy="cadence",
    prefetch=int(os.environ["BENCH_PREFETCH"]) if "BENCH_PREFETCH" in os.environ else None,
)
