"""ddpbus.worker_agent: one agent per GPU that trains the slices the coordinator hands out.

The user API lives here: :class:`TrainSpec` (what to train), :func:`record_scalar` (custom
metrics from train_step) and :func:`current` (the running rank's context).
"""

from ddpbus.worker_agent.spec import TrainSpec, WorkerContext, current, load_spec, record_scalar

__all__ = ["TrainSpec", "WorkerContext", "current", "load_spec", "record_scalar"]
