"""The coordinator's /metrics follow Prometheus's conventions, checked on its exposition text
with prometheus-client's own parser, and the shipped Grafana dashboard queries only what it
exports (issue 37)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ddpbus.codecs import messages as m
from ddpbus.orchestrator.core.state import Record
from ddpbus.orchestrator.runtime.metrics import JOB, CoordinatorMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "helm" / "ddpbus" / "dashboards" / "ddpbus.json"
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count",
                                                              "_created"), "gauge": ("",)}


def _fed() -> CoordinatorMetrics:
    metrics = CoordinatorMetrics("digits")
    metrics.on_batch(m.Batch(rank=0, step_count=1, batch_ms=12.5, data_ms=2.0,
                             batch_loss=0.7))
    metrics.on_resources(m.MetricsMsg(
        rank=0, epoch=0, avg_loss=0.7, batches_processed=1, epoch_ms=1.0,
        samples_processed=8, share_complete_ms=1.0, compute_only_ms=1.0, data_starve_ms=0.0,
        resources=m.ResourceSample(cpu_percent=150.0, ram_used_bytes=2**30,
                                   ram_total_bytes=2**34, gpu_util_percent=80.0,
                                   vram_total_bytes=2**36, vram_allocated_bytes=2**33)))
    metrics.on_record(Record("average"))
    metrics.on_record(Record("averaged", {"reduce_ms": 30.0}))
    metrics.on_record(Record("rank-dead"))
    metrics.on_rejections({"bad-signature": 2})
    metrics.on_rank_rejections(1, {"stale-generation": 1})
    metrics.on_retention({"passes": 1, "stream_bytes": 10, "stream_msgs": 2,
                          "purged": {"telemetry": 3}})
    return metrics


def _families(metrics: CoordinatorMetrics) -> list:  # type: ignore[type-arg]
    return list(text_string_to_metric_families(generate_latest(metrics.registry).decode()))


def test_names_labels_and_units_follow_prometheus_conventions() -> None:
    families = _families(_fed())
    assert families
    for family in families:
        assert re.fullmatch(r"ddpbus_[a-z_]+", family.name), family.name
        assert family.documentation, family.name
        # base units: seconds, never milliseconds; no gauge posing as a histogram's _count
        assert not re.search(r"_(ms|millis|milliseconds)(_|$)", family.name), family.name
        if family.type == "gauge":
            assert not family.name.endswith(("_count", "_sum", "_bucket", "_total")), \
                family.name
        for sample in family.samples:
            assert sample.name.startswith(family.name), sample
            assert sample.name[len(family.name):] in SUFFIXES[family.type], sample
            # `job` is the scrape target's label: ours would arrive as exported_job
            assert "job" not in sample.labels, sample
            assert sample.labels[JOB] == "digits", sample
    got = {s.name: s for f in families for s in f.samples if not s.name.endswith("_created")}
    assert got["ddpbus_rank_batch_seconds"].value == 0.0125
    assert got["ddpbus_rank_data_seconds"].value == 0.002
    assert got["ddpbus_averaging_rounds_total"].value == 1
    assert got["ddpbus_average_duration_seconds_sum"].value == 0.03
    assert got["ddpbus_rejections_total"].labels["reason"] == "bad-signature"
    assert got["ddpbus_rank_cpu_ratio"].value == 1.5  # a ratio, not a percentage
    assert got["ddpbus_rank_gpu_utilization_ratio"].value == 0.8
    assert got["ddpbus_rank_resident_memory_bytes"].value == 2**30


def _exported() -> set[str]:
    """Every sample name a scrape can hold."""
    return {f.name + suffix for f in _families(_fed()) for suffix in SUFFIXES[f.type]}


def _queries(node: object) -> list[str]:
    if isinstance(node, dict):
        here = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return here + [q for v in node.values() for q in _queries(v)]
    if isinstance(node, list):
        return [q for v in node for q in _queries(v)]
    return []


def test_the_grafana_dashboard_queries_only_exported_names_by_ddpbus_job() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = _queries(dashboard["panels"])
    assert len(queries) >= 15
    exported = _exported()
    used = {name for q in queries for name in re.findall(r"\bddpbus_[a-z_]+\b", q)
            if name != JOB}
    assert used <= exported, used - exported
    # every family the coordinator exports is on some panel
    families = {f.name for f in _families(_fed()) if not f.name.endswith("_created")}
    shown = {next(f for f in sorted(families, key=len, reverse=True) if u.startswith(f))
             for u in used}
    assert shown == families, families - shown
    for q in queries:
        assert f'{JOB}=~"$ddpbus_job"' in q, q  # each panel follows the job picker
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["ddpbus_job"]["definition"] == f"label_values(ddpbus_alive_ranks, {JOB})"
    assert variables["datasource"]["type"] == "datasource"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
