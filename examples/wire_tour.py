"""A tour of the ddpbus wire on a real embedded broker: `python examples/wire_tour.py`.

Starts `nats-server` with JetStream, creates a job's stream, bucket and consumers, then
plays one exchange of the protocol: a rank says Hello and reports a Batch and its
MetricsMsg; the coordinator broadcasts SetGlobalStep and sends the rank its StartEpoch.
Each side reads its durable consumer and decodes what it got; a forged and a stale message
are refused. (`make demo` trains examples/digits.py; this shows the wire underneath.)
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import sys

from ddpbus.codecs import DecodeError, Decoder, Encoder
from ddpbus.codecs import messages as m
from ddpbus.codecs import subjects as sj
from ddpbus.orchestrator.runtime.nats_server import EmbeddedBroker
from ddpbus.orchestrator.runtime.provision import ensure_job
from ddpbus.orchestrator.transport.bus import connect, publish

JOB = "wire-tour"


def say(text: str) -> None:
    sys.stdout.write(text + "\n")


async def tour(url: str) -> None:
    key = secrets.token_bytes(32)
    nc = await connect(url, name="wire-tour")
    js = nc.jetstream()
    res = await ensure_job(js, JOB, world_size=1)
    say(f"job {JOB}: stream {res.stream}, bucket {res.bucket}, consumers {res.consumers}")

    rank = Encoder(job=JOB, key=key, sender="rank-0", generation=1)
    coord = Encoder(job=JOB, key=key, sender="coordinator", generation=1, wire_json=True)
    signature = hashlib.sha256(b"digits-mlp").digest()
    for out in (
        rank.encode(sj.JOIN_RANK.subject(JOB, 0), m.Hello(
            rank=0, generation=1, host="localhost", device="cpu", model_signature=signature,
            world_size=1, backend="gloo")),
        rank.encode(sj.TIMING_RANK.subject(JOB, 0), m.Batch(
            rank=0, batch_ms=3.2, data_ms=0.4, step_count=1, batch_loss=2.3)),
        rank.encode(sj.METRICS_RANK.subject(JOB, 0), m.MetricsMsg(
            rank=0, epoch=0, avg_loss=2.3, batches_processed=1, epoch_ms=3.6,
            samples_processed=32)),
        coord.encode(sj.CONTROL_ALL.subject(JOB), m.SetGlobalStep(global_step=1)),
        coord.encode(sj.CONTROL_RANK.subject(JOB, 0), m.StartEpoch(
            plan=m.EpochPlan(epoch=1, partition_offset=0, partition_size=1797))),
    ):
        ack = await publish(js, out)
        say(f"  published seq {ack.seq:>2} {out.subject:<34} {out.headers[sj.H_TYPE]}"
            f" ({out.headers[sj.H_CONTENT_TYPE]}, {len(out.payload)} B)")

    decoder = Decoder(job=JOB, key=key, generation_floor=lambda sender: 1)
    for durable in (sj.COORDINATOR_CONSUMER, sj.rank_consumer(0)):
        sub = await js.pull_subscribe_bind(durable=durable, stream=res.stream)
        for msg in await sub.fetch(10, timeout=2):
            env = decoder.decode(msg.subject, msg.headers, msg.data)
            say(f"  {durable:<11} got {env.msg_type:<25} from {env.sender}: {env.message}")
            await msg.ack()

    forged = Encoder(job=JOB, key=secrets.token_bytes(32), sender="rank-0", generation=1)
    stale = Encoder(job=JOB, key=key, sender="rank-0", generation=0)
    for name, out in (
        ("forged", forged.encode(sj.TIMING_RANK.subject(JOB, 0), m.Exiting(rank=0))),
        ("stale", stale.encode(sj.TIMING_RANK.subject(JOB, 0), m.Exiting(rank=0))),
    ):
        try:
            decoder.decode(out.subject, out.headers, out.payload)
        except DecodeError as exc:
            say(f"  {name} message refused: {exc}")
    await nc.close()


def main() -> None:
    with EmbeddedBroker() as broker:
        say(f"embedded nats-server at {broker.url}")
        asyncio.run(tour(broker.url))
    say("done: every message decoded, forged and stale ones refused")


if __name__ == "__main__":
    main()
