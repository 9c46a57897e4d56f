"""NATS plumbing shared by the coordinator, the workers and the tools.

Connecting goes through tenacity (nats-py's first connect to an absent server hangs unless
reconnects are bounded); publishing takes :class:`~ddpbus.codecs.Outbound` as the codec
built it. Only this module and its callers import nats; codecs never does.

- :class:`StreamReader` reads a durable pull consumer continuously (the "consume" pattern):
  it keeps pull requests outstanding so a stored message is delivered at once, re-requests
  when a request expires, notices a silent server through idle heartbeats (nats-py's own
  pull subscription can stall after a server restart), and acks with AckAll once per burst
  (every 64 messages, or after 50 ms of quiet), not once per message. While its consumer
  is missing (503 No Responders) it asks again with back-off (50 ms doubling to 2 s).
- :class:`Publisher` publishes to the job stream in order with acks pipelined, and retries a
  failed publish with the same ``Nats-Msg-Id`` (a duplicate is dropped by the stream).
  Messages submitted with ``acked=False`` (the per-batch reports) go out as plain publishes
  on the same connection, in the same order: the stream still stores them, the sender just
  does not wait for the store's ack (the receiver tolerates a lost one).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, Protocol, TypeVar, cast

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import ObjectMeta, ObjectMetaOptions, ObjectStoreConfig, PubAck, StorageType
from nats.js.client import JetStreamContext
from nats.js.errors import (
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
    TooManyStalledMsgsError,
)
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    retry_if_exception_type,
    retry_if_not_exception_type,
    stop_after_attempt,
    stop_after_delay,
    stop_never,
    wait_exponential,
)

from ddpbus.codecs import Outbound
from ddpbus.codecs import subjects as sj
from ddpbus.codecs.errors import DdpbusError


class Login(Protocol):
    """Who a client is (:class:`~ddpbus.orchestrator.transport.auth.NatsAuth` is the one kind): the
    bus needs only its ``nats.connect`` options, so it does not depend on the auth module."""

    def connect_options(self) -> dict[str, Any]: ...


log = logging.getLogger(__name__)

_NATS_ERRORS = (OSError, TimeoutError, nats.errors.Error)
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = _NATS_ERRORS
"""What a broker restart raises at a client (and a few permanent errors of the same types:
retry them with a deadline)."""


class BusUnavailable(DdpbusError, ConnectionError):
    """The NATS server could not be reached within the connect deadline."""


class PublishFailed(DdpbusError, ConnectionError):
    """A message could not be stored in the job stream despite retries."""


Hook = Callable[[], Awaitable[None]]


def redact(url: str) -> str:
    """A NATS URL fit for a log: ``nats://user:***@host:4222`` (credentials may ride in the
    URL, e.g. from a Secret)."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest.split("/", 1)[0]:
        return url
    creds, _, host = rest.partition("@")
    user = creds.split(":", 1)[0] if ":" in creds else ""
    return f"{scheme}://{user + ':' if user else ''}***@{host}"


class _ErrorLog:
    """One client's nats-py error callback: a refused first login or an untrusted server
    certificate ends the connect at once (retrying cannot help; nats-py itself would retry
    a failed TLS handshake forever), every refused publish or subscription is logged (the
    connection stays up), an outage once."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.outage = 0  # errors since the connection was last good
        self.refused: list[str] = []
        self.fatal = asyncio.Event()
        self.connected = False

    async def on_error(self, exc: Exception) -> None:
        text = str(exc)
        if not self.connected and ("authorization violation" in text.lower()
                                   or isinstance(exc, ssl.SSLError)):
            self.refused.append(f"{type(exc).__name__}: {text}")
            self.fatal.set()
        elif "permissions violation" in text.lower():
            log.error("%s: refused by the NATS server: %s", self.name, text)
        else:
            self.outage += 1
            if self.outage == 1 and not self.connected:
                # the first connect: its failure, if it lasts, is raised as BusUnavailable
                log.debug("%s: NATS not reached yet (%s: %s); retrying", self.name,
                          type(exc).__name__, text)
            elif self.outage == 1:  # one line per outage, not one per attempt
                log.warning("%s: NATS connection trouble (%s: %s); reconnecting", self.name,
                            type(exc).__name__, text)


async def connect(url: str, *, name: str, deadline: timedelta = timedelta(seconds=30),
                  auth: Login | None = None, inbox_prefix: str | None = None,
                  on_disconnect: Hook | None = None, on_reconnect: Hook | None = None
                  ) -> Client:
    """Connect with exponential back-off until ``deadline``; afterwards reconnect forever.

    ``auth`` says who this client is (and how it trusts the server's TLS certificate);
    ``inbox_prefix`` is its identity's reply inbox (``subjects.inbox_prefix``), the only one
    its permissions let it read. A refused login is not retried: it cannot get better.

    The first connect must fail fast to be retried here (nats-py hangs on an absent server
    unless reconnects are bounded); once connected, the client reconnects without limit,
    waiting between attempts by the same tenacity back-off (a broker restart on the same
    store is survived by every client). ``on_disconnect``/``on_reconnect`` run on the
    client's loop when the connection drops and when it is back (subscriptions restored).
    """
    backoff = wait_exponential(multiplier=0.05, max=2.0)
    # reconnects wait at most 1 s: a client back late after a broker restart would look
    # dead to a coordinator that is already back
    reconnect_backoff = wait_exponential(multiplier=0.05, max=1.0)
    errors = _ErrorLog(name)
    nc: Client | None = None

    def next_server(servers: list[Any], _info: dict[str, Any]) -> tuple[Any, float]:
        state = RetryCallState(AsyncRetrying(), None, (), {})
        state.attempt_number = 1 + min((s.reconnects for s in servers), default=0)
        return None, reconnect_backoff(state)

    async def disconnected() -> None:
        # what sat in the client's write buffer when the link broke would be flushed on
        # reconnect *ahead of* earlier writes the dead socket swallowed, reordering the
        # stream; drop it instead: stream-bound messages are re-published in order by their
        # Publisher, acks and pull requests are re-issued, the rest is best-effort anyway
        pending = getattr(nc, "_pending", None)
        if nc is not None and isinstance(pending, list):
            pending.clear()
            nc._pending_data_size = 0
        if on_disconnect is not None:
            await on_disconnect()

    async def reconnected() -> None:
        log.warning("%s: reconnected to NATS after %d failed attempts", name,
                    max(0, errors.outage - 1))
        errors.outage = 0
        if on_reconnect is not None:
            await on_reconnect()

    options = auth.connect_options() if auth is not None else {}
    if inbox_prefix is not None:
        options["inbox_prefix"] = inbox_prefix
    try:
        async for attempt in AsyncRetrying(
            stop=stop_after_delay(deadline.total_seconds()),
            wait=backoff,
            retry=retry_if_exception_type(_NATS_ERRORS)
            & retry_if_not_exception_type(nats.errors.AuthorizationError)
            & retry_if_exception(lambda _: not errors.refused),
            reraise=True,
        ):
            with attempt:
                nc = await _first_connect(errors, nats.connect(
                    url, name=name, **options,
                    connect_timeout=2, max_reconnect_attempts=1, reconnect_time_wait=0.1,
                    # no silent buffering while reconnecting: a publish then fails at once
                    # and its owner retries it in order (see Publisher)
                    allow_reconnect=True, pending_size=0, error_cb=errors.on_error,
                    disconnected_cb=disconnected,
                    reconnected_cb=reconnected, reconnect_to_server_handler=next_server,
                ))
                nc.options["max_reconnect_attempts"] = -1  # connected: never give up again
                errors.connected = True
                return nc
    except _NATS_ERRORS as exc:
        if errors.refused or isinstance(exc, nats.errors.AuthorizationError):
            why = errors.refused[-1] if errors.refused else exc
            raise BusUnavailable(f"NATS at {redact(url)} refused {name}'s login ({why}): "
                                 "check its credentials (--nats-nkey, --nats-user, "
                                 "--nats-creds or the URL) and --nats-tls-ca") from exc
        raise BusUnavailable(f"cannot reach NATS at {redact(url)} within "
                             f"{deadline.total_seconds():g} s ({type(exc).__name__}: {exc}); "
                             "is the server up, and is the URL (--nats, DDPBUS_NATS_URL or "
                             "NATS_URL) right?") from exc
    raise BusUnavailable(f"cannot reach NATS at {redact(url)}")  # pragma: no cover


def connection_id(nc: Client) -> str:
    """``nc``'s connection as the broker names it in its ``$SYS`` advisories: ``<server
    id>/<client id>``, both from the server's INFO (nats-py keeps that INFO only in
    ``_server_info``: it has no public accessor); "" while not connected."""
    info = getattr(nc, "_server_info", None) or {}
    server, cid = info.get("server_id"), nc.client_id
    if not isinstance(server, str) or not server or not isinstance(cid, int):
        return ""
    return f"{server}/{cid}"


async def _first_connect(errors: _ErrorLog, attempt: Awaitable[Client]) -> Client:
    """``attempt``, abandoned as soon as the server refused us for good."""
    task = asyncio.ensure_future(attempt)
    fatal = asyncio.ensure_future(errors.fatal.wait())
    try:
        await asyncio.wait({task, fatal}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        fatal.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, *_NATS_ERRORS):
            await task
        raise nats.errors.AuthorizationError
    return task.result()


T = TypeVar("T")


async def retry_while_away(op: Callable[[], Awaitable[T]], *, deadline: float | None = None
                           ) -> T:
    """Run ``op`` until it succeeds, retrying transient bus errors (no connection, a
    timeout, JetStream not ready after a server restart) with back-off, forever or until
    ``deadline`` seconds. Compare-and-set conflicts are not transient: they are raised."""
    async for attempt in AsyncRetrying(
        stop=stop_never if deadline is None else stop_after_delay(deadline),
        wait=wait_exponential(multiplier=0.05, max=1.0),
        retry=retry_if_exception_type(_NATS_ERRORS)
        & retry_if_not_exception_type(KeyWrongLastSequenceError),
        reraise=True,
    ):
        with attempt:
            return await op()
    raise AssertionError("unreachable: tenacity reraises")  # pragma: no cover


async def publish(js: JetStreamContext, out: Outbound, *, ack_timeout: float = 5.0) -> PubAck:
    """Publish one codec-built message to the job stream and await its ack."""
    ack: PubAck = await js.publish(out.subject, out.payload, timeout=ack_timeout,
                                   headers=out.headers)
    return ack


async def publish_core(nc: Client, out: Outbound) -> None:
    """Publish on a core-NATS (never stored) subject such as live.* or data.*."""
    await nc.publish(out.subject, out.payload, headers=out.headers)


async def read_object(store: ObjectStore, name: str) -> tuple[bytes, str]:
    """An Object Store object's bytes (digest-checked by the client) and its
    ``SHA-256=`` digest; streamed, since ``get()`` without ``writeinto`` is quadratic."""
    sink = io.BytesIO()
    result = await store.get(name, writeinto=sink)
    return sink.getvalue(), str(result.info.digest or "")


async def put_object(store: ObjectStore, name: str, blob: bytes, chunk: int) -> str:
    """Store ``blob`` in chunks of ``chunk`` bytes; returns its ``SHA-256=`` digest."""
    info = await store.put(name, blob, meta=ObjectMeta(
        name=name, options=ObjectMetaOptions(max_chunk_size=chunk)))
    return str(info.digest or "")


def object_chunk(max_payload: int) -> int:
    """Object chunks as large as the server allows (fewer acknowledged publishes), at
    most 4 MiB, leaving room for the protocol around them."""
    return max(64 * 1024, min(4 * 1024 * 1024, max_payload - 8 * 1024))


async def run_is_over(js: JetStreamContext, job: str) -> bool:
    """Whether ``job``'s run summary is stored (``run.summary``: written once, at the end
    of the run, before its consumers are deleted)."""
    try:
        kv = await js.key_value(sj.kv_bucket(job))
        await kv.get(sj.SUMMARY_KEY)
    except (NotFoundError, BucketNotFoundError, KeyNotFoundError):
        return False
    return True


async def next_generation(kv: KeyValue, name: str) -> int:
    """Atomically increment the KV counter ``generation.<name>`` and return the new value:
    every incarnation of a process gets a generation above all earlier ones."""
    key = f"generation.{name}"
    async for attempt in AsyncRetrying(stop=stop_after_attempt(50),
                                       wait=wait_exponential(multiplier=0.001, max=0.05),
                                       retry=retry_if_exception_type(KeyWrongLastSequenceError),
                                       reraise=True):
        with attempt:
            try:
                entry = await kv.get(key)
            except KeyNotFoundError:
                await kv.create(key, b"1")
                return 1
            value = int(entry.value or b"0") + 1
            await kv.update(key, str(value).encode(), last=entry.revision)
            return value
    raise AssertionError("unreachable: tenacity reraises")  # pragma: no cover


Handler = Callable[[Msg], Awaitable[None]]

ACK_EVERY = 64
"""StreamReader acks (AckAll) after this many handled messages ..."""
ACK_DELAY_S = 0.05
"""... or once the stream has been quiet this long: one ack per burst, not per message."""
YIELD_EVERY = 16
"""StreamReader lets other tasks run after this many messages of a burst it is working
through (a handler that never suspends would otherwise hold the loop for the whole burst)."""
AWAY_BACKOFF_S = (0.05, 2.0)
"""While its consumer does not answer a pull request (deleted: 503 No Responders), a
StreamReader asks again after a pause that doubles from the first value up to the second."""


class NotApplied(Exception):
    """Raised to a :class:`StreamReader` by its handler, for a message it did not apply, or
    by its ``entitled`` check: its process lost the right to act (a deposed coordinator).
    The reader then acks nothing more, asks for nothing more, and stops: its successor
    reads the same durable (re-created from the successor's snapshot), and every ack or
    message taken from here would be taken from it."""


class StreamReader:
    """Continuous reader of one durable pull consumer; ``handler`` sees messages in stream
    order, one at a time. Call :meth:`run` as a task; cancel it to stop."""

    def __init__(self, nc: Client, stream: str, durable: str, handler: Handler, *,
                 batch: int = 256, expires: float = 5.0, heartbeat: float = 1.0,
                 entitled: Callable[[], Awaitable[bool]] | None = None) -> None:
        self._nc = nc
        # asked before every pull request: False = not now (asked again shortly); it
        # raises NotApplied when the process may never read again
        self._entitled = entitled
        self._silent = False  # acks nothing more (see silence)
        self._api = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self._handler = handler
        self._batch = batch
        self._expires = expires
        self._heartbeat = heartbeat
        self._pending = 0  # messages requested and not yet delivered or expired
        self.delivered = 0
        self.redelivered = 0  # dropped: already handled (an ack that did not arrive in time)
        self.last_stream_seq = 0
        self.handled_seq = 0  # the newest stream sequence handed to ``handler``
        self.handled_at: float | None = None  # ... and its store time (epoch seconds)
        self._inbox = ""
        self._last: Msg | None = None  # the newest message handled and not acked yet
        self._unacked = 0  # messages handled since the last ack
        self._away_since: float | None = None  # the consumer stopped answering (loop time)
        self._retry_in = 0.0  # pause before the next pull request while it is away

    async def _request(self) -> None:
        body = {"batch": self._batch, "expires": int(self._expires * 1e9),
                "idle_heartbeat": int(self._heartbeat * 1e9)}
        await self._nc.publish(self._api, json.dumps(body).encode(), reply=self._inbox)
        self._pending += self._batch

    async def run(self) -> None:
        # delivered messages land in ``inbox`` from the subscription's callback; this loop
        # takes whatever has arrived in one go (a burst of a thousand ranks' reports costs
        # one wake-up, not a task and a timer per message as ``next_msg`` would)
        inbox: deque[Msg] = deque()
        arrived = asyncio.Event()

        async def deliver(msg: Msg) -> None:
            inbox.append(msg)
            arrived.set()

        self._inbox = self._nc.new_inbox()
        sub = await self._nc.subscribe(self._inbox, cb=deliver, pending_msgs_limit=0,
                                       pending_bytes_limit=0)
        self._last, self._unacked = None, 0
        try:
            while True:
                if self._pending <= self._batch // 2 and not await self._ask():
                    continue
                if not inbox and not await self._wait(arrived):
                    continue
                await self._take(inbox.popleft())
        except NotApplied:
            # what it holds was pulled while it was entitled, from the consumer its
            # successor deletes and re-creates from its own snapshot: left unacked, moot
            # (a NAK would hand it back out of stream order, to be dropped as handled)
            self.silence()
            log.warning("consumer %s: stopped reading (no longer entitled)", self._api)
        finally:
            await self._ack_held()
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    def silence(self) -> None:
        """Ack nothing from now on: this process may no longer act on the stream (a
        deposed coordinator; its successor owns the durable now)."""
        self._silent = True
        self._last, self._unacked = None, 0

    async def _ack_held(self) -> None:
        """One AckAll for everything handled and not acked yet."""
        if self._last is not None and not self._silent:
            await self._ack(self._last)
            self._last, self._unacked = None, 0

    async def _ask(self) -> bool:
        """Request the next batch; False (after a pause) when there is no connection or
        the reader is not entitled to now."""
        if self._entitled is not None and not await self._entitled():
            await asyncio.sleep(0.2)
            return False
        if self._retry_in:  # the consumer is away: do not hammer the server
            await asyncio.sleep(self._retry_in)
        try:
            await self._request()
        except _NATS_ERRORS:  # no connection right now: try again shortly
            self._pending = 0
            await asyncio.sleep(0.2)
            return False
        return True

    async def _wait(self, arrived: asyncio.Event) -> bool:
        """Until a message arrives (True), or a quiet moment passes (False)."""
        arrived.clear()
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the inner result
            # when the task is cancelled just as the wait ends (gh-86296), and a delivery
            # arriving as the agent cancelled the reader at exit (a 503 once its durable was
            # deleted) kept the reader, and so the rank, alive until its launcher's SIGTERM
            async with asyncio.timeout(ACK_DELAY_S if self._last is not None
                                       else 3 * self._heartbeat):
                await arrived.wait()
        except TimeoutError:
            if self._last is None:
                self._pending = 0  # the server lost our requests (restart?)
            await self._ack_held()  # quiet for a moment: one AckAll covers the lot
            return False
        return True

    async def _take(self, msg: Msg) -> None:
        status = msg.headers.get("Status") if msg.headers else None
        if status:
            self._on_status(status, msg)
            return
        self._back()
        self._pending -= 1
        self.delivered += 1
        where = sj.delivery(msg.reply)  # (nats-py's msg.metadata: ~10 us a message)
        if where is not None and where.stream_seq <= self.handled_seq:
            self.redelivered += 1  # at-least-once below, exactly-once above
        else:
            if where is None:
                self.handled_at = None
            else:
                self.handled_seq, self.handled_at = where
            await self._handler(msg)
        self._last, self._unacked = msg, self._unacked + 1
        if self._unacked >= ACK_EVERY:
            await self._ack_held()
        elif self._unacked % YIELD_EVERY == 0:
            await asyncio.sleep(0)  # the handler's follow-ups (a commit) get a turn

    async def reconnected(self) -> None:
        """The connection is back (a broker restart loses outstanding pull requests): ask
        again now rather than after the next silent interval."""
        self._pending = 0
        if self._inbox:
            with contextlib.suppress(*_NATS_ERRORS, NotApplied):
                if self._entitled is None or await self._entitled():
                    await self._request()

    def _on_status(self, status: str, msg: Msg) -> None:
        if status == "100":
            self._back()
            return  # idle heartbeat: the server is alive and our request stands
        left = (msg.headers or {}).get("Nats-Pending-Messages")
        if status in ("408", "409") and left is not None and left.isdigit():
            self._back()
            self._pending = max(0, self._pending - int(left))
        elif status in ("404", "408", "409"):
            self._back()
            self._pending = 0
        else:  # 503 No Responders: no such consumer (deleted, or not re-created yet)
            self._pending = 0
            low, high = AWAY_BACKOFF_S
            self._retry_in = min(high, max(low, 2 * self._retry_in))
            if self._away_since is None:  # once per outage, not once per request
                self._away_since = asyncio.get_running_loop().time()
                # (nats-py puts the next header line into a bare 503's Description)
                why = ("no responders: the consumer is missing" if status == "503" else
                       str((msg.headers or {}).get("Description", "")).strip())
                log.warning("consumer %s: status %s (%s); asking again with back-off, up to "
                            "every %.0fs, until it answers", self._api, status, why, high)

    def _back(self) -> None:
        """The consumer answered: end an outage, if there was one."""
        if self._away_since is not None:
            log.warning("consumer %s: answering again after %.1fs", self._api,
                        asyncio.get_running_loop().time() - self._away_since)
            self._away_since = None
        self._retry_in = 0.0

    async def _ack(self, msg: Msg) -> None:
        try:
            where = sj.delivery(msg.reply)
            self.last_stream_seq = where.stream_seq if where else self.last_stream_seq
            await msg.ack()
        except (nats.errors.Error, ValueError) as exc:
            log.warning("could not ack stream sequence %s: %s", self.last_stream_seq, exc)


class Publisher:
    """Ordered, pipelined publishing to the job stream.

    :meth:`submit` queues a message (never blocks); the :meth:`run` task publishes them in
    submission order with up to ``window`` acks outstanding and checks every ack; a failed
    publish is retried with back-off (same ``Nats-Msg-Id``). :meth:`flush` waits until
    everything submitted so far is stored.

    A message still not stored after ``retry_deadline`` seconds of connected retries is given
    up: :attr:`failed` says so, ``on_failed`` is called with it at once (it must not block),
    and :meth:`failure` returns it to whoever awaits it.

    The context's ``publish_async`` is this Publisher's alone: each call takes one of
    nats-py's pending slots (``publish_async_max_pending``), given back only when its future
    is done, so every future whose ack will not come (re-published, or its publish failed)
    is cancelled here.
    """

    def __init__(self, js: JetStreamContext, *, window: int = 512, ack_timeout: float = 5.0,
                 retry_deadline: float = 60.0,
                 on_failed: Callable[[PublishFailed], None] | None = None) -> None:
        self._js = js
        self._nc: Client = js._nc  # the context's own connection
        self._queue: asyncio.Queue[tuple[Outbound, bool]] = asyncio.Queue()
        self._inflight: deque[tuple[Outbound, asyncio.Future[PubAck], float]] = deque()
        self._resend_before = float("-inf")  # re-publish what was sent before this (loop time)
        self._wake = asyncio.Event()
        self._open = asyncio.Event()  # new publishes may go out
        self._open.set()
        self._sending = asyncio.Lock()  # held from a publish to its entry in _inflight
        self._window = asyncio.Semaphore(window)
        self._ack_timeout = ack_timeout
        self._retry_deadline = retry_deadline
        self._idle = asyncio.Event()
        self._idle.set()
        self._acked = asyncio.Event()
        self._outstanding = 0  # submitted and not yet stored (or given up)
        self._unstored: deque[Outbound] = deque()  # acked submissions not yet stored, in order
        self.published = 0
        self.failed: PublishFailed | None = None  # the first message given up
        self._on_failed = on_failed
        self._failed = asyncio.Event()

    def submit(self, out: Outbound, *, acked: bool = True) -> None:
        self._outstanding += 1
        self._idle.clear()
        if acked:
            self._unstored.append(out)
        self._queue.put_nowait((out, acked))

    def unstored(self) -> list[Outbound]:
        """Stream-bound messages submitted and not yet stored, in submission order."""
        return list(self._unstored)

    async def run(self) -> None:
        checker = asyncio.create_task(self._check_acks(), name="publisher-acks")
        loop = asyncio.get_running_loop()
        try:
            while True:
                out, acked = await self._queue.get()
                if not acked:
                    with contextlib.suppress(*_NATS_ERRORS):
                        await self._nc.publish(out.subject, out.payload, headers=out.headers)
                    self._done()
                    continue
                await self._window.acquire()
                while True:
                    await self._open.wait()  # closed: link down, or a backlog being resent
                    async with self._sending:
                        if self._open.is_set():
                            await self._send(out, loop)
                            break
                self._acked.set()
        finally:
            checker.cancel()
            with contextlib.suppress(asyncio.CancelledError, PublishFailed):
                await checker
            for _, fut, _ in self._inflight:
                fut.cancel()  # no one waits for these acks: their slots go back

    async def _send(self, out: Outbound, loop: asyncio.AbstractEventLoop) -> None:
        try:
            # all slots taken (it should not happen): resent later by the checker rather
            # than wait here for good, holding _sending, which the resend needs
            fut = await self._js.publish_async(out.subject, out.payload, headers=out.headers,
                                               wait_stall=self._ack_timeout)
        except _NATS_ERRORS as exc:  # e.g. no connection now: resent in order by the checker
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # nats-py reports a cancelled wait for a slot as TooManyStalledMsgsError
                raise asyncio.CancelledError from exc
            if not isinstance(exc, TooManyStalledMsgsError):
                self._drop_orphan()
            fut = loop.create_future()
            fut.set_exception(ConnectionError(f"publish_async failed: {exc!r}"))
        self._inflight.append((out, fut, loop.time()))

    def _drop_orphan(self) -> None:
        """A publish_async that failed after taking its slot (the publish itself raised: no
        connection) left its future registered, and no ack will ever complete it: cancel
        it, which gives its slot back. Nothing ran between its registration and the raise,
        so it is the context's newest future, and none of ours."""
        futures: dict[str, asyncio.Future[PubAck]] = getattr(
            self._js, "_publish_async_futures", {})
        newest = next(reversed(futures.values()), None)
        if newest is None or newest.done() or any(newest is f for _, f, _ in self._inflight):
            return
        newest.cancel()

    def disconnected(self) -> None:
        """The link broke: nothing new goes out until what was in flight is resent."""
        self._open.clear()

    def reconnected(self) -> None:
        """The connection is back: whatever was sent before and not acked may have died
        with the old link, so it is re-published (in order) now instead of after its ack
        timeout; JetStream drops the copies it had already stored."""
        self._resend_before = asyncio.get_running_loop().time()
        if not self._inflight:
            self._open.set()
        self._wake.set()

    async def _await_ack(self, fut: asyncio.Future[PubAck], sent: float) -> bool:
        """True when ``fut`` acked in time; False when it must be re-published."""
        loop = asyncio.get_running_loop()
        while not fut.done():
            left = sent + self._ack_timeout - loop.time()
            if left <= 0 or sent < self._resend_before:
                return False
            self._wake.clear()
            waker: asyncio.Future[Any] = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait([cast("asyncio.Future[Any]", fut), waker], timeout=left,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                waker.cancel()
        return not fut.cancelled() and fut.exception() is None

    async def _check_acks(self) -> None:
        while True:
            while not self._inflight:
                self._acked.clear()
                await self._acked.wait()
            out, fut, sent = self._inflight[0]
            if not await self._await_ack(fut, sent):
                await self._resend()
            if self._nc.is_connected:
                self._open.set()
            self._inflight.popleft()
            if self._unstored and self._unstored[0] is out:
                self._unstored.popleft()
            self._window.release()
            self._done()

    async def _resend(self) -> None:
        """Re-publish every message in flight that has no ack, in submission order, before
        anything new goes out. A server processes one connection's messages in order, so
        those already stored are a prefix of what was in flight: JetStream drops their
        copies (same ``Nats-Msg-Id``) and the rest land after them, in order."""
        loop = asyncio.get_running_loop()
        self._open.clear()
        async with self._sending:  # a publish under way joins the backlog first
            pass
        log.info("re-publishing up to %d unacknowledged messages in order",
                 len(self._inflight))
        for i in range(len(self._inflight)):  # nothing is appended while closed
            out, fut, sent = self._inflight[i]
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                continue
            fut.cancel()  # superseded: its ack will not be waited for, its slot goes back
            await self._retry(out)
            stored: asyncio.Future[PubAck] = loop.create_future()
            stored.set_result(PubAck(stream="", seq=0))
            self._inflight[i] = (out, stored, sent)

    def _done(self) -> None:
        self.published += 1
        self._outstanding -= 1
        if self._outstanding == 0:
            self._idle.set()

    def _connected_time_spent(self) -> Callable[[RetryCallState], bool]:
        """A tenacity stop: the retry deadline counts only time with a live connection, so a
        broker that is away for minutes (a restart) does not make messages be given up."""
        spent = {"s": 0.0, "at": time.monotonic()}

        def stop(_state: RetryCallState) -> bool:
            now = time.monotonic()
            if self._nc.is_connected:
                spent["s"] += now - spent["at"]
            spent["at"] = now
            return spent["s"] > self._retry_deadline
        return stop

    async def _retry(self, out: Outbound) -> None:
        try:
            async for attempt in AsyncRetrying(
                stop=self._connected_time_spent(),
                wait=wait_exponential(multiplier=0.05, max=2.0),
                before_sleep=lambda st: log.debug("re-publishing %s: attempt %d failed (%r)",
                                                  out.headers.get("Nats-Msg-Id"),
                                                  st.attempt_number,
                                                  st.outcome.exception() if st.outcome
                                                  else None),
                retry=retry_if_exception_type((*_NATS_ERRORS, ConnectionError)),
                reraise=True,
            ):
                with attempt:
                    await publish(self._js, out, ack_timeout=self._ack_timeout)
        except (*_NATS_ERRORS, ConnectionError) as exc:
            failed = PublishFailed(f"{out.headers.get('Ddpbus-Type')} on {out.subject} "
                                   f"not stored after {self._retry_deadline:.0f}s: {exc}")
            log.error("%s", failed)  # noqa: TRY400 - said once, then the owner fails
            if self.failed is None:
                self.failed = failed
                self._failed.set()
            if self._on_failed is not None:
                try:
                    self._on_failed(failed)
                except Exception:
                    log.exception("the publisher's on_failed callback raised")
            # nothing after a message given up may be stored (it would land out of order):
            # the ack checker ends here, so no retry loop outlives the owner's shutdown
            raise failed from exc

    async def failure(self) -> PublishFailed:
        """Wait until a message is given up (not stored after the retry deadline) and
        return the first one's error: an owner awaits this to fail at once rather than
        at its next :meth:`flush`."""
        await self._failed.wait()
        if self.failed is None:  # pragma: no cover - set together
            raise AssertionError("failure event set without a failure")
        return self.failed

    async def flush(self, within: float = 10.0) -> bool:
        """True when everything submitted so far was stored within ``within`` seconds."""
        try:
            await asyncio.wait_for(self._idle.wait(), within)
        except TimeoutError:
            return False
        return self.failed is None


async def rounds_store(js: JetStreamContext, job: str) -> ObjectStore:
    """The job's round bucket, created on first use by whichever process comes first."""
    name = sj.rounds_bucket(job)
    try:
        return await js.object_store(name)
    except (BucketNotFoundError, NotFoundError):
        return await js.create_object_store(name, config=ObjectStoreConfig(
            storage=StorageType.MEMORY, description=f"ddpbus averaging rounds of job {job}"))
