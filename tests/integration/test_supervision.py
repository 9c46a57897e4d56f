"""A coordinator or worker task that dies of an unexpected exception ends its process (a
non-zero exit, the task named in the log) instead of leaving a zombie that beacons while
it no longer reads, decides or publishes; and a job whose coordinator read messages but
decided nothing (no snapshot) can still be started again. Real processes, real broker."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from pathlib import Path

import pytest
from jobs import KEY, Job, chaos_job, freeze, spec, start_job, wait_for
from nats.js.errors import NotFoundError

from ddpbus.codecs import Encoder
from ddpbus.codecs import messages as m
from ddpbus.codecs import subjects as sj
from ddpbus.orchestrator.persist import lease
from ddpbus.orchestrator.runtime.nats_server import EmbeddedBroker
from ddpbus.orchestrator.transport.bus import connect, publish

pytestmark = pytest.mark.timeout(300)

CHAOS = {"CHAOS_EPOCHS": "1"}


def _lease_holder(url: str, job: str) -> lease.Holder | None:
    async def read() -> lease.Holder | None:
        nc = await connect(url, name="lease-reader")
        try:
            kv = await nc.jetstream().key_value(sj.kv_bucket(job))
            return await lease.read(kv)
        finally:
            await nc.close()
    return asyncio.run(read())


def _exits(job: Job, name: str, within: float) -> int:
    proc = job.procs[name]
    try:
        return proc.wait(within)
    except subprocess.TimeoutExpired:
        job.kill()
        raise AssertionError(f"{name} still running {within:.0f}s on\n{job.dump()}") from None


def test_a_coordinator_whose_task_fails_exits_and_a_successor_takes_over(
        broker: EmbeddedBroker, tmp_path: Path) -> None:
    # --events on a full disk: the first event record (the rank's admission, decided in
    # the stream reader) raises OSError(ENOSPC). The coordinator must not go on beaconing
    # and holding the lease with nobody reading the stream
    job = start_job(broker.url, tmp_path, spec("chaos"), workers=1, job="full",
                    coordinator_args=["--events", "/dev/full"],
                    env={"LEDGER_DIR": str(tmp_path), **CHAOS})
    try:
        code = _exits(job, "coordinator", 90)
        log = job.log("coordinator")
        assert code == 1, log
        assert "coordinator task stream-reader failed: OSError" in log, log
        assert "No space left on device" in log
        assert _lease_holder(broker.url, "full") is None  # released: no wait for its TTL
        # the same command, its disk no longer full, takes over at once and trains the
        # waiting rank (its Hello read again: nothing had been decided) to the end
        argv = list(job.argv["coordinator"])
        at = argv.index("/dev/full")
        del argv[at - 1:at + 1]
        failed = job.procs.pop("coordinator")
        job.spawn("coordinator-b", argv)
        summary = job.wait(180)
    finally:
        job.kill()
    assert failed.returncode == 1
    assert summary["ok"], summary
    assert "waiting for the coordinator lease" not in job.log("coordinator-b")


def test_a_rank_whose_control_reader_fails_exits(broker: EmbeddedBroker,
                                                 tmp_path: Path) -> None:
    # (the coordinator waits for it: the test ends it)
    job = start_job(broker.url, tmp_path, spec("faulty_agent"), workers=1, job="faulty",
                    env={"LEDGER_DIR": str(tmp_path), **CHAOS})
    try:
        wait_for("the rank's admission", lambda: "admitted" in job.log("rank-0"), 90)
        code = _exits(job, "rank-0", 45)
    finally:
        job.kill()
    log = job.log("rank-0")
    assert code == 1, log
    assert ("rank 0: task control-reader failed: RuntimeError: injected: a bug in handling "
            "a control message") in log, log
    assert "rank 0: failed (task control-reader failed" in log, log


async def _refuse_publishes(url: str, job: str, proc: str) -> None:
    """Make the job's stream refuse what ``proc`` publishes from now on: a rank's reports
    (a message size limit below theirs: an error answer) or the coordinator's control
    messages (no longer a stream subject: no answer). Each is retried, then given up."""
    nc = await connect(url, name="stream-editor")
    try:
        js = nc.jetstream()
        config = (await js.stream_info(sj.stream_name(job))).config
        if proc == "coordinator":
            config.subjects = [x for x in config.subjects or [] if ".control." not in x]
        else:
            config.max_msg_size = 32
        await js.update_stream(config)
    finally:
        await nc.close()


@pytest.mark.parametrize("proc", ["rank-0", "coordinator"])
def test_a_process_whose_publish_is_given_up_exits(broker: EmbeddedBroker, tmp_path: Path,
                                                    proc: str) -> None:
    # a process whose publisher gave a message up (not stored after its retry deadline)
    # must end at once, not go on with a gap nobody hears of until its exit
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    fault = "publish-worker" if proc == "rank-0" else "publish-coordinator"
    job = start_job(broker.url, tmp_path, spec("faulty_agent"), workers=1, job="refused",
                    worker_args={0: ["--slowdown", "3"]},
                    env={"LEDGER_DIR": str(ledger), "CHAOS_EPOCHS": "30", "FAULT": fault})
    try:
        wait_for("training", (ledger / "rank-0.txt").exists, 90)
        asyncio.run(_refuse_publishes(broker.url, "refused", proc))
        code = _exits(job, proc, 60)
    finally:
        job.kill()
    log = job.log(proc)
    assert code == 1, log
    task = "rank 0: task" if proc == "rank-0" else "coordinator task"
    assert f"{task} publisher failed: PublishFailed:" in log, log
    assert "not stored after 2s" in log, log


async def _wrong_key_hello(url: str, job: str) -> int:
    """A Hello for rank 0 signed with another key, stored once the coordinator made the
    job; its stream sequence."""
    nc = await connect(url, name="impostor")
    try:
        js = nc.jetstream()
        # (another generation than the real rank's 1: the same message id would make
        # JetStream drop the real Hello as a copy of this one)
        forger = Encoder(job=job, key=b"not-the-job-key-0123456789abcdef", sender="rank-0",
                         generation=99)
        hello = m.Hello(rank=0, generation=99, host="elsewhere", device="cpu",
                        model_signature=bytes(32), world_size=1)
        for _ in range(600):
            try:
                await js.consumer_info(sj.stream_name(job), sj.COORDINATOR_CONSUMER)
                break
            except NotFoundError:  # not made yet: poll
                await asyncio.sleep(0.1)  # poll interval of a deadline-bound wait (60 s)
        ack = await publish(js, forger.encode(sj.JOIN_RANK.subject(job, 0), hello))
        return int(ack.seq)
    finally:
        await nc.close()


async def _acked(url: str, job: str, seq: int) -> bool:
    nc = await connect(url, name="consumer-reader")
    try:
        info = await nc.jetstream().consumer_info(sj.stream_name(job),
                                                  sj.COORDINATOR_CONSUMER)
        return info.ack_floor is not None and (info.ack_floor.stream_seq or 0) >= seq
    finally:
        await nc.close()


def test_a_job_whose_coordinator_died_before_deciding_anything_starts_again(
        broker: EmbeddedBroker, tmp_path: Path) -> None:
    # the coordinator reads and acks a forged Hello (dropped: bad signature, no command, so
    # no snapshot) and dies before any rank joins; started again it must run the job, not
    # refuse it for "progress but no snapshot"
    key_file = tmp_path / "job.key"
    key_file.write_bytes(KEY)
    common = ["--job", "early", "--nats", broker.url, "--key-file", str(key_file),
              "--world-size", "1"]
    job = Job("early", broker.url, tmp_path, 1)
    job.environ = {k: v for k, v in os.environ.items()
                   if not k.startswith("DDPBUS_")} | {"LEDGER_DIR": str(tmp_path), **CHAOS}
    chaos = spec("chaos")
    job.spawn("coordinator", ["coordinator", *common, "--summary",
                              str(tmp_path / "summary.json"), "--events",
                              str(tmp_path / "events.jsonl"), chaos])
    try:
        seq = asyncio.run(_wrong_key_hello(broker.url, "early"))
        wait_for("the forged Hello read and acked",
                 lambda: asyncio.run(_acked(broker.url, "early", seq)), 60)
        assert "bad-signature" in job.log("coordinator")
        first = job.procs.pop("coordinator")
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        job.spawn("coordinator-b", job.argv["coordinator"])
        job.spawn("rank-0", ["worker", *common, "--rank", "0", "--out", str(job.out),
                             "--torch-threads", "1", chaos])
        summary = job.wait(180)
    finally:
        job.kill()
    assert summary["ok"], summary
    assert summary["decode_rejections"] == {"bad-signature": 1}
    assert "reading it again from the start" in job.log("coordinator-b")


def test_a_rank_whose_coordinator_falls_silent_exits(broker: EmbeddedBroker,
                                                     tmp_path: Path) -> None:
    """CoordHeartbeat stops (the coordinator frozen: its connection stays up, it says
    nothing): the rank gives up after the run's coordinator_timeout and exits non-zero,
    rather than wait on a run nobody leads."""
    job, ledger = chaos_job(broker.url, tmp_path, "silent", epochs=30, slowdown=3, workers=1,
                            coordinator_args=["--knob", "coordinator_timeout=2"])
    try:
        wait_for("training", (ledger / "rank-0.txt").exists, 90)
        freeze(job.procs["coordinator"].pid)
        # 2 s of silence, checked every 0.5 s; the rest is the halt and the process's exit
        code = job.procs["rank-0"].wait(timeout=60)
    finally:
        job.kill()  # SIGKILL reaches a stopped process
    log = job.log("rank-0")
    assert code != 0, log
    assert "no word from the coordinator for" in log, log
    assert "coordinator silent for" in log, log
