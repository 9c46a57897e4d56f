"""A training spec is checked when it is loaded: a wrong one is a clear ConfigError (the CLI
turns it into exit status 2 before anything starts), never a traceback later in a worker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from worker_harness import spec

from ddpbus.codecs.errors import ConfigError
from ddpbus.worker_agent.spec import WorkerContext, bind_context, load_spec


@pytest.mark.parametrize(("change", "message"), [
    ({"model": torch.nn.Linear(4, 1)}, r"model must be a factory .* model=Linear, not "
                                       r"model=Linear\(\)"),
    ({"dataset": 42}, "dataset must be an indexable dataset .* not a int"),
    ({"eval_dataset": object()}, "eval_dataset must be an indexable dataset"),
    ({"max_grad_norm": "1"}, "max_grad_norm must be a number > 0, not '1'"),
    ({"max_grad_norm": True}, "max_grad_norm must be a number > 0"),
    ({"max_grad_norm": 0.0}, "max_grad_norm must be a number > 0"),
    ({"prefetch": -1}, "prefetch must be None or a whole number of batches from 0 to 64"),
    ({"prefetch": 65}, "prefetch must be None or a whole number of batches from 0 to 64"),
    ({"prefetch": True}, "prefetch must be None or a whole number"),
    ({"prefetch": 2.0}, "prefetch must be None or a whole number"),
    ({"amp": "fp16"}, r"amp must be 'bf16' or None, not 'fp16' \(fp16 would need loss "),
    ({"amp": ["bf16"]}, "amp must be 'bf16' or None"),
    ({"cudnn_benchmark": "yes"}, "cudnn_benchmark must be True or False, not 'yes'"),
])
def test_a_wrong_field_is_refused_with_what_it_should_be(change: dict[str, Any],
                                                         message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        spec(**change)


def test_what_a_spec_may_be_is_accepted() -> None:
    data = spec().dataset
    assert spec(dataset=lambda: data, eval_dataset=data, max_grad_norm=1).dataset is not None


def test_a_spec_module_that_fails_to_build_its_spec_is_a_clear_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("from ddpbus.worker_agent import TrainSpec\n"
                      "spec = TrainSpec(model=list, train_step=len, dataset=[1])\n")
    with pytest.raises(ConfigError, match=r"spec module .*broken.py' failed to load: "
                       r"TypeError: .*optimizer.* \(at .*broken.py:2\)"):
        load_spec(f"{broken}:spec")


def test_the_digits_schedule_spans_the_runs_own_epochs_and_batch_size() -> None:
    digits = load_spec("examples/digits.py:spec")
    assert digits.lr_scheduler is not None
    lr = digits.lr_scheduler(2)
    steps_per_epoch = 1438 // 32
    try:
        bind_context(WorkerContext(rank=0, world_size=2, epochs=20, batch_size=32))
        end_of_20 = lr(20 * steps_per_epoch)
        bind_context(WorkerContext(rank=0, world_size=2, epochs=40, batch_size=32))
        half_of_40 = lr(20 * steps_per_epoch)
    finally:
        bind_context(None)
    assert end_of_20 == pytest.approx(0.05 * 0.05)  # the floor, at the end of 20 epochs
    assert half_of_40 == pytest.approx(0.05 * (0.05 + 0.95 * 0.5))  # halfway through 40
