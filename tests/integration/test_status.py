"""`ddpbus status` against a live 2-worker run, then the finished one."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from jobs import KEY, Job, chaos_job, delete_job, spec, start_job, wait_for

from ddpbus.codecs import subjects as sj
from ddpbus.orchestrator.runtime.coordinator import EXIT_FINISHED
from ddpbus.orchestrator.runtime.nats_server import BrokerConfig, EmbeddedBroker
from ddpbus.orchestrator.transport.bus import connect

pytestmark = pytest.mark.timeout(240)
CLI = [sys.executable, "-m", "ddpbus.orchestrator.tools.cli", "status"]


def status(url: str, key_file: Path, *args: str, job: str = "watched"
           ) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPBUS_")}
    return subprocess.run([*CLI, "--job", job, "--nats", url, "--key-file", str(key_file),
                           *args], capture_output=True, text=True, timeout=60, env=env,
                          check=False)


def doc(url: str, key_file: Path) -> dict[str, Any]:
    out = status(url, key_file, "--json")
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


EPOCHS = 30


async def _forget_summary(url: str, job: str) -> None:
    nc = await connect(url, name="test-forget-summary")
    kv = await nc.jetstream().key_value(sj.kv_bucket(job))
    await kv.purge(sj.SUMMARY_KEY)
    await nc.close()


def _after_the_end(job: Job, url: str, key_file: Path) -> None:
    """The finished job: consumers gone, and processes started again stop at once."""
    # the run is over: its durable consumers are gone (the stream, bucket and bundles stay)
    end = doc(url, key_file)
    assert end["stream"]["consumers"] == 0
    assert end["stream"]["coordinator_pending"] is None
    assert "0 consumers; no coordinator consumer (the run is over)" in status(
        url, key_file).stdout
    # a rank started again (a pod restarted after the end) finds the summary instead of
    # its consumer and stops at once, successfully; a coordinator started again (a
    # reinstall on the same store) leaves the job as it found it and fails loudly: it
    # trained nothing, and says how to train again
    try:
        late = job.respawn("rank-0", "rank-0-late")
        assert late.wait(60) == 0, job.log("rank-0-late")
        assert "is over (its coordinator wrote the run's summary): nothing to join" in \
            job.log("rank-0-late")
        again = job.respawn("coordinator", "coordinator-again")
        assert again.wait(60) == EXIT_FINISHED, job.log("coordinator-again")
        assert (f"job {job.name} already ran to its end (its summary is stored): nothing "
                "to train. To train again, name a new job") in job.log("coordinator-again")
        assert f"ddpbus delete-job --job {job.name}" in job.log("coordinator-again")
        # it provisioned nothing (no consumers made only to be deleted again)
        assert "deleted 0 consumers" in job.log("coordinator-again")
        # a run whose summary never got stored (the broker gone at the very end) is told
        # over by its final snapshot: what provisioning made on the way is deleted again
        asyncio.run(_forget_summary(url, job.name))
        last = job.respawn("coordinator", "coordinator-snapshot")
        assert last.wait(60) == EXIT_FINISHED, job.log("coordinator-snapshot")
        assert f"job {job.name} already ran to its end: nothing to train" in job.log(
            "coordinator-snapshot")
        assert f"deleted {job.workers + 1} consumers" in job.log("coordinator-snapshot")
    finally:
        job.kill()
    assert doc(url, key_file)["stream"]["consumers"] == 0


def test_status_of_a_live_run_and_of_its_end(broker: EmbeddedBroker, tmp_path: Path) -> None:
    # long enough to still be training between two status calls on a loaded machine (with
    # coalesced reports 8 epochs could end in between)
    job, _ = chaos_job(broker.url, tmp_path, "watched", epochs=EPOCHS, slowdown=3)
    key_file = tmp_path / "job.key"
    try:
        # a hot standby (the chart's coordinator.replicas=2) waits out the whole run, then
        # ends with it, successfully (job.wait below wants every process to exit 0)
        wait_for("the leader's lease", lambda: "holding the coordinator lease" in
                 job.log("coordinator"), 60)
        job.spawn("standby", [*job.argv["coordinator"], "--standby"])
        deadline = time.monotonic() + 120
        while True:  # until the run is training with a checkpoint behind it
            out = status(broker.url, key_file, "--json")
            if out.returncode == 0:
                d = json.loads(out.stdout)
                if d.get("phase") == "training" and d.get("last_checkpoint"):
                    break
            else:  # the coordinator has not made the job yet
                assert "holds no job" in out.stderr, out.stderr
            assert time.monotonic() < deadline, out.stdout + out.stderr
        assert d["global_step"] > 0
        assert d["rounds"] > 0
        assert d["alive"] == d["world_size"] == 2
        assert [(r["rank"], r["state"], r["generation"]) for r in d["members"]] == [
            (0, "alive", 1), (1, "alive", 1)]
        assert all(r["last_heard_s_ago"] < 5 for r in d["members"])
        assert abs(sum(r["batch_share"] for r in d["members"]) - 1) < 1e-3
        assert d["anchor"] >= 1
        assert d["lease"]["holder"]
        assert d["lease"]["expires_in_s"] > 0
        assert d["last_checkpoint"]["version"] >= 1
        assert d["stream"]["messages"] > 0
        text = status(broker.url, key_file)
        assert text.returncode == 0, text.stderr
        for needle in ("job watched: training", "global step", "El Che: anchor",
                       "last checkpoint: bundle v", "lease: "):
            assert needle in text.stdout, text.stdout
        # the running job cannot be deleted, forced or not, and its record stays
        refused = delete_job(broker.url, "watched", "--force")
        assert refused.returncode == 1
        assert "job 'watched' is running: coordinator " in refused.stderr
        assert "nothing was deleted" in refused.stderr
        # a leader starved past its lease TTL (a loaded machine) is deposed by the standby,
        # which finishes the run: legitimate, so which of the two ends it is not asserted,
        # only that the ranks and the one that ended the run exit 0 and a deposed one 3
        for p in job.procs.values():
            p.wait(180)
        codes = {n: p.returncode for n, p in job.procs.items()}
        assert {n: c for n, c in codes.items() if n.startswith("rank")} == {
            "rank-0": 0, "rank-1": 0}, job.dump()
        assert sorted((codes["coordinator"], codes["standby"])) in ([0, 0], [0, 3]), job.dump()
    finally:
        job.kill()
    end = doc(broker.url, key_file)
    assert end["phase"] == "done"
    assert end["outcome"]["ok"]
    assert end["summary"]["ok"]
    assert end["last_checkpoint"]["version"] == EPOCHS
    assert end["lease"] is None
    if codes["coordinator"] == 0:  # the leader ended the run: the standby just stops
        assert "job watched ran to its end under another coordinator; this standby is " \
            "done" in job.log("standby")
    _after_the_end(job, broker.url, key_file)


def test_status_refuses_an_unknown_job_and_a_wrong_key(broker: EmbeddedBroker,
                                                      tmp_path: Path) -> None:
    key_file = tmp_path / "job.key"
    key_file.write_bytes(KEY)
    out = status(broker.url, key_file, job="nobody")
    assert out.returncode == 1
    assert "no job 'nobody'" in out.stderr
    with EmbeddedBroker(BrokerConfig(store_dir=tmp_path / "s2")) as other:
        job = start_job(other.url, tmp_path / "run", spec("chaos"), workers=1, job="watched",
                        env={"LEDGER_DIR": str(tmp_path), "CHAOS_EPOCHS": "1"})
        job.wait()
        wrong = tmp_path / "wrong.key"
        wrong.write_bytes(b"a-different-job-key-0123456789")
        out = status(other.url, wrong)
    assert out.returncode == 1
    assert "snapshot signature does not match the job key" in out.stderr
