"""Heterogeneity: a compute-bound MLP on synthetic data, so --slowdown dominates batch time."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional
from torch.utils.data import TensorDataset

from ddpbus.worker_agent import TrainSpec

g = torch.Generator().manual_seed(3)
X = torch.randn(12_800, 256, generator=g)
Y = (X[:, :10].argmax(1)).long()


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 10))


spec = TrainSpec(
    model=model,
    optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
    train_step=lambda m, b: functional.cross_entropy(m(b[0]), b[1]),
    dataset=TensorDataset(X, Y),
    batch_size=64,
    epochs=2,
)
