"""The Publisher against a real nats-server that goes away: nats-py's publish_async slots
(``publish_async_max_pending``, 4000 by default) all come back however the broker goes
and returns, a full set of slots cannot stall it for good, and a message it gives up is
reported at once."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from jobs import PublisherHooks, freeze, until
from nats.aio.client import Client
from nats.js.client import JetStreamContext

from ddpbus.codecs import Outbound
from ddpbus.orchestrator.runtime.nats_server import BrokerConfig, EmbeddedBroker
from ddpbus.orchestrator.transport.bus import Publisher, PublishFailed, connect

STREAM, SUBJECTS = "PUB", ["pub.>"]


def _out(i: int) -> Outbound:
    return Outbound(subject="pub.x", headers={"Nats-Msg-Id": f"m{i}"}, payload=str(i).encode())


def _free_slots(js: JetStreamContext) -> int:
    # nats-py keeps no public count of them; each publish_async takes one until its
    # future is done
    return js._publish_async_pending_semaphore._value


async def _stored(js: JetStreamContext) -> list[int]:
    state = (await js.stream_info(STREAM)).state
    return [int((await js.get_msg(STREAM, seq)).data or b"")
            for seq in range(state.first_seq, state.last_seq + 1)]


@pytest.mark.parametrize("hooks", [True, False], ids=["hooks", "no-hooks"])
async def test_broker_restarts_give_every_publish_slot_back(tmp_path: Path,
                                                            hooks: bool) -> None:
    """Each cycle: messages in flight to a frozen broker that is then killed (their acks
    never come: re-published), and messages submitted while it is away (without the
    disconnect hook they go to publish_async, which takes a slot and then fails). After
    every restart everything is stored, in order, and the slots are as they were."""
    store = tmp_path / "store"
    broker = EmbeddedBroker(BrokerConfig(store_dir=store))
    broker.start()
    port = broker.port
    wiring = PublisherHooks()
    nc: Client = await (wiring.connect(broker.url, "pub") if hooks
                        else connect(broker.url, name="pub"))
    js = nc.jetstream()
    await js.add_stream(name=STREAM, subjects=SUBJECTS)
    publisher = wiring.publisher = Publisher(js, ack_timeout=2.0)
    slots = _free_slots(js)
    task = asyncio.create_task(publisher.run())
    n = 0

    def submit(k: int) -> None:
        nonlocal n
        for _ in range(k):
            publisher.submit(_out(n))
            n += 1

    try:
        for _ in range(3):
            submit(5)
            assert await publisher.flush(10), publisher.failed
            assert broker.process is not None
            freeze(broker.process.pid)  # stopped before anything is sent
            submit(20)  # sent, never acked
            await until("20 publishes in flight", lambda: js.publish_async_pending() >= 20)
            broker.process.kill()
            broker.stop()
            await until("the client to see the broker gone", lambda: not nc.is_connected)
            submit(10)  # while it is away: taken by the publisher (or held, with the hook)
            await until("the publisher to take them", lambda: publisher._queue.empty()
                        or not publisher._open.is_set())
            broker = EmbeddedBroker(BrokerConfig(port=port, store_dir=store))
            broker.start()
            assert await publisher.flush(30), publisher.failed
            assert _free_slots(js) == slots, f"{slots - _free_slots(js)} slots leaked"
            assert js.publish_async_pending() == 0
        assert await _stored(js) == list(range(n))
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await nc.close()
        broker.stop()


async def test_a_full_set_of_slots_does_not_stall_the_publisher(nc: Client) -> None:
    """Should every slot be taken, a publish waits for one no longer than for an ack, then
    goes out the slow way (one acked request each), in order; it does not hang."""
    js = nc.jetstream(publish_async_max_pending=8)
    await js.add_stream(name=STREAM, subjects=SUBJECTS)
    publisher = Publisher(js, ack_timeout=0.5)
    sem = js._publish_async_pending_semaphore
    for _ in range(8):  # taken by something else, or leaked
        await sem.acquire()
    task = asyncio.create_task(publisher.run())
    try:
        for i in range(3):
            publisher.submit(_out(i))
        stored = await publisher.flush(10)
        for _ in range(8):
            sem.release()
        assert stored, "the publisher stalled on a full set of publish_async slots"
        for i in range(3, 10):
            publisher.submit(_out(i))
        assert await publisher.flush(10)
        assert _free_slots(js) == 8
        assert await _stored(js) == list(range(10))
    finally:
        task.cancel()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 10)


async def test_a_message_given_up_is_reported_at_once(nc: Client) -> None:
    """No stream takes the subject: after the retry deadline the message is given up, and
    the owner hears of it then (callback and awaitable), not at its next flush."""
    js = nc.jetstream()
    reported: list[PublishFailed] = []
    publisher = Publisher(js, ack_timeout=0.5, retry_deadline=0.5, on_failed=reported.append)
    task = asyncio.create_task(publisher.run())
    try:
        publisher.submit(Outbound(subject="nowhere.x", headers={"Nats-Msg-Id": "lost"},
                                  payload=b"x"))
        failed = await asyncio.wait_for(publisher.failure(), 15)
        assert reported == [failed]
        assert "nowhere.x" in str(failed)
        assert publisher.failed is failed
        assert not await publisher.flush(5)
        # and no retry loop is left behind: the ack checker ended with the give-up, so the
        # publisher stops at once when its owner cancels it (a rank once hung at exit on a
        # checker still retrying after its cancel)
        await asyncio.sleep(0)
        assert not [t for t in asyncio.all_tasks() if t.get_name() == "publisher-acks"]
        task.cancel()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 2)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
