"""The connection shell the coordinator and the worker agent share (runtime/endpoint.py).

Its parts against stand-ins for the publisher and reader; the real ones, with a real
nats-server going away and back, are exercised by tests/integration (test_auth's broker
restart, test_publisher) and the chaos suite's broker kills.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from ddpbus.orchestrator.runtime.endpoint import Endpoint
from ddpbus.orchestrator.transport import bus


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Publisher:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def disconnected(self) -> None:
        self.calls.append("disconnected")

    def reconnected(self) -> None:
        self.calls.append("reconnected")


class Reader:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    async def reconnected(self) -> None:
        self.calls.append("reader reattached")


def endpoint(failures: list[tuple[str, BaseException]]) -> tuple[Endpoint, Clock, list[str]]:
    clock = Clock()
    link = Endpoint("rank 0", lambda name, exc: failures.append((name, exc)), clock=clock)
    publisher = Publisher()
    link.publisher = cast(bus.Publisher, publisher)
    link.reader = cast(bus.StreamReader, Reader(publisher.calls))
    return link, clock, publisher.calls


async def test_an_outage_is_reported_once_and_its_length_measured() -> None:
    link, clock, calls = endpoint([])
    assert not link.down
    assert link.lost() is True  # the owner logs this one
    clock.now += 2.5
    assert link.lost() is False  # the client calls again while reconnecting: no new outage
    assert link.down
    clock.now += 1.0
    assert await link.back() == pytest.approx(3.5)
    assert not link.down
    # sends held while away, resent when back, the reader re-attached after the publisher
    assert calls == ["disconnected", "disconnected", "reconnected", "reader reattached"]
    assert await link.back() == 0.0  # a reconnect with no outage seen: nothing away


async def test_callbacks_before_the_publisher_exists_are_harmless() -> None:
    link = Endpoint("coordinator", lambda name, exc: None)
    assert link.lost() is True
    assert await link.back() >= 0.0


async def test_a_task_that_dies_is_the_owners_failure_and_stop_ends_the_rest() -> None:
    failures: list[tuple[str, BaseException]] = []
    link, _, _ = endpoint(failures)
    forever = link.spawn(asyncio.Event().wait(), "reader")

    async def broken() -> None:
        raise RuntimeError("boom")

    link.spawn(broken(), "publisher")
    await asyncio.wait_for(link.watch.failed.wait(), 5)
    assert [(n, str(e)) for n, e in failures] == [("publisher", "boom")]
    assert link.tasks == {forever}  # a task that ended leaves the set
    await link.stop(5.0)
    assert forever.cancelled()
    assert not link.tasks
    assert len(failures) == 1  # what the cancel raised is no failure


async def test_the_beacon_encodes_each_message_afresh_and_survives_a_failed_send(
        monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[Any] = []
    three = asyncio.Event()

    async def publish_core(_nc: Any, out: Any) -> None:
        sent.append(out)
        if len(sent) == 3:
            three.set()
        if len(sent) == 1:
            raise ConnectionError("connection lost")  # dropped: the next beat replaces it

    monkeypatch.setattr(bus, "publish_core", publish_core)
    link, _, _ = endpoint([])
    count = iter(range(100))
    beacon = link.spawn(link.beacon(cast(Any, None), lambda: next(count), every=0.001),
                        "heartbeat")
    await asyncio.wait_for(three.wait(), 5)
    await link.stop(5.0)
    assert sent[:3] == [0, 1, 2]
    assert beacon.cancelled()
    assert not link.watch.failed.is_set()


async def test_a_reader_cancelled_as_a_delivery_arrives_stops() -> None:
    """The stream reader's wait for deliveries passes a cancellation on even when a message
    arrives at that moment (Python 3.11's wait_for returned the message instead: a rank at
    exit, its reader cancelled as a 503 came in, lived on until SIGTERM)."""
    import asyncio

    import pytest

    from ddpbus.orchestrator.transport.bus import StreamReader

    async def handler(_msg: object) -> None:
        return None

    reader = StreamReader(None, "S", "rank-0", handler)  # type: ignore[arg-type]
    arrived = asyncio.Event()
    task = asyncio.ensure_future(reader._wait(arrived))
    await asyncio.sleep(0)  # waiting now
    arrived.set()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
