"""An outside decoder agrees: what ddpbus published to a real nats-server, captured by a raw
nats-py subscriber, decodes with `protoc --decode=ddpbus.v1.<Message>` to the expected text."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from nats.aio.client import Client
from nats.aio.msg import Msg

from ddpbus.codecs import Encoder
from ddpbus.codecs import messages as m
from ddpbus.codecs import subjects as sj
from ddpbus.orchestrator.runtime.provision import ensure_job
from ddpbus.orchestrator.transport.bus import publish, publish_core

ROOT = Path(__file__).resolve().parents[2]
JOB = "capture"
KEY = b"capture-key-0123456789abcdef"

CASES: list[tuple[str, str, m.Message, str, str]] = [
    ("rank-1", sj.TIMING_RANK.subject(JOB, 1),
     m.Batch(rank=1, batch_ms=12.5, data_ms=0.25, step_count=42, batch_loss=0.5),
     "ddpbus.v1.TimingMsg",
     "batch {\n  rank: 1\n  batch_ms: 12.5\n  data_ms: 0.25\n  step_count: 42\n"
     "  batch_loss: 0.5\n}\n"),
    ("coordinator", sj.CONTROL_RANK.subject(JOB, 0),
     m.StartEpoch(plan=m.EpochPlan(epoch=3, partition_offset=640, partition_size=320)),
     "ddpbus.v1.ControlMsg",
     "start_epoch {\n  plan {\n    epoch: 3\n    partition_offset: 640\n"
     "    partition_size: 320\n  }\n}\n"),
    ("coordinator", sj.CONTROL_ALL.subject(JOB),
     m.ShutdownWithSave(reason=m.SaveReason.SINGLE_SURVIVOR), "ddpbus.v1.ControlMsg",
     "shutdown_with_save {\n  reason: SAVE_REASON_SINGLE_SURVIVOR\n}\n"),
    ("coordinator", sj.CONTROL_ALL.subject(JOB),
     m.Checkpoint(version=7, target_rank=2**64 - 2), "ddpbus.v1.ControlMsg",
     "checkpoint {\n  version: 7\n  target_rank: 18446744073709551614\n}\n"),
    ("rank-0", sj.METRICS_RANK.subject(JOB, 0),
     m.MetricsMsg(rank=0, epoch=1, avg_loss=0.75, batches_processed=4, epoch_ms=100.0,
                  samples_processed=128, scalars={"acc": m.ScalarSum(sum=3.0, count=4)}),
     "ddpbus.v1.MetricsMsg",
     "epoch: 1\navg_loss: 0.75\nbatches_processed: 4\nepoch_ms: 100\n"
     "samples_processed: 128\nscalars {\n  key: \"acc\"\n  value {\n    sum: 3\n    count: 4\n"
     "  }\n}\n"),
    ("rank-0", sj.LIVE_RANK.subject(JOB, 0), m.Heartbeat(rank=0, step_count=9),
     "ddpbus.v1.TimingMsg", "heartbeat {\n  step_count: 9\n}\n"),
]


def protoc_decode(message: str, payload: bytes) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"--decode={message}",
         f"-I{ROOT / 'codecs' / 'proto'}", "ddpbus/v1/ddpbus.proto"],
        input=payload, capture_output=True, check=True, timeout=60)
    return out.stdout.decode()


async def test_protoc_decodes_what_ddpbus_published(nc: Client) -> None:
    await ensure_job(nc.jetstream(), JOB, 2)
    captured: list[Msg] = []
    done = asyncio.Event()

    async def on_msg(msg: Msg) -> None:
        captured.append(msg)
        if len(captured) == len(CASES):
            done.set()

    raw = await nc.subscribe(f"ddpbus.{JOB}.>", cb=on_msg)
    encoders = {s: Encoder(job=JOB, key=KEY, sender=s, generation=5)
                for s in ("rank-0", "rank-1", "coordinator")}
    for sender, subject, msg, _, _ in CASES:
        out = encoders[sender].encode(subject, msg)
        if subject.startswith(f"ddpbus.{JOB}.live."):
            await publish_core(nc, out)
        else:
            await publish(nc.jetstream(), out)
    await asyncio.wait_for(done.wait(), 10)
    await raw.unsubscribe()

    for got, (_, subject, msg, proto_name, expected) in zip(captured, CASES, strict=True):
        assert got.subject == subject
        assert got.headers is not None
        assert got.headers[sj.H_TYPE].endswith(type(msg).__name__)
        assert got.headers[sj.H_GEN] == "5"
        assert got.headers[sj.H_CONTENT_TYPE] == sj.CONTENT_PROTOBUF
        assert protoc_decode(proto_name, got.data) == expected
