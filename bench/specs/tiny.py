"""A model too small to cost anything: what is left of an average is the control path."""

from __future__ import annotations

import torch
from torch.nn import functional
from torch.utils.data import TensorDataset

from ddpbus.worker_agent import TrainSpec

X = torch.randn(4096, 8, generator=torch.Generator().manual_seed(0))
Y = (X[:, 0] > 0).long()

spec = TrainSpec(
    model=lambda: torch.nn.Linear(8, 2),
    optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
    train_step=lambda m, b: functional.cross_entropy(m(b[0]), b[1]),
    dataset=TensorDataset(X, Y),
    batch_size=64,
    epochs=5,
    policy="sync",
)
