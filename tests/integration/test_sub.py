"""`ddpbus sub` on a recorded stream: golden output, filters, JSON lines, refusals."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddpbus.codecs import Encoder
from ddpbus.codecs import messages as m
from ddpbus.codecs import subjects as sj
from ddpbus.codecs.envelope import Signer
from ddpbus.orchestrator.runtime.nats_server import EmbeddedBroker
from ddpbus.orchestrator.runtime.provision import ensure_job
from ddpbus.orchestrator.transport.bus import connect

KEY = b"golden-stream-job-key-0123456789"
GOLDEN = Path(__file__).resolve().parent / "golden"
CLI = [sys.executable, "-m", "ddpbus.orchestrator.tools.cli", "sub"]
STAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")
UPDATE = os.environ.get("DDPTEST_UPDATE_GOLDEN") == "1"


async def record(url: str) -> None:
    """A fixed little run's traffic, plus a forged, a foreign and a garbled message."""
    nc = await connect(url, name="recorder")
    js = nc.jetstream()
    await ensure_job(js, "rec", 2)
    rank0 = Encoder(job="rec", key=KEY, sender="rank-0", generation=1)
    rank1 = Encoder(job="rec", key=KEY, sender="rank-1", generation=2)
    coord = Encoder(job="rec", key=KEY, sender=sj.COORDINATOR, generation=1)
    forger = Encoder(job="rec", key=b"not-the-job-key-at-all-0123456", sender="rank-1",
                     generation=3)
    outs = [
        rank0.encode(sj.JOIN_RANK.subject("rec", 0), m.Hello(
            rank=0, generation=1, host="gpu-a", device="cuda:0", world_size=2,
            model_signature=b"\x01" * m.MODEL_SIGNATURE_BYTES, backend="nccl",
            dataset_size=1438)),
        coord.encode(sj.CONTROL_ALL.subject("rec"), m.SetGlobalStep(
            global_step=40, step_budget=(20, 20))),
        rank0.encode(sj.TIMING_RANK.subject("rec", 0), m.Batch(
            rank=0, batch_ms=1.25, data_ms=0.5, step_count=1, batch_loss=2.302585)),
        rank1.encode(sj.TIMING_RANK.subject("rec", 1), m.SyncAck(
            rank=1, step_count=20, divergence=0.0125)),
        rank0.encode(sj.METRICS_RANK.subject("rec", 0), m.MetricsMsg(
            rank=0, epoch=0, avg_loss=1.5, batches_processed=20, epoch_ms=31.5,
            samples_processed=640)),
        forger.encode(sj.TIMING_RANK.subject("rec", 1), m.Exiting(rank=1)),
    ]
    for out in outs:
        await js.publish(out.subject, out.payload, headers=out.headers)
    # signed with the job key, but not a TimingMsg: malformed
    bad = rank0.encode(sj.TIMING_RANK.subject("rec", 0), m.Exiting(rank=0))
    payload = b"\xff\x00garbage"
    headers = dict(bad.headers)
    headers[sj.H_SIG] = Signer(KEY).sign(bad.subject, headers[sj.H_TYPE], headers[sj.H_GEN],
                                         headers[sj.H_MSG_ID], headers[sj.H_CONTENT_TYPE],
                                         payload)
    await js.publish(bad.subject, payload, headers=headers)
    await js.publish(sj.TIMING_RANK.subject("rec", 1), b"hello", headers={"x": "y"})
    reports = rank0.encode(sj.TIMING_RANK.subject("rec", 0), m.Reports(rank=0, items=(
        m.Batch(rank=0, batch_ms=1.5, data_ms=0.25, step_count=2, batch_loss=2.25),
        m.LrUpdate(rank=0, lr=0.05),
        m.Batch(rank=0, batch_ms=2.5, data_ms=0.25, step_count=3, batch_loss=2.0))))
    await js.publish(reports.subject, reports.payload, headers=reports.headers)
    await nc.close()


def sub(url: str, tmp: Path, *args: str) -> str:
    key = tmp / "job.key"
    key.write_bytes(KEY)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPBUS_")}
    out = subprocess.run([*CLI, "--job", "rec", "--nats", url, "--key-file", str(key), *args],
                         capture_output=True, text=True, timeout=60, env=env, check=False)
    assert out.returncode == 0, out.stderr
    return STAMP.sub("<time>", out.stdout)


def golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.write_text(text)
    assert text == path.read_text(), f"differs from {path} (DDPTEST_UPDATE_GOLDEN=1 rewrites)"


@pytest.fixture
def recorded(broker: EmbeddedBroker) -> str:
    asyncio.run(record(broker.url))
    return broker.url


def test_the_recorded_stream_reads_as_its_golden_text(recorded: str, tmp_path: Path) -> None:
    golden("sub.txt", sub(recorded, tmp_path, "--since", "1"))


def test_json_lines_and_filters(recorded: str, tmp_path: Path) -> None:
    golden("sub.jsonl", sub(recorded, tmp_path, "--since", "1", "--json"))
    lines = [json.loads(x) for x in sub(recorded, tmp_path, "--since", "1", "--json",
                                        "--rank", "0", "--type", "Batch").splitlines()]
    assert [(x["type"], x["rank"]) for x in lines] == [("TimingMsg.Batch", 0)]
    assert lines[0]["message"]["batch_loss"] == 2.302585
    assert sub(recorded, tmp_path, "--since", "4", "--count", "2").count("\n") == 2
    only_control = sub(recorded, tmp_path, "ddpbus.rec.control.>", "--since", "1")
    assert only_control.count("\n") == 1
    assert "ControlMsg.SetGlobalStep" in only_control
    assert sub(recorded, tmp_path, "--since", "1m").count("\n") == 9  # by age: all of it
    (coalesced,) = [json.loads(x) for x in sub(recorded, tmp_path, "--since", "1", "--json",
                                               "--type", "Reports").splitlines()]
    assert [(x["type"], x.get("step_count"), x.get("lr")) for x in
            coalesced["message"]["items"]] == [("Batch", 2, None), ("LrUpdate", None, 0.05),
                                               ("Batch", 3, None)]
    assert sub(recorded, tmp_path, "--since", "2099-01-01T00:00:00Z") == ""  # by time


@pytest.mark.parametrize(("args", "message"), [
    (["--type", "Batchh"], "did you mean 'Batch'?"),
    (["--since", "yesterday"], "--since 'yesterday'"),
    (["--since", "0"], "start at 1"),
    (["--follow"], "--follow goes with --since"),
    (["ddpbus.other.>"], "is not in job 'rec'"),
])
def test_bad_flags_are_refused(broker: EmbeddedBroker, tmp_path: Path, args: list[str],
                               message: str) -> None:
    key = tmp_path / "job.key"
    key.write_bytes(KEY)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPBUS_")}
    out = subprocess.run([*CLI, "--job", "rec", "--nats", broker.url, "--key-file", str(key),
                          *args], capture_output=True, text=True, timeout=60, env=env,
                         check=False)
    assert out.returncode == 2
    assert message in out.stderr


def test_live_messages_are_shown_as_they_come(broker: EmbeddedBroker, tmp_path: Path) -> None:
    key = tmp_path / "job.key"
    key.write_bytes(KEY)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPBUS_")}
    proc = subprocess.Popen([*CLI, "--job", "rec", "--nats", broker.url, "--key-file",
                             str(key), "--json", "--count", "2", "--rank", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    async def publish_until_it_has_seen_two() -> None:
        nc = await connect(broker.url, name="live-publisher")
        rank0 = Encoder(job="rec", key=KEY, sender="rank-0", generation=1)
        rank1 = Encoder(job="rec", key=KEY, sender="rank-1", generation=1)
        step, deadline = 0, asyncio.get_running_loop().time() + 30
        while proc.poll() is None:  # until it has printed two and exited
            assert asyncio.get_running_loop().time() < deadline, "sub never saw two messages"
            step += 1
            for enc, rank in ((rank0, 0), (rank1, 1)):
                beat = m.Heartbeat(rank=rank, step_count=step)
                out = enc.encode(sj.LIVE_RANK.subject("rec", rank), beat)
                await nc.publish(out.subject, out.payload, headers=out.headers)
            await asyncio.sleep(0.05)  # publish interval while waiting for it to subscribe
        await nc.close()

    try:
        asyncio.run(publish_until_it_has_seen_two())
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    lines = [json.loads(x) for x in stdout.splitlines()]
    assert [(x["type"], x["rank"], x["seq"]) for x in lines] == [
        ("TimingMsg.Heartbeat", 1, None)] * 2
