"""torch.distributed rendezvous through the job's NATS KV bucket (no extra port).

:class:`NatsKVStore` is a ``torch.distributed.Store``: ``init_process_group(store=...)``
exchanges addresses (and NCCL's unique id) through KV keys instead of a TCPStore. Each
communicator session uses its own key prefix (``PrefixStore``), so a rebuilt group after a
shrink never reads the keys of the old one.

:class:`Interruptible` wraps any store for one session's forming: a member declared dead
while the group forms (its address never comes) ends every wait for its keys at once,
instead of at the store's timeout.

torch calls the store synchronously from its own threads; the store therefore runs its own
NATS connection on a private event-loop thread and never touches the agent's loop, which
keeps handling control messages while a collective blocks.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from datetime import timedelta
from typing import Any, Final, TypeVar

from nats.js.errors import (
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NoKeysError,
)
from nats.js.kv import KeyValue
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential
from torch._C._distributed_c10d import Store  # = torch.distributed.Store, typed

from ddpbus.codecs import subjects as sj
from ddpbus.codecs.errors import DdpbusError
from ddpbus.orchestrator.transport.auth import Access, access
from ddpbus.orchestrator.transport.bus import TRANSIENT_ERRORS

log = logging.getLogger(__name__)

T = TypeVar("T")
_TRANSIENT = TRANSIENT_ERRORS  # a broker restart: set/get/check/wait are retried through it

"""KV keys of the rendezvous: ``td.<base64url(torch key)>`` (torch keys may hold any text)."""


# how long a rendezvous wait for a member's key lasts (the agent's NATS store, and a
# forming session's waits over any store: Interruptible)
STORE_TIMEOUT: Final = timedelta(seconds=300)


class StoreTimeout(DdpbusError, TimeoutError):
    """A rendezvous key did not appear within the store's timeout."""


class StoreInterrupted(DdpbusError):
    """A wait ended by :meth:`Interruptible.interrupt`: a member of the forming session was
    declared dead."""


class _Absent(Exception):
    """Internal: the key is not (or no longer) in the bucket."""


def kv_key(key: str) -> str:
    return sj.RENDEZVOUS_PREFIX + base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")


class NatsKVStore(Store):
    """A ``torch.distributed.Store`` backed by a NATS JetStream KV bucket."""

    def __init__(self, nats: str | Access, job: str, *,
                 timeout: timedelta = STORE_TIMEOUT, name: str = "ddpbus-store"
                 ) -> None:
        super().__init__()
        self._op_timeout = timeout  # Store.timeout has no setter; keep our own
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self._kv: KeyValue | None = None
        self._nc: Any = None
        self._call(self._open(access(nats), job, name))

    async def _open(self, nats: Access, job: str, name: str) -> None:
        self._nc = await nats.connect(job, name=name)
        self._kv = await self._nc.jetstream().key_value(sj.kv_bucket(job))

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        wait = (timeout if timeout is not None else self._op_timeout.total_seconds()) + 5.0
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(wait)

    @property
    def kv(self) -> KeyValue:
        if self._kv is None:
            raise DdpbusError("rendezvous store is closed")
        return self._kv

    async def _get(self, key: str) -> tuple[bytes, int]:
        try:
            entry = await self.kv.get(kv_key(key))
        except (KeyNotFoundError, KeyDeletedError):
            raise _Absent(key) from None
        return entry.value or b"", entry.revision or 0

    async def _retry(self, op: Callable[[], Awaitable[T]], limit_s: float,
                     retry_on: tuple[type[BaseException], ...]) -> T:
        async for attempt in AsyncRetrying(stop=stop_after_delay(limit_s),
                                           wait=wait_exponential(multiplier=0.002, max=0.05),
                                           retry=retry_if_exception_type(retry_on),
                                           reraise=True):
            with attempt:
                return await op()
        raise AssertionError("unreachable: tenacity reraises")  # pragma: no cover

    # ---------------------------------------------------------------- Store API

    def _transient(self, op: Callable[[], Awaitable[T]]) -> T:
        """``op`` retried through a broker restart (within the store's timeout)."""
        return self._call(self._retry(op, self._op_timeout.total_seconds(), _TRANSIENT))

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._transient(lambda: self.kv.put(kv_key(key), data))

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self._transient(lambda: self._get(key))[0]

    def add(self, key: str, amount: int) -> int:
        async def once() -> int:
            try:
                current, revision = await self._get(key)
            except _Absent:
                await self.kv.create(kv_key(key), str(amount).encode())
                return amount
            value = int(current or b"0") + amount
            await self.kv.update(kv_key(key), str(value).encode(), last=revision)
            return value

        return self._call(self._retry(once, self._op_timeout.total_seconds(),
                                      (KeyWrongLastSequenceError,)))

    def compare_set(self, key: str, expected_value: bytes | str,
                    desired_value: bytes | str) -> bytes:
        expected = expected_value.encode() if isinstance(expected_value, str) else bytes(
            expected_value)
        desired = desired_value.encode() if isinstance(desired_value, str) else bytes(
            desired_value)

        async def once() -> bytes:
            try:
                current, revision = await self._get(key)
            except _Absent:
                if expected:
                    return expected  # TCPStore semantics: nothing to compare against
                await self.kv.create(kv_key(key), desired)
                return desired
            if current != expected:
                return current
            await self.kv.update(kv_key(key), desired, last=revision)
            return desired

        return self._call(self._retry(once, self._op_timeout.total_seconds(),
                                      (KeyWrongLastSequenceError,)))

    def check(self, keys: list[str]) -> bool:
        async def all_present() -> bool:
            for k in keys:
                try:
                    await self._get(k)
                except _Absent:
                    return False
            return True

        return self._transient(all_present)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = (timeout or self._op_timeout).total_seconds()

        async def present() -> None:
            for k in keys:
                await self._get(k)

        try:
            self._call(self._retry(present, limit, (_Absent, *_TRANSIENT)), timeout=limit)
        except _Absent as exc:
            raise StoreTimeout(f"rendezvous key {exc.args[0]!r} did not appear within "
                               f"{limit:.1f}s") from None

    def delete_key(self, key: str) -> bool:
        async def delete() -> bool:
            try:
                await self._get(key)
            except _Absent:
                return False
            await self.kv.delete(kv_key(key))
            return True

        return self._call(delete())

    def num_keys(self) -> int:
        async def count() -> int:
            try:
                keys = await self.kv.keys()
            except NoKeysError:
                return 0
            return sum(1 for k in keys if k.startswith(sj.RENDEZVOUS_PREFIX))

        return self._call(count())

    def close(self) -> None:
        if self._nc is not None:
            self._call(self._nc.close(), timeout=5)
            self._nc = None
            self._kv = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()


class Interruptible(Store):
    """``inner`` (any ``torch.distributed.Store``), whose waits for keys end at once, with
    :class:`StoreInterrupted`, once :meth:`interrupt` is called from another thread.

    ``init_process_group`` waits in the store for every member's address; one that died
    before writing it would hold the others there for the store's whole timeout (300 s on
    the agent's store). A wait polls ``inner.check`` (every 1 ms, backing off to 50 ms),
    so it works over any store, and ends when the keys are there, at ``timeout``
    (:class:`StoreTimeout`), or at the interrupt. Keys already present are never refused:
    an interrupt cannot fail a wait that has what it waits for."""

    FIRST_POLL_S, LAST_POLL_S = 0.001, 0.05

    def __init__(self, inner: Store, timeout: timedelta) -> None:
        super().__init__()
        self._inner = inner
        self._timeout = timeout
        self._stop = threading.Event()
        self.reason = ""

    def interrupt(self, reason: str) -> None:
        """End every wait (now and to come) whose keys are not all there."""
        self.reason = reason
        self._stop.set()

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = (timeout or self._timeout).total_seconds()
        deadline = time.monotonic() + limit
        pause = self.FIRST_POLL_S
        while not self._inner.check(keys):
            if self._stop.is_set():
                raise StoreInterrupted(f"rendezvous abandoned ({self.reason}) while "
                                       f"waiting for {keys!r}")
            if time.monotonic() > deadline:
                raise StoreTimeout(f"rendezvous keys {keys!r} did not appear within "
                                   f"{limit:.1f}s")
            self._stop.wait(pause)  # poll interval of a deadline-bound wait (or the interrupt)
            pause = min(pause * 2, self.LAST_POLL_S)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return bytes(self._inner.get(key))

    # (torch's stubs say str; its bindings take the bytes torch itself passes here)
    def set(self, key: str, value: bytes | str) -> None:
        self._inner.set(key, value)  # type: ignore[arg-type]

    def add(self, key: str, amount: int) -> int:
        return int(self._inner.add(key, amount))

    def compare_set(self, key: str, expected_value: bytes | str,
                    desired_value: bytes | str) -> bytes:
        return bytes(self._inner.compare_set(key, expected_value,  # type: ignore[arg-type]
                                             desired_value))  # type: ignore[arg-type]

    def check(self, keys: list[str]) -> bool:
        return bool(self._inner.check(keys))

    def delete_key(self, key: str) -> bool:
        return bool(self._inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self._inner.num_keys())
