"""The coordinator's Prometheus /metrics, scraped during a run and parsed with
prometheus-client's own parser."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from pathlib import Path

import pytest
from jobs import chaos_job
from prometheus_client.parser import text_string_to_metric_families

from ddpbus.codecs import Encoder
from ddpbus.codecs import messages as m
from ddpbus.codecs import subjects as sj
from ddpbus.orchestrator.broker import EmbeddedBroker
from ddpbus.orchestrator.bus import connect

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


async def forge(url: str) -> None:
    """A timing message signed with the wrong key: refused, and counted."""
    nc = await connect(url, name="forger")
    # a generation of its own: the same Nats-Msg-Id as a real message would make JetStream
    # drop the real one as a duplicate (per-rank publish permissions stop that, issue 8)
    enc = Encoder(job="scraped", key=b"not-the-job-key-0123456789abcdef", sender="rank-1",
                  generation=99)
    out = enc.encode(sj.TIMING_RANK.subject("scraped", 1), m.Exiting(rank=1))
    await nc.jetstream().publish(out.subject, out.payload, headers=out.headers)
    await nc.close()


def test_metrics_during_a_run(broker: EmbeddedBroker, tmp_path: Path) -> None:
    job, _ = chaos_job(broker.url, tmp_path, "scraped", epochs=8, slowdown=3,
                       coordinator_args=["--metrics-port", "0",
                                         "--report", str(tmp_path / "report")])
    try:
        deadline = time.monotonic() + 120
        while (found := SERVING.search(job.log("coordinator"))) is None:
            assert time.monotonic() < deadline, job.dump()
            time.sleep(0.05)  # poll interval of a deadline-bound wait
        port = int(found.group(1))
        asyncio.run(forge(broker.url))
        while True:  # until two averages and the forged message are counted
            got = scrape(port)
            rounds = sum(got.get("ddpbus_averaging_rounds_total", {}).values())
            refused = got.get("ddpbus_rejections_total", {})
            if rounds >= 2 and refused and len(got.get("ddpbus_rank_batch_ms", {})) == 2:
                break
            assert time.monotonic() < deadline, got
            time.sleep(0.1)  # poll interval of a deadline-bound wait
        job_label = ("job", "scraped")
        for rank in ("0", "1"):
            labels = (job_label, ("rank", rank))
            assert got["ddpbus_rank_samples_per_second"][labels] > 0
            assert got["ddpbus_rank_batch_ms"][labels] > 0
            assert got["ddpbus_rank_data_ms"][labels] >= 0
            assert got["ddpbus_rank_alive"][labels] == 1
            assert got["ddpbus_rank_generation"][labels] == 1
            assert got["ddpbus_rank_batch_count"][labels] >= 1
            assert labels in got["ddpbus_rank_loss"]
        assert got["ddpbus_anchor"][(job_label,)] >= 1
        assert got["ddpbus_global_step"][(job_label,)] > 0
        assert got["ddpbus_alive_ranks"][(job_label,)] == 2
        assert got["ddpbus_average_duration_seconds_count"][(job_label,)] >= 1
        assert (job_label,) in got["ddpbus_jetstream_pending_messages"]
        assert refused[(job_label, ("reason", "bad-signature"))] == 1
        assert got["ddpbus_dead_ranks_total"][(job_label,)] == 0
        summary = job.wait()
    finally:
        job.kill()
    assert summary["ok"], summary
    # the coordinator wrote the run report at the end
    assert (tmp_path / "report" / "index.html").exists()
    assert (tmp_path / "report" / "loss.png").stat().st_size > 0
