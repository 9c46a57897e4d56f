"""ensure_job against a real JetStream: idempotent, per subjects.md, order-preserving."""

from __future__ import annotations

import subprocess
import sys

from nats.aio.client import Client
from nats.js.api import DeliverPolicy

from ddpbus.codecs import Decoder, Encoder
from ddpbus.codecs import messages as m
from ddpbus.codecs import subjects as sj
from ddpbus.orchestrator.runtime.nats_server import EmbeddedBroker
from ddpbus.orchestrator.runtime.provision import JobStorage, consumer_configs, ensure_job
from ddpbus.orchestrator.transport.bus import publish, publish_core

JOB_KEY = b"test-job-key-0123456789abcdef!!"

JOB = "prov"


async def test_ensure_job_is_idempotent_and_grows(nc: Client) -> None:
    js = nc.jetstream()
    first = await ensure_job(js, JOB, 2)
    again = await ensure_job(js, JOB, 2)
    assert first == again
    assert first.consumers == ("coordinator", "rank-0", "rank-1")
    info = await js.stream_info(first.stream)
    assert sorted(info.config.subjects or []) == sorted(sj.stream_subjects(JOB))
    assert info.config.duplicate_window == sj.DUPLICATE_WINDOW.total_seconds()
    grown = await ensure_job(js, JOB, 3)
    assert grown.consumers[-1] == "rank-2"
    c = await js.consumer_info(first.stream, "rank-2")
    assert c.config.filter_subjects == sj.rank_filters(JOB, 2)
    assert (await js.stream_info(first.stream)).state.messages == 0
    await js.key_value(first.bucket)


async def test_a_job_larger_than_the_servers_consumer_default(nc: Client) -> None:
    """nats-server 2.15 caps a stream at 1,000 consumers unless it says otherwise: a
    1,100-rank job gets all its durables, and growing it raises the limit, never lowers it."""
    js = nc.jetstream()
    small = await ensure_job(js, "wide", 2)
    assert (await js.stream_info(small.stream)).config.max_consumers == 1000
    wide = await ensure_job(js, "wide", 1100)
    assert len(wide.consumers) == 1101
    info = await js.stream_info(wide.stream)
    assert info.state.consumer_count == 1101
    assert info.config.max_consumers == 1100 + 1 + 256
    await ensure_job(js, "wide", 2)  # a smaller world size again: the limit stays
    assert (await js.stream_info(wide.stream)).config.max_consumers == 1357
    # nats-server writes each consumer's state as it shuts down (~10 ms apiece here, 11 s
    # for these 1,101): without them the fixture's broker stops at once
    await js.delete_stream(wide.stream)


async def test_rank_consumer_sees_broadcast_and_own_messages_in_order(nc: Client) -> None:
    js = nc.jetstream()
    res = await ensure_job(js, JOB, 2)
    enc = Encoder(job=JOB, key=JOB_KEY, sender="coordinator", generation=1)
    sent = [
        (sj.CONTROL_ALL.subject(JOB), m.SetGlobalStep(global_step=1)),
        (sj.CONTROL_RANK.subject(JOB, 1), m.StartEpoch(plan=m.EpochPlan(
            epoch=0, partition_offset=0, partition_size=10))),
        (sj.CONTROL_RANK.subject(JOB, 0), m.SyncNow()),
        (sj.CONTROL_ALL.subject(JOB), m.Shutdown()),
    ]
    for subject, msg in sent:
        await publish(js, enc.encode(subject, msg))
    # a retried publish with the same id is dropped by the duplicate window
    dup = await publish(js, enc.encode(sj.CONTROL_ALL.subject(JOB), m.Shutdown(), seq=4))
    assert dup.duplicate
    # heartbeats are core NATS: never stored
    live = Encoder(job=JOB, key=JOB_KEY, sender="rank-1", generation=1)
    await publish_core(nc, live.encode(sj.LIVE_RANK.subject(JOB, 1),
                                       m.Heartbeat(rank=1, step_count=0)))
    await nc.flush()
    assert (await js.stream_info(res.stream)).state.messages == 4

    sub = await js.pull_subscribe_bind(durable="rank-1", stream=res.stream)
    msgs = await sub.fetch(10, timeout=2)
    dec = Decoder(job=JOB, key=JOB_KEY)
    got = [dec.decode(x.subject, x.headers, x.data).message for x in msgs]
    assert got == [sent[0][1], sent[1][1], sent[3][1]]
    for x in msgs:
        await x.ack()


def test_init_job_cli(broker: EmbeddedBroker) -> None:
    out = subprocess.run([sys.executable, "-m", "ddpbus.orchestrator.tools.cli", "init-job",
                          "--job", JOB, "--nats", broker.url, "--world-size", "2"],
                         capture_output=True, text=True, timeout=60, check=True)
    assert "stream DDPBUS_prov" in out.stdout
    assert "rank-1" in out.stdout


async def test_a_rewound_coordinator_consumer_survives_later_starts(nc: Client) -> None:
    """A takeover re-creates the coordinator's durable to deliver from its snapshot's stream
    sequence; every later start (a restart, a standby, ``init-job``) provisions the job
    again: that must keep the start position (nats-server refuses to change a deliver
    policy in place) and still bring filters up to date and add missing ranks."""
    js = nc.jetstream()
    res = await ensure_job(js, JOB, 2)
    rewound = consumer_configs(JOB, 2, JobStorage())[0]  # as Coordinator._rewind_consumer
    rewound.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
    rewound.opt_start_seq = 5
    rewound.filter_subjects = [sj.coordinator_filters(JOB)[0]]  # an older layout's filters
    await js.delete_consumer(res.stream, sj.COORDINATOR_CONSUMER)
    await js.add_consumer(res.stream, rewound)

    for world_size in (2, 3, 3):  # restarts, one of them with a larger world
        await ensure_job(js, JOB, world_size)
    coordinator = (await js.consumer_info(res.stream, sj.COORDINATOR_CONSUMER)).config
    assert coordinator.deliver_policy == DeliverPolicy.BY_START_SEQUENCE
    assert coordinator.opt_start_seq == 5
    assert coordinator.filter_subjects == sj.coordinator_filters(JOB)
    rank = (await js.consumer_info(res.stream, sj.rank_consumer(2))).config
    assert rank.deliver_policy == DeliverPolicy.ALL
    assert rank.filter_subjects == sj.rank_filters(JOB, 2)
