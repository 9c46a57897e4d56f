"""Tasks under watch: the first one to die of an unexpected exception is its process's
failure (the coordinator's and each worker agent's).

A task that fails silently leaves a process that still beacons and renews its lease while
nobody reads the stream, ticks or publishes: its peers never time it out and no standby
takes over. So every long-lived task is started here; the first unexpected exception is
recorded, ``failed`` is set and the owner's reaction runs (it ends the process). A task
that is cancelled or returns is no failure, nor is one that raises while its owner stops
the others (``closing``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger(__name__)


class Watch:
    def __init__(self, owner: str, on_failure: Callable[[str, BaseException], None]) -> None:
        self.owner = owner  # who is failing, for the log: "coordinator", "rank 3"
        self.failure: tuple[str, BaseException] | None = None  # (task name, exception)
        self.failed = asyncio.Event()
        self.closing = False  # the owner is stopping its tasks: what they raise is no failure
        self._on_failure = on_failure

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        if not task.cancelled() and (exc := task.exception()) is not None:
            self.fail(task.get_name(), exc)

    def fail(self, name: str, exc: BaseException) -> None:
        """Task ``name`` failed (or something it stands for did, e.g. a publish given up)."""
        if self.failure is not None or self.closing:  # the first failure ends it
            log.warning("%s: %s failed while stopping: %s: %s", self.owner, name,
                        type(exc).__name__, exc)
            return
        self.failure = (name, exc)
        self.failed.set()
        self._on_failure(name, exc)
