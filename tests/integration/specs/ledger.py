"""Digits with a coverage ledger: every trained sample index is written down per rank."""

from __future__ import annotations

import os

import torch
from common import Ledger, accuracy, digits, mlp

from ddpbus.worker_agent import TrainSpec

TRAIN, TEST = digits(with_index=True)

spec = TrainSpec(
    model=mlp,
    optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    train_step=Ledger(),
    dataset=TRAIN,
    batch_size=32,
    epochs=int(os.environ.get("LEDGER_EPOCHS", "20")),  # fewer for the slow sync runs
    eval_fn=accuracy,
    eval_dataset=TEST,
    knobs={"lr_scale_ratio": 0.5},
)
