"""Parity with torch DDP: sync policy, plain SGD, equal shards, no LR scaling."""

from __future__ import annotations

import torch
from common import digits, mlp
from torch.nn import functional

from ddpbus.worker_agent import TrainSpec

SEED = 7
BATCH = 32
EPOCHS = 2
LR = 0.1
TRAIN, _ = digits()
# 1438 samples -> 44 batches of 32 per epoch: 22 per rank, one step each per average


def step(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return functional.cross_entropy(model(batch[0]), batch[1])


spec = TrainSpec(
    model=lambda: mlp(32),
    optimizer=lambda params: torch.optim.SGD(params, lr=LR),
    train_step=step,
    dataset=TRAIN,
    batch_size=BATCH,
    epochs=EPOCHS,
    policy="sync",
    knobs={"lr_scale_ratio": 0.0, "seed": SEED, "progressive": False},
)
