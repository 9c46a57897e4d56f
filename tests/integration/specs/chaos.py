"""Digits with a per-incarnation coverage ledger, long enough to kill ranks mid-run.

Every trained sample is written as ``epoch index pid`` to $LEDGER_DIR/rank-N.txt, so a test
can tell a killed incarnation's batches from its successor's.
"""

from __future__ import annotations

import os

import torch
from common import accuracy, digits, loss, mlp
from torch import nn

from ddpbus.worker_agent import TrainSpec, current

TRAIN, TEST = digits(with_index=True)


class PidLedger:
    def __init__(self) -> None:
        self.dir = os.environ["LEDGER_DIR"]

    def __call__(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        ctx = current()
        pid = os.getpid()
        with open(os.path.join(self.dir, f"rank-{ctx.rank}.txt"), "a") as f:
            f.write("".join(f"{ctx.epoch} {int(i)} {pid}\n" for i in batch[2]))
        return loss(model, batch)


spec = TrainSpec(
    model=mlp,
    optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    train_step=PidLedger(),
    dataset=TRAIN,
    batch_size=32,
    epochs=int(os.environ.get("CHAOS_EPOCHS", "30")),
    eval_fn=accuracy,
    eval_dataset=TEST,
    knobs={"lr_scale_ratio": 0.5, "heartbeat_timeout": 2.0},
)
