"""The shell the coordinator and every worker agent share around their one NATS connection.

Each process holds one connection, a :class:`~ddpbus.orchestrator.transport.bus.Publisher`
for its durable sends and a :class:`~ddpbus.orchestrator.transport.bus.StreamReader` for
what the stream holds for it, and runs its long-lived tasks under a
:class:`~ddpbus.orchestrator.runtime.tasks.Watch`. What happens when the connection drops
and comes back, how a liveness beacon is sent, and how the tasks are started and stopped
is the same for both, so it lives here once. What each owner does about it stays with it
(the coordinator judges no liveness while away and applies ``BusRestored``; a rank restarts
its coordinator deadline and beacons at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from nats.aio.client import Client

from ddpbus.codecs import Outbound
from ddpbus.orchestrator.runtime.tasks import Watch
from ddpbus.orchestrator.transport import bus

log = logging.getLogger(__name__)


class Endpoint:
    def __init__(self, owner: str, on_failure: Callable[[str, BaseException], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.watch = Watch(owner, on_failure)
        self.clock = clock
        self.publisher: bus.Publisher | None = None
        self.reader: bus.StreamReader | None = None
        self.down_since: float | None = None  # clock() when the connection dropped
        self.tasks: set[asyncio.Task[Any]] = set()  # started here and not yet done

    @property
    def down(self) -> bool:
        """The connection is lost: nobody can be heard, so silence proves nothing."""
        return self.down_since is not None

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """A task under watch: one that dies of an unexpected exception is the owner's
        failure (``watch.failed``). Kept in ``tasks`` until it ends."""
        task = self.watch.spawn(coro, name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def stop(self, grace: float | None = None) -> None:
        """Cancel every task still running and wait for them (at most ``grace`` s);
        what they raise meanwhile is no failure."""
        self.watch.closing = True
        tasks = list(self.tasks)
        for t in tasks:
            t.cancel()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace):
                await asyncio.gather(*tasks, return_exceptions=True)
        for t in tasks:
            if not t.done():  # it swallowed its cancellation: say where, and leave it
                where = "".join(f"\n  {f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}"
                                for f in t.get_stack())
                log.warning("task %s did not stop within %ss of its cancellation; leaving it"
                            "%s", t.get_name(), grace, where)

    def lost(self) -> bool:
        """The client's disconnect callback: the publisher holds its sends until the
        connection is back. True for the first call of an outage (the owner logs it once)."""
        if self.publisher is not None:
            self.publisher.disconnected()
        if self.down_since is not None:
            return False
        self.down_since = self.clock()
        return True

    async def back(self) -> float:
        """The client's reconnect callback: the publisher resends what it held, the reader
        re-attaches to its consumer. Returns how long the connection was away (s)."""
        since, self.down_since = self.down_since, None
        if self.publisher is not None:
            self.publisher.reconnected()
        if self.reader is not None:
            await self.reader.reconnected()
        return self.clock() - since if since is not None else 0.0

    @staticmethod
    async def announce(nc: Client, out: Outbound) -> None:
        """One liveness message on core NATS: fire and forget (a beacon lost while the
        connection is away is replaced by the next one)."""
        with contextlib.suppress(Exception):
            await bus.publish_core(nc, out)

    async def beacon(self, nc: Client, message: Callable[[], Outbound], every: float) -> None:
        """A liveness beacon: ``message()`` (encoded afresh each time, so it carries current
        state) every ``every`` seconds, until cancelled."""
        while True:
            await self.announce(nc, message())
            await asyncio.sleep(every)
