"""The ranks' broker connections, from the broker itself: a killed rank is dead at once.

A SIGKILLed worker stops heartbeating, but the heartbeat timeout (30 s by default) is the
soonest silence can prove a death. Its TCP connection to the broker closes at the kill,
though, and nats-server says so to its system account: a ``$SYS.ACCOUNT.<acct>.DISCONNECT``
advisory naming the connection (server id and client id), its name and the reason. With a
system-account login (``--nats-system-nkey`` or ``--nats-system-creds``) the coordinator
reads those advisories and the CONNECT ones, and hands the core what concerns its ranks:

- ``Disconnected(connection, reason)`` for a connection an alive rank's heartbeats named as
  its own; the core declares that rank dead once ``disconnect_grace`` passes without it
  reconnecting (``membership.check_unplugged``);
- ``Reconnected(rank)`` for a connection opened under a rank's connection name: a network
  blip or a connection the broker dropped, after which nats-py reconnects within ~0.1 s.

Both are core events, journaled like every input, so a replay decides the same. Nothing
here can kill a rank on a say-so it cannot check: a disconnect counts only for the exact
connection a rank's signed heartbeats named, and a name (which any client may give
itself) can only keep a rank alive until its heartbeats judge it. Heartbeat timeouts stay
for what closes no connection: a stopped (SIGSTOP) or hung process, a lost network.

Without a system login, or when its advisories stop (the broker restarting), heartbeats
alone judge, as before. A login that is not the system account's is refused at start: its
subscriptions would be silently empty.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Collection
from typing import Any, Final

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from ddpbus.codecs import subjects as sj
from ddpbus.codecs.convert import CONNECTION
from ddpbus.codecs.errors import ConfigError
from ddpbus.orchestrator.core.state import Disconnected, Event, Reconnected
from ddpbus.orchestrator.transport.auth import Access

log = logging.getLogger(__name__)

MAX_ADVISORY: Final = 64 * 1024  # an advisory is ~1 KiB of JSON; more is not one
PING: Final = "$SYS.REQ.SERVER.PING"  # answered only to the system account


class Presence:
    """Reads the broker's client advisories for one job and applies what concerns it.

    ``watched()``: the connections alive ranks named in their heartbeats; ``unplugged()``:
    the ranks whose connection closed and who have not reconnected yet (both read from the
    coordinator's state when an advisory comes)."""

    def __init__(self, job: str, apply: Callable[[Event], Awaitable[bool]], *,
                 watched: Callable[[], Collection[str]],
                 unplugged: Callable[[], Collection[int]]) -> None:
        self.job = job
        self.apply = apply
        self.watched = watched
        self.unplugged = unplugged
        self.malformed = 0  # advisories that did not read (counted, warned about once)
        self.disconnects = 0  # of this job's ranks' connections, as applied
        self.reconnects = 0

    async def run(self, access: Access) -> None:
        nc = await access.connect(self.job, name=f"ddpbus-{self.job}-coordinator-system")
        try:
            await self.check_system(nc)
            # one subscription: its messages are handled one at a time in the order the
            # server sent them, so a reconnect is never read before the disconnect it ends
            await nc.subscribe(sj.CLIENT_ADVISORIES, cb=self._on_advisory)
            await nc.flush()
            log.info("reading the broker's client advisories: a rank whose connection "
                     "closes is dead once its disconnect grace passes")
            await asyncio.Event().wait()  # until cancelled with the coordinator's tasks
        finally:
            await nc.close()

    @staticmethod
    async def check_system(nc: Client) -> None:
        """Refuse a login outside the system account: its ``$SYS`` subscriptions would be
        accepted and never deliver anything."""
        try:
            await nc.request(PING, b"", timeout=5.0)
        except (NoRespondersError, NatsTimeout):
            raise ConfigError("the --nats-system-* login is not in the broker's system "
                              "account (no server answered $SYS.REQ.SERVER.PING): fast "
                              "death detection needs a system-account user") from None

    def _read(self, msg: Msg) -> tuple[str, str, str] | None:
        """(connection, client name, reason) of an advisory, None for one that does not
        read as nats-server's ``io.nats.server.advisory.v1.client_*`` document."""
        found = _fields(msg.data)
        if isinstance(found, str):
            self.malformed += 1
            if self.malformed == 1:
                log.warning("an advisory on %s did not read (%s); further ones are counted "
                            "only", msg.subject, found)
            return None
        return found

    async def _on_advisory(self, msg: Msg) -> None:
        tokens = msg.subject.split(".")  # $SYS.ACCOUNT.<account>.<event>
        kind = tokens[3] if len(tokens) == 4 else ""
        if kind == "DISCONNECT":
            await self._on_disconnect(msg)
        elif kind == "CONNECT":
            await self._on_connect(msg)
        # (the account's other events, such as its connection counts, are not ours)

    async def _on_disconnect(self, msg: Msg) -> None:
        read = self._read(msg)
        if read is None:
            return
        connection, name, reason = read
        if sj.connection_rank(self.job, name) is None or connection not in self.watched():
            return  # another job's, an observer's, a rendezvous store's, an old incarnation's
        log.warning("the broker closed %s's connection %s (%s)", name, connection, reason)
        self.disconnects += 1
        await self.apply(Disconnected(connection=connection, reason=reason))

    async def _on_connect(self, msg: Msg) -> None:
        read = self._read(msg)
        if read is None:
            return
        _connection, name, _reason = read
        rank = sj.connection_rank(self.job, name)
        if rank is None or rank not in self.unplugged():
            return
        log.info("rank %d connected again", rank)
        self.reconnects += 1
        await self.apply(Reconnected(rank=rank))


def _fields(data: bytes) -> tuple[str, str, str] | str:
    """(connection, client name, reason) of an advisory's JSON, or why it does not read."""
    if len(data) > MAX_ADVISORY:
        return f"{len(data)} bytes"
    try:
        doc: Any = json.loads(data)
        client, server = doc["client"], doc["server"]
        connection = f"{server['id']}/{client['id']}"
        name, reason = client.get("name", ""), doc.get("reason", "")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    if not (CONNECTION.fullmatch(connection) and isinstance(name, str)
            and isinstance(reason, str)):
        return "fields of the wrong shape"
    return connection, name, reason[:200]
