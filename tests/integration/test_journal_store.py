"""Journal segments in a real JetStream KV bucket: a segment is stored only while the
snapshot key is at the revision its writer stored, so re-writing the snapshot (what a
coordinator taking over does first) fences the predecessor; a new full snapshot purges
the older segments; a lost ack retried stores nothing twice."""

from __future__ import annotations

import pytest
from nats.aio.client import Client
from nats.js.api import KeyValueConfig

from ddpbus.codecs import Outbound
from ddpbus.codecs import subjects as sj
from ddpbus.orchestrator.core.state import Tick
from ddpbus.orchestrator.persist import journal
from ddpbus.orchestrator.transport import bus

KEY = b"journal-store-key-0123456789abcd"
JOB = "journal-test"
BUCKET = sj.kv_bucket(JOB)


def _seg(seq: int, *, t: float = 1.0) -> journal.Segment:
    out = Outbound(subject="ddpbus.j.control.all", headers={"Nats-Msg-Id": f"c.g1.{seq}"},
                   payload=b"\x01")
    return journal.Segment(events=[(Tick(), t)], stream_seq=seq, outbox=[out],
                           coordinator_generation=1, saved_at=t)


@pytest.fixture
async def store(nc: Client):  # type: ignore[no-untyped-def]
    js = nc.jetstream()
    kv = await js.create_key_value(KeyValueConfig(bucket=BUCKET, history=5, direct=True))
    return js, kv


async def _on_base(js, kv) -> tuple[journal.Writer, int]:  # type: ignore[no-untyped-def]
    """A writer on base 1.0 of a stored snapshot, and that snapshot's revision."""
    rev = await kv.put(sj.SNAPSHOT_KEY, b"full snapshot 1")
    w = journal.Writer(js, JOB, KEY)
    await w.rebased("1.0", 0.0)
    return w, rev


async def test_a_rewritten_snapshot_fences_the_old_writer(store) -> None:  # type: ignore[no-untyped-def]
    js, kv = store
    old, rev = await _on_base(js, kv)
    await old.append(_seg(10), rev, bus.retry_while_away)
    await old.append(_seg(11), rev, bus.retry_while_away)
    assert [s.stream_seq for s in await journal.read(kv, "1.0", KEY)] == [10, 11]
    # the successor re-writes what it loaded, compare-and-set: the old writer is fenced
    await kv.update(sj.SNAPSHOT_KEY, b"full snapshot 1", last=rev)
    with pytest.raises(journal.Deposed):
        await old.append(_seg(12), rev, bus.retry_while_away)
    assert [s.stream_seq for s in await journal.read(kv, "1.0", KEY)] == [10, 11]
    assert old.index == 2


async def test_a_new_base_purges_the_older_segments(store) -> None:  # type: ignore[no-untyped-def]
    js, kv = store
    w, rev = await _on_base(js, kv)
    await w.append(_seg(10), rev, bus.retry_while_away)
    rev = await kv.put(sj.SNAPSHOT_KEY, b"full snapshot 2")
    await w.rebased("1.1", 1.0)
    assert await journal.read(kv, "1.0", KEY) == []
    await w.append(_seg(20), rev, bus.retry_while_away)
    assert [s.stream_seq for s in await journal.read(kv, "1.1", KEY)] == [20]
    assert (await kv.get(sj.SNAPSHOT_KEY)).value == b"full snapshot 2"  # untouched


async def test_a_retried_segment_is_stored_once(store) -> None:  # type: ignore[no-untyped-def]
    js, kv = store
    w, rev = await _on_base(js, kv)
    calls = 0

    async def lost_ack(op):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        await op()  # stored, but the ack "never came": the retry publishes it again
        return await op()

    await w.append(_seg(10), rev, lost_ack)
    info = await js.stream_info(sj.kv_stream(JOB))
    assert info.state.messages == 2  # the snapshot and one segment
    assert [s.stream_seq for s in await journal.read(kv, "1.0", KEY)] == [10]


def test_when_a_full_snapshot_is_due() -> None:
    w = journal.Writer(None, JOB, KEY)
    assert w.full_due(0.0, 1)  # no base yet
    w.base, w.full_at = "1.0", 10.0
    assert not w.full_due(10.5, 100)
    assert not w.wanted(10.5)
    assert w.wanted(10.0 + journal.FULL_EVERY_S)  # at the next quiet moment
    assert not w.full_due(10.0 + journal.FULL_EVERY_S, 1)
    assert w.full_due(10.0 + journal.FULL_EVERY_S * journal.OVERDUE, 1)  # whatever happens
    assert w.full_due(10.5, journal.MAX_EVENTS + 1)
    w.index = journal.MAX_SEGMENTS
    assert w.full_due(10.5, 1)
    w.index = 0
    w.force_full()
    assert w.full_due(10.5, 1)
