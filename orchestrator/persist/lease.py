"""The coordinator's leader lease: one KV key, taken and renewed by compare-and-set.

The key ``coordinator.lease`` holds ``{"holder": ..., "expires": unix seconds}``. A
coordinator takes it when it is absent (``create``) or expired (``update`` against the
revision it read), then renews it every ``ttl / 3`` seconds with ``update(last=revision)``.
A renewal that finds another revision means somebody else took over: the holder is
deposed and must stop at once (:class:`LeaseLost`). A standby coordinator waits, polling,
until the lease expires. Expiry is judged on the wall clock of whoever reads it, so hosts
need roughly synchronised clocks (NTP); the TTL should be well above any skew.

The fencing token workers see is the coordinator *generation*: a coordinator draws a new,
higher one only after it holds the lease, and workers reject control traffic from any
generation below the highest they have seen.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from ddpbus.codecs import subjects as sj
from ddpbus.codecs.errors import DdpbusError

log = logging.getLogger(__name__)



class LeaseLost(DdpbusError, RuntimeError):
    """Another coordinator holds the lease now."""


@dataclass(frozen=True, slots=True)
class Holder:
    holder: str
    expires: float
    revision: int


def _value(holder: str, expires: float) -> bytes:
    return json.dumps({"holder": holder, "expires": expires}).encode()


async def read(kv: KeyValue) -> Holder | None:
    try:
        entry = await kv.get(sj.LEASE_KEY)
    except KeyNotFoundError:
        return None
    if not entry.value:
        return None  # deleted (released)
    return parse(entry.value, int(entry.revision or 0))


def parse(value: bytes, revision: int) -> Holder:
    """A stored lease value. One that does not read as a holder and a finite expiry time
    (not JSON, nested too deep, a number too large for a float, NaN, infinite) counts as
    expired: nobody can hold the job with it, so the next coordinator takes over."""
    try:
        body = json.loads(value)
        holder, expires = str(body["holder"]), float(body["expires"])
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
        return Holder("?", 0.0, revision)
    return Holder(holder, expires, revision) if math.isfinite(expires) else Holder(
        "?", 0.0, revision)


class Lease:
    def __init__(self, kv: KeyValue, holder: str, *, ttl: float = 5.0,
                 clock: Callable[[], float] = time.time) -> None:
        if ttl <= 0:
            raise ValueError("lease ttl must be positive")
        self.kv, self.holder, self.ttl, self.clock = kv, holder, ttl, clock
        self.revision = 0
        self.renewed_at = 0.0
        self._failed_renewals = 0  # in a row (the broker away): logged at the first, the end
        self.lost: asyncio.Event = asyncio.Event()
        # the renew task and confirm() may both renew: one at a time, or the second
        # compare-and-set would fail against the first's revision
        self._renewing = asyncio.Lock()

    async def try_take(self) -> bool:
        """Take the lease if nobody holds a live one; True when taken."""
        current = await read(self.kv)
        # the holder counts its lease from before the write, as the stored expiry does: a
        # slow write must not let it believe in the lease longer than a standby would
        now = self.clock()
        value = _value(self.holder, now + self.ttl)
        try:
            if current is None:
                try:
                    self.revision = await self.kv.create(sj.LEASE_KEY, value)
                except KeyWrongLastSequenceError:
                    # a deleted key has a tombstone revision: update against it
                    entry = await self.kv.get(sj.LEASE_KEY)
                    self.revision = await self.kv.update(sj.LEASE_KEY, value,
                                                         last=entry.revision)
            elif current.expires > now and current.holder != self.holder:
                return False
            else:
                self.revision = await self.kv.update(sj.LEASE_KEY, value, last=current.revision)
        except (KeyWrongLastSequenceError, KeyNotFoundError):
            return False  # somebody else won the race
        self.renewed_at = now
        return True

    async def take(self, *, wait: bool, poll: float = 0.5,
                   on_wait: Callable[[Holder | None], None] | None = None) -> None:
        """Take the lease. With ``wait`` (a standby), wait as long as it takes. Without,
        wait only for a lease nobody renews any more (a crashed predecessor's, which
        expires within its TTL); a lease that is renewed meanwhile has a live holder:
        :class:`LeaseLost`."""
        told = False
        seen: int | None = None
        while not await self.try_take():
            current = await read(self.kv)
            if not wait and current is not None:
                if seen is not None and current.revision != seen:
                    raise LeaseLost(f"another coordinator ({current.holder}) holds the lease "
                                    "and renews it")
                seen = current.revision
            if on_wait is not None and not told:
                on_wait(current)
                told = True
            # try again when it expires (by our clock; ``poll`` bounds a skewed one), not
            # up to a whole ``poll`` later: a takeover's time is the lease's, not ours
            left = current.expires - self.clock() if current is not None else poll
            await asyncio.sleep(min(poll, max(0.01, left + 0.005)))
        log.info("holding the coordinator lease (revision %d, ttl %.1fs)", self.revision,
                 self.ttl)

    async def confirm(self) -> bool:
        """May the holder act now? A renewal older than two thirds of the TTL (the process
        was paused, or the broker is away) is refreshed first; a holder that cannot prove
        its lease within the TTL must not act."""
        if self.lost.is_set():
            return False
        if self.clock() - self.renewed_at < self.ttl * 2 / 3:
            return True
        if await self._renew_once():
            return True
        return not self.lost.is_set() and self.clock() - self.renewed_at < self.ttl

    async def _renew_once(self) -> bool:
        async with self._renewing:
            return await self._renew_locked()

    async def _renew_locked(self) -> bool:
        now = self.clock()  # (from before the write: see try_take)
        value = _value(self.holder, now + self.ttl)
        try:
            try:
                self.revision = await self.kv.update(sj.LEASE_KEY, value, last=self.revision)
            except KeyWrongLastSequenceError:
                current = await read(self.kv)
                if current is None or current.holder != self.holder:
                    raise
                # our own renewal, stored just before the broker went away, its ack lost
                # (or a data loss that kept an older one of ours)
                self.revision = await self.kv.update(sj.LEASE_KEY, value,
                                                     last=current.revision)
        except KeyWrongLastSequenceError:
            log.error("the coordinator lease was taken over; this coordinator is "  # noqa: TRY400
                      "deposed")
            self.lost.set()
            return False
        except Exception as exc:  # the broker is away: keep trying while the TTL lasts
            self._failed_renewals += 1
            if self._failed_renewals == 1:  # (every input and tick retries: not a line each)
                log.warning("lease renewal failed (%s); retrying", exc)
            return False
        if self._failed_renewals:
            log.info("lease renewed after %d failed tries", self._failed_renewals)
            self._failed_renewals = 0
        self.renewed_at = now
        return True

    async def renew(self) -> None:
        """Renew until cancelled; sets :attr:`lost` and returns when deposed."""
        while not self.lost.is_set():
            await asyncio.sleep(self.ttl / 3)
            await self._renew_once()

    async def release(self) -> None:
        """Give the lease up (a clean exit), so a standby need not wait for the TTL. A
        renewal whose task was cancelled mid-write (the stream reader's, at shutdown) may
        still have landed: our own newer revision is released all the same, another
        holder's never."""
        async with self._renewing:
            try:
                try:
                    await self.kv.update(sj.LEASE_KEY, b"", last=self.revision)
                except KeyWrongLastSequenceError:
                    current = await read(self.kv)
                    if current is None or current.holder != self.holder:
                        return  # released already, or not ours any more
                    await self.kv.update(sj.LEASE_KEY, b"", last=current.revision)
            except Exception as exc:  # it expires on its own anyway
                log.debug("lease release failed: %s", exc)
