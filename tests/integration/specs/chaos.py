"""Digits with a per-incarnation coverage ledger, long enough to kill ranks mid-run.

Every trained sample is written as ``epoch index pid`` to $LEDGER_DIR/rank-N.txt, so a test
can tell a killed incarnation's batches from its successor's.
"""

from __future__ import annotations

import dataclasses
import os

import ledger
import torch
from common import loss
from torch import nn

from ddpbus.worker_agent import current


class PidLedger:
    def __init__(self) -> None:
        self.dir = os.environ["LEDGER_DIR"]

    def __call__(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        ctx = current()
        pid = os.getpid()
        with open(os.path.join(self.dir, f"rank-{ctx.rank}.txt"), "a") as f:
            f.write("".join(f"{ctx.epoch} {int(i)} {pid}\n" for i in batch[2]))
        return loss(model, batch)


# the ledger spec's model, data and optimizer; a longer run that tells incarnations apart
spec = dataclasses.replace(
    ledger.spec, train_step=PidLedger(), epochs=int(os.environ.get("CHAOS_EPOCHS", "30")),
    knobs={**ledger.spec.knobs, "heartbeat_timeout": 2.0})
