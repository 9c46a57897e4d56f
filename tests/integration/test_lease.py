"""The coordinator lease against a real JetStream KV bucket: one holder at a time, a dead
holder's lease expires, a renewed one is never stolen, a deposed holder learns it."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client

from ddpbus.codecs import subjects as sj
from ddpbus.orchestrator.persist import lease


@pytest.fixture
async def kv(nc: Client):  # type: ignore[no-untyped-def]
    js = nc.jetstream()
    return await js.create_key_value(bucket="lease-test", history=1)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_one_holder_and_expiry(kv) -> None:  # type: ignore[no-untyped-def]
    clock = Clock()
    a = lease.Lease(kv, "a", ttl=5.0, clock=clock)
    b = lease.Lease(kv, "b", ttl=5.0, clock=clock)
    assert await a.try_take()
    assert not await b.try_take()  # live
    clock.now += 6.0  # a stopped renewing (crashed)
    assert await b.try_take()
    # a wakes up: it cannot act, and its renewal tells it it was deposed
    assert not await a.confirm()
    assert a.lost.is_set()
    holder = await lease.read(kv)
    assert holder is not None
    assert holder.holder == "b"


async def test_a_renewed_lease_is_not_waited_out(kv) -> None:  # type: ignore[no-untyped-def]
    a = lease.Lease(kv, "a", ttl=0.6)
    await a.take(wait=False)
    renewing = asyncio.create_task(a.renew())
    b = lease.Lease(kv, "b", ttl=0.6)
    with pytest.raises(lease.LeaseLost, match="renews it"):
        await b.take(wait=False, poll=0.25)
    renewing.cancel()
    await a.release()  # a clean exit hands over at once
    await asyncio.wait_for(b.take(wait=False, poll=0.05), 2.0)
    assert await b.confirm()


async def test_a_standby_waits_for_the_lease(kv) -> None:  # type: ignore[no-untyped-def]
    clock = Clock()
    a = lease.Lease(kv, "a", ttl=5.0, clock=clock)
    await a.take(wait=False)
    b = lease.Lease(kv, "b", ttl=5.0, clock=clock)
    standing_by = asyncio.Event()
    waiting = asyncio.create_task(b.take(wait=True, poll=0.01,
                                         on_wait=lambda _h: standing_by.set()))
    await asyncio.wait_for(standing_by.wait(), 3.0)
    assert not waiting.done()  # a's lease is live: b stands by
    clock.now += 6.0  # a never renewed: expired
    await asyncio.wait_for(waiting, 3.0)
    assert b.revision > a.revision


async def test_concurrent_renewals_by_the_holder_do_not_depose_it(kv) -> None:  # type: ignore[no-untyped-def]
    # after a broker outage the renew task and confirm() both renew at once
    clock = Clock()
    a = lease.Lease(kv, "a", ttl=5.0, clock=clock)
    await a.take(wait=False)
    clock.now += 4.0  # renewal overdue (the broker was away)
    results = await asyncio.gather(a._renew_once(), a.confirm(), a._renew_once())
    assert all(results)
    assert not a.lost.is_set()


async def test_a_renewal_that_landed_after_its_task_was_cancelled_is_released_too(
        kv) -> None:  # type: ignore[no-untyped-def]
    """At a clean exit the stream reader's last renewal may be written though its task was
    cancelled before it learnt the new revision: the release must still free the lease
    (a standby, and `ddpbus status`, saw it held for a whole TTL after the run)."""
    a = lease.Lease(kv, "a", ttl=5.0)
    await a.take(wait=False)
    await kv.update(sj.LEASE_KEY, b'{"holder": "a", "expires": 1e12}', last=a.revision)
    await a.release()
    assert await lease.read(kv) is None
    b = lease.Lease(kv, "b", ttl=5.0)
    assert await b.try_take()  # free at once
    await a.release()  # not a's any more: left alone
    holder = await lease.read(kv)
    assert holder is not None
    assert holder.holder == "b"


async def test_a_stale_revision_of_our_own_is_adopted(kv) -> None:  # type: ignore[no-untyped-def]
    # a renewal stored just before the broker went away, its ack lost: the holder's
    # revision is stale, but the key is still its own
    a = lease.Lease(kv, "a", ttl=5.0)
    await a.take(wait=False)
    a.revision = await kv.update(sj.LEASE_KEY, b'{"holder": "a", "expires": 0}',
                                 last=a.revision) - 1
    assert await a._renew_once()
    assert not a.lost.is_set()
    b = lease.Lease(kv, "b", ttl=5.0)
    assert not await b.try_take()  # still a's, freshly renewed


class Flaky:
    """The real bucket, whose writes fail while ``away`` (the broker unreachable) and
    take ``slow`` seconds of ``clock``."""

    def __init__(self, kv, clock: Clock, slow: float = 0.0) -> None:  # type: ignore[no-untyped-def]
        self.kv, self.clock, self.slow, self.away = kv, clock, slow, False

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self.kv, name)  # reads go through

    async def create(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.clock.now += self.slow
        return await self.kv.create(*args, **kwargs)

    async def update(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.away:
            raise ConnectionError("nats: outbound buffer limit exceeded")
        self.clock.now += self.slow
        return await self.kv.update(*args, **kwargs)


async def test_an_outage_is_logged_once_not_at_every_retry(
        kv, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    clock = Clock()
    flaky = Flaky(kv, clock)
    a = lease.Lease(flaky, "a", ttl=5.0, clock=clock)  # type: ignore[arg-type]
    await a.take(wait=False)
    flaky.away = True
    clock.now += 4.0  # every input and tick now tries to renew
    with caplog.at_level("INFO", logger="ddpbus.orchestrator.persist.lease"):
        assert [await a.confirm() for _ in range(20)] == [True] * 20  # within the TTL
        clock.now += 2.0
        assert not await a.confirm()  # past it: cannot act
        flaky.away = False
        assert await a.confirm()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["lease renewal failed (nats: outbound buffer limit exceeded); retrying",
                     "lease renewed after 21 failed tries"]
    assert not a.lost.is_set()


@pytest.mark.parametrize("renewed", [False, True])
async def test_the_holder_never_outlives_the_stored_expiry(kv, renewed: bool) -> None:  # type: ignore[no-untyped-def]
    # a write that takes 3 s (a loaded broker): the holder must count its lease from
    # before the write, as the stored expiry does, or it acts on after a standby took over
    clock = Clock()
    flaky = Flaky(kv, clock, slow=3.0)
    a = lease.Lease(flaky, "a", ttl=5.0, clock=clock)  # type: ignore[arg-type]
    await a.take(wait=False)
    if renewed:
        clock.now += 4.0
        assert await a.confirm()  # renewed, the write again 3 s long
    expires = (await lease.read(kv)).expires  # type: ignore[union-attr]
    flaky.away = True
    clock.now = expires - 0.1
    assert await a.confirm()
    clock.now = expires + 0.1
    assert not await a.confirm()
    b = lease.Lease(kv, "b", ttl=5.0, clock=clock)
    assert await b.try_take()
