"""The stream reader on a real JetStream consumer: a burst is handed over in stream order,
each message with the sequence and store time read off its reply subject (the same values
nats-py's own metadata parse gives, for both reply-subject forms), nothing twice, and
everything acked once the burst is through."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from jobs import until
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from ddpbus.codecs import subjects as sj
from ddpbus.orchestrator.transport import bus

STREAM = "READER_TEST"


def _msg(reply: str) -> Msg:
    return Msg(_client=None, subject="s", reply=reply, data=b"", headers=None)  # type: ignore[arg-type]


@pytest.mark.parametrize("reply", [
    "$JS.ACK.S.c.1.4711.12.1796521956229751000.3",  # 9 tokens
    "$JS.ACK._.acchash.S.c.2.4711.12.1796521956229751000.3",  # with a domain, 11
    "$JS.ACK.dom.acchash.S.c.2.4711.12.1796521956229751000.3.rnd",  # 12
])
def test_delivery_reads_what_the_client_metadata_reads(reply: str) -> None:
    msg = _msg(reply)
    got = sj.delivery(msg.reply)
    assert got is not None
    assert got.stream_seq == msg.metadata.sequence.stream == 4711
    assert got.stored_at == pytest.approx(msg.metadata.timestamp.timestamp(), abs=1e-6)


@pytest.mark.parametrize("reply", [None, "", "_INBOX.abc", "$JS.ACK.S.c.1.x.12.17.3",
                                   "$JS.ACK.S.c.1.4711.12.notatime.3", "$JS.ACK.S.c.1.2.3",
                                   "$KV.ACK.S.c.1.4711.12.1796521956229751000.3"])
def test_delivery_of_anything_else_is_none(reply: str | None) -> None:
    assert sj.delivery(reply) is None


async def test_a_burst_is_read_in_order_once_with_store_times_then_acked(nc: Client) -> None:
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name=STREAM, subjects=["reader.>"]))
    await js.add_consumer(STREAM, ConsumerConfig(durable_name="r", ack_policy=AckPolicy.ALL))
    before = time.time()
    for i in range(600):  # more than one pull batch, faster than one handler each
        await nc.publish(f"reader.{i % 3}", str(i).encode())
    await nc.flush()
    seen: list[tuple[int, int, float | None]] = []
    done = asyncio.Event()
    reader: bus.StreamReader

    async def handler(msg: Msg) -> None:
        seen.append((int(msg.data), reader.handled_seq, reader.handled_at))
        if len(seen) == 600:
            done.set()

    reader = bus.StreamReader(nc, STREAM, "r", handler, batch=128)
    task = asyncio.create_task(reader.run())
    try:
        await asyncio.wait_for(done.wait(), 20)
        for _ in range(200):  # until the quiet moment's AckAll (ACK_DELAY_S after the last)
            info = await js.consumer_info(STREAM, "r")
            if info.ack_floor is not None and info.ack_floor.stream_seq == 600:
                break
            await asyncio.sleep(0.01)  # poll interval of a deadline-bound wait
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert [x for x, _, _ in seen] == list(range(600))
    assert [seq for _, seq, _ in seen] == list(range(1, 601))
    assert all(at is not None and before - 1 <= at <= time.time() for _, _, at in seen)
    assert reader.redelivered == 0
    assert info.ack_floor is not None
    assert info.ack_floor.stream_seq == 600


async def test_a_reader_no_longer_entitled_takes_and_acks_nothing(nc: Client) -> None:
    """A deposed coordinator's reader: from the first message its handler could not apply
    it acks nothing (not even what it applied: the successor replays from its own
    snapshot); and once its ``entitled`` check says it may never read again it does not
    even pull, so nothing is taken from the successor's consumer (the same durable name,
    re-created). ``entitled`` False means "not now": the reader asks again."""
    js = nc.jetstream()
    stream = "READER_STOP"
    await js.add_stream(StreamConfig(name=stream, subjects=["stop.>"]))
    config = ConsumerConfig(durable_name="r", ack_policy=AckPolicy.ALL, ack_wait=30.0)
    await js.add_consumer(stream, config)
    for i in range(20):
        await nc.publish("stop.x", str(i).encode())
    await nc.flush()
    handled: list[int] = []

    async def deposed_at_five(msg: Msg) -> None:
        if len(handled) == 5:
            raise bus.NotApplied
        handled.append(int(msg.data))

    await asyncio.wait_for(bus.StreamReader(nc, stream, "r", deposed_at_five).run(), 10)
    assert handled == list(range(5))
    info = await js.consumer_info(stream, "r")
    assert info.ack_floor is not None
    assert info.ack_floor.stream_seq == 0

    # the successor re-creates the durable from its snapshot (here: the stream's start)
    await js.delete_consumer(stream, "r")
    await js.add_consumer(stream, config)

    async def never_again() -> bool:
        raise bus.NotApplied

    async def must_not_run(msg: Msg) -> None:
        raise AssertionError(f"a deposed reader handled {msg.data!r}")

    await asyncio.wait_for(bus.StreamReader(nc, stream, "r", must_not_run,
                                            entitled=never_again).run(), 10)
    info = await js.consumer_info(stream, "r")
    assert info.delivered.stream_seq == 0  # it did not even pull
    assert info.num_waiting == 0

    answers = iter([False, False])
    successor: list[int] = []
    done = asyncio.Event()

    async def entitled() -> bool:
        return next(answers, True)  # not yet, not yet, then for good

    async def take(msg: Msg) -> None:
        successor.append(int(msg.data))
        if len(successor) == 20:
            done.set()

    task = asyncio.create_task(bus.StreamReader(nc, stream, "r", take,
                                                entitled=entitled).run())
    try:
        await asyncio.wait_for(done.wait(), 10)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert successor == list(range(20))


async def test_a_reader_whose_consumer_is_gone_backs_off_then_resumes(
        nc: Client, caplog: pytest.LogCaptureFixture) -> None:
    """A pull to a durable that no longer exists is answered 503 No Responders at once:
    the reader must not re-ask in a busy loop (thousands of requests and warnings a
    second) but back off, say so once, and read again once the durable is back."""
    caplog.set_level(logging.INFO, logger=bus.log.name)
    js = nc.jetstream()
    stream = "READER_GONE"
    await js.add_stream(StreamConfig(name=stream, subjects=["gone.>"]))
    config = ConsumerConfig(durable_name="r", ack_policy=AckPolicy.ALL)
    await js.add_consumer(stream, config)
    seen: list[int] = []
    arrived = asyncio.Event()

    async def handler(msg: Msg) -> None:
        seen.append(int(msg.data))
        arrived.set()

    reader = bus.StreamReader(nc, stream, "r", handler)
    task = asyncio.create_task(reader.run())
    try:
        await nc.publish("gone.x", b"0")
        await asyncio.wait_for(arrived.wait(), 10)
        await js.delete_consumer(stream, "r")  # e.g. retired at the run's end
        await until("the reader to notice", lambda: any(
            r.levelno >= logging.WARNING for r in caplog.records))
        sent = nc.stats["out_msgs"]
        await asyncio.sleep(1.0)  # the window the request rate is measured over
        requests = nc.stats["out_msgs"] - sent
        away = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(away) == 1, [r.getMessage() for r in away[:5]]
        assert requests <= 10, f"{requests} pull requests in 1 s while the consumer was gone"

        await js.add_consumer(stream, config)  # re-created: from the stream's start
        arrived.clear()
        await nc.publish("gone.x", b"1")
        await asyncio.wait_for(arrived.wait(), 10)
        while seen[-1] != 1:
            arrived.clear()
            await asyncio.wait_for(arrived.wait(), 10)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert seen[0] == 0
    assert seen[-1] == 1
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 2, warned  # gone once, back once
    assert "answering again" in warned[1]
