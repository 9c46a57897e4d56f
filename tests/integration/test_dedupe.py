"""A copy that JetStream stores twice (published again after its duplicate window, as a
publisher re-sending its backlog after a long broker outage does) changes nothing: the
coordinator's ledger is deduplicated by message id."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from jobs import chaos_job
from nats.js.api import StreamConfig
from nats.js.errors import NotFoundError

from ddpbus.codecs import subjects as sj
from ddpbus.orchestrator.runtime.nats_server import EmbeddedBroker
from ddpbus.orchestrator.transport.bus import connect

pytestmark = pytest.mark.timeout(240)


async def store_copies(url: str, job: str, subject: str, count: int) -> int:
    """Re-publish the first ``count`` messages on ``subject`` verbatim (headers, id and
    signature included) once the stream's duplicate window no longer covers them."""
    nc = await connect(url, name="test-duplicator")
    js = nc.jetstream()
    stream = sj.stream_name(job)
    deadline = time.monotonic() + 60
    while True:  # the coordinator creates the job's stream
        try:
            info = await js.stream_info(stream)
            break
        except NotFoundError:
            assert time.monotonic() < deadline, "the job's stream never appeared"
            await asyncio.sleep(0.05)  # poll interval of a deadline-bound wait
    config: StreamConfig = info.config
    config.duplicate_window = 0.1  # s, the least the server takes: the originals fall out
    await js.update_stream(config)
    sub = await js.subscribe(subject, ordered_consumer=True)
    stored = 0
    while stored < count:
        msg = await sub.next_msg(timeout=30)
        while True:  # until JetStream stores it as new: the window has passed
            ack = await js.publish(msg.subject, msg.data, headers=msg.headers)
            if not ack.duplicate:
                break
            assert time.monotonic() < deadline, "the duplicate window never passed"
            await asyncio.sleep(0.01)  # retry interval, bounded by the deadline
        stored += 1
    await sub.unsubscribe()
    await nc.close()
    return stored


def test_copies_stored_twice_change_nothing(broker: EmbeddedBroker, tmp_path: Path) -> None:
    job, _ = chaos_job(broker.url, tmp_path, "dup", epochs=6, slowdown=2)
    try:
        copies = asyncio.run(store_copies(broker.url, "dup", "ddpbus.dup.metrics.rank.0", 2))
        copies += asyncio.run(store_copies(broker.url, "dup", "ddpbus.dup.timing.rank.1", 5))
        summary = job.wait()
    finally:
        job.kill()
    assert summary["ok"], summary
    assert summary["refused"].get("duplicate-id") == copies, summary["refused"]
    assert summary["coverage"]["exact"], summary["coverage"]
    assert summary["epochs"] == 6
    per_epoch = 1438 // 32
    assert sum(summary["batches"].values()) == 6 * per_epoch
