"""`ddpbus delete-job`: a finished job's broker state goes, a neighbour's stays, and a
running or unfinished job is refused with nothing deleted."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from jobs import CLI, delete_job, spec, start_job
from nats.aio.client import Client

from ddpbus.codecs import subjects as sj
from ddpbus.orchestrator.runtime.nats_server import EmbeddedBroker
from ddpbus.orchestrator.runtime.provision import ensure_job
from ddpbus.orchestrator.tools import delete_job as teardown
from ddpbus.orchestrator.transport.bus import connect

pytestmark = pytest.mark.timeout(240)


async def _streams(url: str) -> set[str]:
    nc = await connect(url, name="test-streams")
    try:
        return {s.config.name or "" for s in await nc.jetstream().streams_info()}
    finally:
        await nc.close()


def streams(url: str) -> set[str]:
    return asyncio.run(_streams(url))


async def _provision(url: str, job: str) -> None:
    nc = await connect(url, name="test-provision")
    try:
        await ensure_job(nc.jetstream(), job, 1)
    finally:
        await nc.close()


def test_a_finished_job_is_deleted_and_its_neighbour_kept(broker: EmbeddedBroker,
                                                          tmp_path: Path) -> None:
    job = start_job(broker.url, tmp_path / "run", spec("chaos"), workers=1, job="gone",
                    env={"LEDGER_DIR": str(tmp_path), "CHAOS_EPOCHS": "2"})
    job.wait()
    # a job whose KV bucket is named like "gone"'s rounds Object Store: not "gone"'s
    asyncio.run(_provision(broker.url, "gone_rounds"))
    neighbour = {sj.stream_name("gone_rounds"), sj.kv_stream("gone_rounds")}
    before = streams(broker.url)
    owned = {name for _, name in teardown.owned("gone")} & before
    assert {sj.stream_name("gone"), sj.kv_stream("gone"),
            f"OBJ_{sj.bundles_bucket('gone')}"} <= owned  # bundles were written
    assert neighbour <= before

    dry = delete_job(broker.url, "gone", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.count("would delete ") == len(owned), dry.stdout
    assert f"would delete stream {sj.stream_name('gone')} (" in dry.stdout
    assert streams(broker.url) == before

    out = delete_job(broker.url, "gone")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("deleted ") == len(owned), out.stdout
    assert f"deleted KV bucket {sj.kv_stream('gone')} (" in out.stdout
    assert streams(broker.url) == before - owned
    assert neighbour <= streams(broker.url)

    again = delete_job(broker.url, "gone")
    assert again.returncode == 1
    assert "the broker holds no job 'gone'" in again.stderr
    status = subprocess.run([*CLI, "status", "--job", "gone", "--nats", broker.url,
                             "--key-file", str(tmp_path / "run" / "job.key")],
                            capture_output=True, text=True, timeout=60, check=False)
    assert status.returncode == 1
    assert "holds no job 'gone'" in status.stderr


async def _beat(nc: Client, subject: str, stop: asyncio.Event) -> None:
    """A rank's beacon until ``stop`` (every 0.2 s: a rank beats once a second)."""
    while not stop.is_set():
        await nc.publish(subject, b"beat")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.2)


async def _refusals(url: str, job: str) -> None:
    await _provision(url, job)
    before = await _streams(url)
    # unfinished (no summary): refused unless forced
    with pytest.raises(teardown.JobUnfinished, match="has not finished"):
        await teardown.delete(url, job, listen=0.3)
    nc = await connect(url, name="test-refusals")
    try:
        kv = await nc.jetstream().key_value(sj.kv_bucket(job))
        # a coordinator holds the lease: refused even when forced
        await kv.put(sj.LEASE_KEY, json.dumps({"holder": "coord-a",
                                            "expires": time.time() + 30}).encode())
        with pytest.raises(teardown.JobRunning, match="coordinator coord-a holds its lease"):
            await teardown.delete(url, job, force=True, listen=0.3)
        # the lease ran out but a rank still beats: refused even when forced
        await kv.put(sj.LEASE_KEY, json.dumps({"holder": "coord-a",
                                            "expires": time.time() - 1}).encode())
        stop = asyncio.Event()
        beating = asyncio.create_task(_beat(nc, f"ddpbus.{job}.live.rank.0", stop))
        with pytest.raises(teardown.JobRunning, match=rf"beats on ddpbus\.{job}\.live\.rank\.0"):
            await teardown.delete(url, job, force=True, listen=1.0)
        stop.set()
        await beating
        assert await _streams(url) == before  # nothing was deleted by any refusal
        # quiet and expired: forced, it goes
        lines = await teardown.delete(url, job, force=True, listen=0.3)
    finally:
        await nc.close()
    # in order: the stream first, the KV bucket (summary, lease) last
    assert [line.split(" (")[0] for line in lines] == [
        f"deleted {what} {name}" for what, name in teardown.owned(job)]
    assert lines[0].startswith(f"deleted stream {sj.stream_name(job)}")
    assert lines[-1].startswith(f"deleted KV bucket {sj.kv_stream(job)}")
    assert not {name for _, name in teardown.owned(job)} & await _streams(url)


def test_a_running_or_unfinished_job_is_refused(broker: EmbeddedBroker) -> None:
    asyncio.run(_refusals(broker.url, "crashed"))


def test_bad_flags_are_refused(broker: EmbeddedBroker) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPBUS_")}
    out = subprocess.run([*CLI, "delete-job", "--nats", broker.url], capture_output=True,
                         text=True, timeout=60, env=env, check=False)
    assert out.returncode == 2
    assert "delete-job needs --job" in out.stderr
    bad = delete_job(broker.url, "no.dots")
    assert bad.returncode == 2
    assert "must be 1-64 characters" in bad.stderr
