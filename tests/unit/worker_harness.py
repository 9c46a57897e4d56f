"""One rank's Trainer, driven without NATS: control messages go into its inbox, its reports
are collected (tests of the worker's training thread and of the agent around it)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from ddpbus.codecs import messages as m
from ddpbus.worker_agent.spec import TrainSpec
from ddpbus.worker_agent.trainer import Trainer, TrainerSettings

N, BATCH = 64, 8  # samples, batch size


def spec(**kw: Any) -> TrainSpec:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(N, 4, generator=g), torch.randn(N, 1, generator=g))
    base: dict[str, Any] = {
        "model": lambda: torch.nn.Linear(4, 1),
        "optimizer": lambda params: torch.optim.SGD(params, lr=0.01),
        "train_step": lambda model, b: torch.nn.functional.mse_loss(model(b[0]), b[1]),
        "dataset": data, "batch_size": BATCH}
    return TrainSpec(**{**base, **kw})


def run_config(**kw: Any) -> m.RunConfig:
    base = m.RunConfig(policy=m.Policy.CADENCE, backend=m.Backend.BROKER, batch_size=BATCH,
                       epochs=2, seed=1, gamma=1.0, lr_scale_ratio=0.0, dataset_size=N)
    return replace(base, **kw)


def plan(epoch: int, offset: int, size: int, rank: int = 0) -> m.RankPlan:
    return m.RankPlan(rank=rank, plan=m.EpochPlan(epoch=epoch, partition_offset=offset,
                                                  partition_size=size))


def window(*plans: m.RankPlan) -> m.SetGlobalStep:
    """An open window without a step budget, with these plans."""
    return m.SetGlobalStep(global_step=0, plans=plans)


class Rank:
    """Rank 0 of a world of 2, broker backend (no communicator to form)."""

    def __init__(self, train_spec: TrainSpec | None = None, **settings: Any) -> None:
        self.sent: list[m.Message] = []
        self.refused: list[str] = []
        self._lock = threading.Condition()
        self.trainer = Trainer(train_spec or spec(), TrainerSettings(
            **({"rank": 0, "device": torch.device("cpu"), "store_factory": dist.HashStore,
                "refusal_sink": self.refused.append} | settings)), self._outbox)
        self.trainer.configure(run_config(), world_size=2)

    def _outbox(self, msg: m.Message, _durable: bool) -> None:
        with self._lock:
            self.sent.append(msg)
            self._lock.notify_all()

    def put(self, *msgs: m.ControlMsg) -> None:
        for msg in msgs:
            self.trainer.deliver(msg, time.time())  # as the agent does

    def wait_for(self, done: Callable[[], bool], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        with self._lock:
            while not done():
                if not self._lock.wait(timeout=deadline - time.monotonic()):
                    raise TimeoutError("the trainer did not get there")

    def wait_steps(self, steps: int) -> None:
        self.wait_for(lambda: any(b.step_count >= steps for b in self.batches()))

    def stop(self) -> None:
        self.trainer.halt("test over", clean=True)
        self.trainer.join(timeout=30)
        assert not self.trainer.is_alive()

    def of(self, kind: type[Any]) -> list[Any]:
        return [x for x in self.sent if isinstance(x, kind)]

    def batches(self) -> list[m.Batch]:
        return [b for x in list(self.sent) for b in m.batches(x)]
