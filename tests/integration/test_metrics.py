"""The coordinator's Prometheus /metrics, scraped during a run and parsed with
prometheus-client's own parser."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import urllib.request
from pathlib import Path

import pytest
from jobs import KEY, Job, chaos_job
from prometheus_client.parser import text_string_to_metric_families

from ddpbus.codecs import Encoder
from ddpbus.codecs import messages as m
from ddpbus.codecs import subjects as sj
from ddpbus.orchestrator.runtime.nats_server import EmbeddedBroker
from ddpbus.orchestrator.transport.bus import connect

pytestmark = pytest.mark.timeout(240)
SERVING = re.compile(r"serving Prometheus metrics on http://[\d.]+:(\d+)/metrics")


def scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """name -> {sorted labels -> value}, every sample."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted(sample.labels.items()))
            out.setdefault(sample.name, {})[labels] = sample.value
    return out


def _scrape_live(port: int, job: Job) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """A scrape while the run must still be on: a closed endpoint fails with the logs."""
    try:
        return scrape(port)
    except OSError as exc:
        raise AssertionError(f"the endpoint closed mid-run: {exc}\n{job.dump()}") from exc


async def forge(url: str) -> None:
    """Four forgeries, each refused and counted, none changing anything: a rank's Exiting
    signed with the wrong key and one with no signature (the coordinator's), a rank's
    Exiting replayed at generation 0 (below the admitted one) and a Shutdown from a
    coordinator generation 0 (rank 1's fence is the live one's)."""
    nc = await connect(url, name="forger")
    js = nc.jetstream()
    # generations of their own where a real message could share the Nats-Msg-Id
    # (JetStream would drop the real one as a duplicate; per-identity publish permissions
    # stop that where auth is on)
    wrong = Encoder(job="scraped", key=b"not-the-job-key-0123456789abcdef", sender="rank-1",
                    generation=99)
    out = wrong.encode(sj.TIMING_RANK.subject("scraped", 1), m.Exiting(rank=1))
    await js.publish(out.subject, out.payload, headers=out.headers)
    unsigned = wrong.encode(sj.TIMING_RANK.subject("scraped", 1), m.Exiting(rank=1))
    await js.publish(unsigned.subject, unsigned.payload,
                     headers={k: v for k, v in unsigned.headers.items() if k != sj.H_SIG})
    stale = Encoder(job="scraped", key=KEY, sender="rank-1", generation=0)
    out = stale.encode(sj.TIMING_RANK.subject("scraped", 1), m.Exiting(rank=1))
    await js.publish(out.subject, out.payload, headers=out.headers)
    deposed = Encoder(job="scraped", key=KEY, sender="coordinator", generation=0)
    out = deposed.encode(sj.CONTROL_RANK.subject("scraped", 1), m.Shutdown())
    await js.publish(out.subject, out.payload, headers=out.headers)
    await nc.close()


def _two_ranks_training(got: dict[str, dict[tuple[tuple[str, str], ...], float]],
                        job_label: tuple[str, str]) -> None:
    for rank in ("0", "1"):
        labels = (job_label, ("rank", rank))
        assert got["ddpbus_rank_samples_per_second"][labels] > 0
        assert got["ddpbus_rank_batch_seconds"][labels] > 0
        assert got["ddpbus_rank_data_seconds"][labels] >= 0
        assert got["ddpbus_rank_alive"][labels] == 1
        assert got["ddpbus_rank_generation"][labels] == 1
        assert got["ddpbus_rank_window_batches"][labels] >= 1
        assert labels in got["ddpbus_rank_loss"]


def _resources_reported(got: dict[str, dict[tuple[tuple[str, str], ...], float]],
                        job_label: tuple[str, str]) -> None:
    for rank in ("0", "1"):  # each rank's MetricsMsg.resources (CPU workers: no GPU)
        labels = (job_label, ("rank", rank))
        assert got["ddpbus_rank_cpu_ratio"][labels] > 0
        assert 0 < got["ddpbus_rank_resident_memory_bytes"][labels] < got[
            "ddpbus_rank_machine_memory_bytes"][labels]
        assert labels not in got.get("ddpbus_rank_gpu_utilization_ratio", {})


def test_metrics_during_a_run(broker: EmbeddedBroker, tmp_path: Path) -> None:
    # a run that outlasts the scrapes (rank 1's fenced count comes with a heartbeat): CI saw
    # an 8-epoch run at slowdown 3 end before it on a loaded machine, and a 20-epoch one
    # end in 1.1 s on an idle one; slowed 20x (~0.8 ms batches sleep to ~16) it lasts ~7 s
    job, _ = chaos_job(broker.url, tmp_path, "scraped", epochs=20, slowdown=20,
                       coordinator_args=["--metrics-port", "0",
                                         "--report", str(tmp_path / "report"),
                                         "--compact-every", "0.5", "--keep-history", "0"])
    try:
        deadline = time.monotonic() + 120
        while (found := SERVING.search(job.log("coordinator"))) is None:
            assert time.monotonic() < deadline, job.dump()
            time.sleep(0.05)  # poll interval of a deadline-bound wait
        port = int(found.group(1))
        # both ranks admitted and training (so rank 1 fences the coordinator's generation)
        while True:
            with contextlib.suppress(OSError):  # the endpoint may still be starting
                if len(scrape(port).get("ddpbus_rank_batch_seconds", {})) == 2:
                    break
            assert time.monotonic() < deadline, job.dump()
            time.sleep(0.1)  # poll interval of a deadline-bound wait
        asyncio.run(forge(broker.url))
        while True:  # until two averages and the forged message are counted
            got = _scrape_live(port, job)
            rounds = sum(got.get("ddpbus_averaging_rounds_total", {}).values())
            refused = got.get("ddpbus_rejections_total", {})
            fenced = got.get("ddpbus_rank_rejections", {})
            purged = got.get("ddpbus_stream_purged_messages_total", {})
            telemetry = purged.get((("class", "telemetry"), ("ddpbus_job", "scraped")), 0)
            if (rounds >= 2 and len(refused) >= 2 and fenced and telemetry > 0
                    and len(got.get("ddpbus_rank_batch_seconds", {})) == 2
                    and len(got.get("ddpbus_rank_cpu_ratio", {})) == 2):
                break
            assert time.monotonic() < deadline, got
            time.sleep(0.1)  # poll interval of a deadline-bound wait
        job_label = ("ddpbus_job", "scraped")
        _two_ranks_training(got, job_label)
        assert got["ddpbus_anchor"][(job_label,)] >= 1
        assert got["ddpbus_global_step"][(job_label,)] > 0
        assert got["ddpbus_alive_ranks"][(job_label,)] == 2
        assert got["ddpbus_average_duration_seconds_count"][(job_label,)] >= 1
        assert got["ddpbus_sync_delivery_seconds_count"][(job_label,)] >= 1
        assert got["ddpbus_collective_seconds_count"][(job_label,)] >= 1
        assert (job_label,) in got["ddpbus_jetstream_pending_messages"]
        # compaction, every half second: the stream's size after a pass, what went by class
        assert got["ddpbus_stream_messages"][(job_label,)] >= 0
        assert got["ddpbus_stream_bytes"][(job_label,)] >= 0
        assert telemetry > 0
        assert refused[(job_label, ("reason", "bad-signature"))] == 2  # wrong key, none
        assert refused[(job_label, ("reason", "stale-generation"))] == 1
        # rank 1 refused the deposed coordinator's Shutdown, and its heartbeat said so
        assert fenced[(job_label, ("rank", "1"), ("reason", "stale-generation"))] == 1
        assert got["ddpbus_dead_ranks_total"][(job_label,)] == 0
        _resources_reported(got, job_label)
        summary = job.wait()
    finally:
        job.kill()
    assert summary["ok"], summary  # nobody exited or shut down early: nothing changed
    assert summary["rank_rejections"]["1"] == {"stale-generation": 1}
    # the coordinator wrote the run report at the end
    assert (tmp_path / "report" / "index.html").exists()
    assert (tmp_path / "report" / "loss.png").stat().st_size > 0
