"""NATS plumbing shared by the coordinator, the workers and the tools.

Connecting goes through tenacity (nats-py's first connect to an absent server hangs unless
reconnects are bounded); publishing takes :class:`~ddpbus.codecs.Outbound` as the codec
built it. Only this module and its callers import nats; codecs never does.

- :class:`StreamReader` reads a durable pull consumer continuously (the "consume" pattern):
  it keeps pull requests outstanding so a stored message is delivered at once, re-requests
  when a request expires, notices a silent server through idle heartbeats (nats-py's own
  pull subscription can stall after a server restart), and acks with AckAll once per burst
  (every 64 messages, or after 50 ms of quiet), not once per message.
- :class:`Publisher` publishes to the job stream in order with acks pipelined, and retries a
  failed publish with the same ``Nats-Msg-Id`` (a duplicate is dropped by the stream).
  Messages submitted with ``acked=False`` (the per-batch reports) go out as plain publishes
  on the same connection, in the same order: the stream still stores them, the sender just
  does not wait for the store's ack (the receiver tolerates a lost one).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from datetime import timedelta

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import PubAck
from nats.js.client import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
)

from ddpbus.codecs import Outbound
from ddpbus.codecs.errors import DdpbusError

log = logging.getLogger(__name__)

_NATS_ERRORS = (OSError, TimeoutError, nats.errors.Error)


class BusUnavailable(DdpbusError, ConnectionError):
    """The NATS server could not be reached within the connect deadline."""


class PublishFailed(DdpbusError, ConnectionError):
    """A message could not be stored in the job stream despite retries."""


async def connect(url: str, *, name: str, deadline: timedelta = timedelta(seconds=30),
                  user_credentials: str | None = None) -> Client:
    """Connect with exponential back-off until ``deadline``; afterwards reconnect forever."""
    try:
        async for attempt in AsyncRetrying(
            stop=stop_after_delay(deadline.total_seconds()),
            wait=wait_exponential(multiplier=0.05, max=2.0),
            retry=retry_if_exception_type(_NATS_ERRORS),
            reraise=True,
        ):
            with attempt:
                return await nats.connect(
                    url, name=name, user_credentials=user_credentials,
                    connect_timeout=2, max_reconnect_attempts=1, reconnect_time_wait=0.1,
                    allow_reconnect=True,
                )
    except _NATS_ERRORS as exc:
        raise BusUnavailable(f"cannot reach NATS at {url} within {deadline}: {exc}") from exc
    raise BusUnavailable(f"cannot reach NATS at {url}")  # pragma: no cover - tenacity reraises


async def publish(js: JetStreamContext, out: Outbound, *, ack_timeout: float = 5.0) -> PubAck:
    """Publish one codec-built message to the job stream and await its ack."""
    ack: PubAck = await js.publish(out.subject, out.payload, timeout=ack_timeout,
                                   headers=out.headers)
    return ack


async def publish_core(nc: Client, out: Outbound) -> None:
    """Publish on a core-NATS (never stored) subject such as live.* or data.*."""
    await nc.publish(out.subject, out.payload, headers=out.headers)


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


class StreamReader:
    """Continuous reader of one durable pull consumer; ``handler`` sees messages in stream
    order, one at a time. Call :meth:`run` as a task; cancel it to stop."""

    def __init__(self, nc: Client, stream: str, durable: str, handler: Handler, *,
                 batch: int = 256, expires: float = 5.0, heartbeat: float = 1.0) -> None:
        self._nc = nc
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

    async def _request(self) -> None:
        body = {"batch": self._batch, "expires": int(self._expires * 1e9),
                "idle_heartbeat": int(self._heartbeat * 1e9)}
        await self._nc.publish(self._api, json.dumps(body).encode(), reply=self._inbox)
        self._pending += self._batch

    async def run(self) -> None:
        self._inbox = self._nc.new_inbox()
        sub = await self._nc.subscribe(self._inbox, pending_msgs_limit=0,
                                       pending_bytes_limit=0)
        last: Msg | None = None
        unacked = 0
        try:
            while True:
                if self._pending <= self._batch // 2:
                    await self._request()
                try:
                    msg = await sub.next_msg(timeout=ACK_DELAY_S if last is not None
                                             else 3 * self._heartbeat)
                except nats.errors.TimeoutError:
                    if last is not None:  # quiet for a moment: one AckAll covers the lot
                        await self._ack(last)
                        last, unacked = None, 0
                    else:
                        self._pending = 0  # the server lost our requests (restart?)
                    continue
                status = msg.headers.get("Status") if msg.headers else None
                if status:
                    self._on_status(status, msg)
                    continue
                self._pending -= 1
                self.delivered += 1
                seq = _stream_seq(msg)
                if seq is not None and seq <= self.handled_seq:
                    self.redelivered += 1  # at-least-once below, exactly-once above
                else:
                    self.handled_seq = seq or self.handled_seq
                    await self._handler(msg)
                last, unacked = msg, unacked + 1
                if unacked >= ACK_EVERY:
                    await self._ack(last)
                    last, unacked = None, 0
        finally:
            if last is not None:
                await self._ack(last)
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    def _on_status(self, status: str, msg: Msg) -> None:
        if status == "100":
            return  # idle heartbeat: the server is alive and our request stands
        left = (msg.headers or {}).get("Nats-Pending-Messages")
        if status in ("408", "409") and left is not None and left.isdigit():
            self._pending = max(0, self._pending - int(left))
        elif status in ("404", "408", "409"):
            self._pending = 0
        else:
            log.warning("consumer %s: unexpected status %s %s", self._api, status,
                        (msg.headers or {}).get("Description", ""))
            self._pending = 0

    async def _ack(self, msg: Msg) -> None:
        try:
            self.last_stream_seq = msg.metadata.sequence.stream
            await msg.ack()
        except (nats.errors.Error, ValueError) as exc:
            log.warning("could not ack stream sequence %s: %s", self.last_stream_seq, exc)


def _stream_seq(msg: Msg) -> int | None:
    try:
        return int(msg.metadata.sequence.stream)
    except (ValueError, AttributeError, nats.errors.Error):
        return None


class Publisher:
    """Ordered, pipelined publishing to the job stream.

    :meth:`submit` queues a message (never blocks); the :meth:`run` task publishes them in
    submission order with up to ``window`` acks outstanding and checks every ack; a failed
    publish is retried with back-off (same ``Nats-Msg-Id``). :meth:`flush` waits until
    everything submitted so far is stored.
    """

    def __init__(self, js: JetStreamContext, *, window: int = 512, ack_timeout: float = 5.0,
                 retry_deadline: float = 60.0) -> None:
        self._js = js
        self._nc: Client = js._nc  # the context's own connection
        self._queue: asyncio.Queue[tuple[Outbound, bool]] = asyncio.Queue()
        self._inflight: deque[tuple[Outbound, asyncio.Future[PubAck]]] = deque()
        self._window = asyncio.Semaphore(window)
        self._ack_timeout = ack_timeout
        self._retry_deadline = retry_deadline
        self._idle = asyncio.Event()
        self._idle.set()
        self._acked = asyncio.Event()
        self._outstanding = 0  # submitted and not yet stored (or given up)
        self._unstored: deque[Outbound] = deque()  # acked submissions not yet stored, in order
        self.published = 0
        self.failed: PublishFailed | None = None

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
        try:
            while True:
                out, acked = await self._queue.get()
                if not acked:
                    with contextlib.suppress(*_NATS_ERRORS):
                        await self._nc.publish(out.subject, out.payload, headers=out.headers)
                    self._done()
                    continue
                await self._window.acquire()
                try:
                    fut = await self._js.publish_async(out.subject, out.payload,
                                                       headers=out.headers)
                except _NATS_ERRORS:
                    fut = asyncio.get_running_loop().create_future()
                    fut.set_exception(ConnectionError("publish_async failed"))
                self._inflight.append((out, fut))
                self._acked.set()
        finally:
            checker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await checker

    async def _check_acks(self) -> None:
        while True:
            while not self._inflight:
                self._acked.clear()
                await self._acked.wait()
            out, fut = self._inflight[0]
            try:
                await asyncio.wait_for(asyncio.shield(fut), self._ack_timeout)
            except (*_NATS_ERRORS, ConnectionError):
                await self._retry(out)
            self._inflight.popleft()
            if self._unstored and self._unstored[0] is out:
                self._unstored.popleft()
            self._window.release()
            self._done()

    def _done(self) -> None:
        self.published += 1
        self._outstanding -= 1
        if self._outstanding == 0:
            self._idle.set()

    async def _retry(self, out: Outbound) -> None:
        try:
            async for attempt in AsyncRetrying(
                stop=stop_after_delay(self._retry_deadline),
                wait=wait_exponential(multiplier=0.05, max=2.0),
                retry=retry_if_exception_type((*_NATS_ERRORS, ConnectionError)),
                reraise=True,
            ):
                with attempt:
                    await publish(self._js, out, ack_timeout=self._ack_timeout)
        except (*_NATS_ERRORS, ConnectionError) as exc:
            self.failed = PublishFailed(f"{out.headers.get('Ddpbus-Type')} on {out.subject} "
                                        f"not stored after {self._retry_deadline:.0f}s: {exc}")
            log.error("%s", self.failed)  # noqa: TRY400 - said once, then the owner fails

    async def flush(self, within: float = 10.0) -> bool:
        """True when everything submitted so far was stored within ``within`` seconds."""
        try:
            await asyncio.wait_for(self._idle.wait(), within)
        except TimeoutError:
            return False
        return self.failed is None
