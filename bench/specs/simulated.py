"""The coordinator's spec for runs driven by ``ddpbus simulate`` (nobody trains with it).

The coordinator reads only its settings: batch size, epochs, policy and knobs. The model and
dataset are placeholders of the right kinds. ``SIM_EPOCHS`` sets the epochs (default 2).
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.nn import functional
from torch.utils.data import TensorDataset

from ddpbus.worker_agent import TrainSpec


def _model() -> nn.Module:
    return nn.Linear(4, 2)


def _optimizer(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)  # type: ignore[arg-type]


def _step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return functional.cross_entropy(model(x), y)


spec = TrainSpec(
    model=_model,
    optimizer=_optimizer,
    train_step=_step,
    dataset=TensorDataset(torch.zeros(64, 4), torch.zeros(64, dtype=torch.int64)),
    batch_size=8,
    epochs=int(os.environ.get("SIM_EPOCHS", "2")),
    policy="cadence",
    knobs={"bundle_every": 0},
)
