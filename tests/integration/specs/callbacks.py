"""Every callback path: eval, checkpoint (failing once on the first rank that gets it),
epoch_fn asking for an extra eval and checkpoint, custom scalars, an LR schedule."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from common import accuracy, digits, loss, mlp

from ddpbus.worker_agent import TrainSpec, WorkerContext

TRAIN, TEST = digits()
OUT = Path(os.environ.get("CALLBACK_DIR", "."))


def checkpoint(version: int, model: torch.nn.Module) -> None:
    marker = OUT / "failed-once"
    if not marker.exists():
        marker.write_text("1")
        raise OSError("simulated full disk")
    torch.save({k: v.clone() for k, v in model.state_dict().items()},
               OUT / f"user-checkpoint-v{version}.pt")


def epoch_fn(epoch: int, ctx: WorkerContext) -> None:
    with (OUT / f"epoch-fn-rank-{ctx.rank}.txt").open("a") as f:
        f.write(f"{epoch}\n")
    if epoch == 1:
        ctx.request_eval()
        ctx.request_checkpoint()


spec = TrainSpec(
    model=mlp,
    optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    train_step=loss,
    dataset=TRAIN,
    batch_size=32,
    epochs=4,
    lr_scheduler=lambda world: (lambda step: 0.05 if step < 60 else 0.02),
    eval_fn=accuracy,
    eval_dataset=TEST,
    checkpoint_fn=checkpoint,
    epoch_fn=epoch_fn,
    knobs={"eval_every": 2, "checkpoint_every": 3, "lr_scale_ratio": 0.5},
)
