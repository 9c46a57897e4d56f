"""Shared pieces of the integration-test training specs (real digits data, small models)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional
from torch.utils.data import TensorDataset

from ddpbus.worker_agent import current, record_scalar


def _example() -> object:
    """examples/digits.py: its loader reads sklearn's digits without importing sklearn (an
    import as costly as torch's, paid by every process the suite starts)."""
    where = Path(__file__).resolve().parents[3] / "examples" / "digits.py"
    found = importlib.util.spec_from_file_location("_ddpbus_digits_example", where)
    assert found is not None
    assert found.loader is not None
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    return module


load_digits = _example().load_digits  # type: ignore[attr-defined]


def digits(*, with_index: bool = False) -> tuple[TensorDataset, TensorDataset]:
    """The digits split of examples/digits.py (seed 0, 20 % held out)."""
    x_np, y_np = load_digits()
    x = torch.tensor(x_np, dtype=torch.float32) / 16.0
    y = torch.tensor(y_np, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    n_test = int(len(y) * 0.2)
    test, train = order[:n_test], order[n_test:]
    parts = [x[train], y[train]] + ([torch.arange(len(train))] if with_index else [])
    return TensorDataset(*parts), TensorDataset(x[test], y[test])


def mlp(hidden: int = 128) -> nn.Module:
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 64), nn.ReLU(),
                         nn.Linear(64, 10))


def accuracy(model: nn.Module, dataset: TensorDataset) -> float:
    device = next(model.parameters()).device
    x, y = (t.to(device) for t in dataset.tensors[:2])
    return float((model(x).argmax(1) == y).float().mean())


def loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, y = batch[0], batch[1]
    logits = model(x)
    record_scalar("train_accuracy", float((logits.argmax(1) == y).float().mean()))
    return functional.cross_entropy(logits, y)


class Ledger:
    """Appends ``epoch index`` lines for every trained sample to $LEDGER_DIR/rank-N.txt."""

    def __init__(self) -> None:
        self.dir = Path(os.environ["LEDGER_DIR"])

    def __call__(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        ctx = current()
        with (self.dir / f"rank-{ctx.rank}.txt").open("a") as f:
            f.write("".join(f"{ctx.epoch} {int(i)}\n" for i in batch[2]))
        return loss(model, batch)
