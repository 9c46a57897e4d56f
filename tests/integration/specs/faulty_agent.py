"""The chaos spec, with a fault injected (tests/integration/test_supervision.py), chosen
by $FAULT:

- ``control`` (the default): the control reader fails on the first control message after
  the Accept (a bug in handling one);
- ``publish-worker`` / ``publish-coordinator``: that process's publisher gives a message
  up after 2 s of connected retries (instead of 60 s), for a test that makes the stream
  refuse it.

The coordinator and the workers all load the spec; only the process named is changed."""

from __future__ import annotations

import os
import sys
from typing import Any

from chaos import spec

from ddpbus.orchestrator.transport import bus
from ddpbus.worker_agent import agent

_handle = agent.WorkerAgent._on_control


async def _failing(self: agent.WorkerAgent, msg: Any) -> None:
    if self._admitted is not None and self._admitted.done():
        raise RuntimeError("injected: a bug in handling a control message")
    await _handle(self, msg)


FAULT = os.environ.get("FAULT", "control")
if FAULT == "control" and "worker" in sys.argv:
    agent.WorkerAgent._on_control = _failing  # type: ignore[method-assign]
elif FAULT.startswith("publish-") and FAULT.removeprefix("publish-") in sys.argv:
    bus.Publisher.__init__.__kwdefaults__["retry_deadline"] = 2.0

__all__ = ["spec"]
