"""The coordinator's Prometheus metrics (prometheus-client), served on ``/metrics``.

Gauges are refreshed from the core's state on the shell's ticker (never per message, so a
large cohort costs O(ranks) every 100 ms, not per report); per-batch timings come from the
Batch reports as they are handled; counters follow the decisions (averages, deaths,
rejoins) and every refusal: the codec's (decode, signature, fencing, oversize) and the
core's. The HTTP server runs on prometheus-client's own thread and only reads.

Names follow Prometheus's conventions: base units (``_seconds``, never milliseconds),
``_total`` on counters, and the job in a ``ddpbus_job`` label: a label ``job`` would collide
with the scrape target's own ``job`` label and reach queries as ``exported_job``. The Grafana
dashboard beside the chart (helm/dashboards/ddpbus.json) queries these names.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from ddpbus.codecs import messages as m
from ddpbus.orchestrator.core.state import Record, State

log = logging.getLogger(__name__)

RANK = ("rank",)
JOB = "ddpbus_job"  # not "job": Prometheus's target label (see the module's docstring)


class CoordinatorMetrics:
    def __init__(self, job: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry

        def gauge(name: str, text: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, text, (JOB, *labels), registry=r)

        self._rank_gauges = {
            "samples_per_second": gauge("ddpbus_rank_samples_per_second",
                                        "samples per second of each rank (El Che's smoothed "
                                        "speed)", RANK),
            "batch_seconds": gauge("ddpbus_rank_batch_seconds", "last reported batch "
                                   "compute time", RANK),
            "data_seconds": gauge("ddpbus_rank_data_seconds", "last reported batch "
                                  "data-loading time", RANK),
            "loss": gauge("ddpbus_rank_loss", "last reported training loss", RANK),
            "divergence": gauge("ddpbus_rank_divergence", "divergence at the last average",
                                RANK),
            "count": gauge("ddpbus_rank_window_batches", "El Che's batches per window",
                           RANK),
            "alive": gauge("ddpbus_rank_alive", "1 while the rank is a live member", RANK),
            "generation": gauge("ddpbus_rank_generation", "the rank's admitted generation",
                                RANK),
            "batches": gauge("ddpbus_rank_batches_trained", "batches the rank trained", RANK),
            # from each rank's MetricsMsg.resources, once per epoch share
            "cpu": gauge("ddpbus_rank_cpu_ratio", "the rank's CPU time over wall time (1 = "
                         "one core busy)", RANK),
            "rss": gauge("ddpbus_rank_resident_memory_bytes", "the rank's resident memory",
                         RANK),
            "ram": gauge("ddpbus_rank_machine_memory_bytes", "its machine's memory", RANK),
            "gpu": gauge("ddpbus_rank_gpu_utilization_ratio", "its GPU's utilisation "
                         "(NVML; absent without it)", RANK),
            "vram": gauge("ddpbus_rank_gpu_memory_allocated_bytes", "GPU memory torch "
                          "holds for the rank", RANK),
            "vram_total": gauge("ddpbus_rank_gpu_memory_total_bytes", "its GPU's memory",
                                RANK),
        }
        self.anchor = gauge("ddpbus_anchor", "El Che's anchor (batches of the slowest rank "
                            "per window)")
        self.global_step = gauge("ddpbus_global_step", "global optimizer steps")
        self.epoch = gauge("ddpbus_epoch", "the epoch being dispatched")
        self.alive = gauge("ddpbus_alive_ranks", "live members")
        self.pending = gauge("ddpbus_jetstream_pending_messages", "stream messages the "
                             "coordinator has not read yet (JetStream consumer lag)")
        self.rounds = Counter("ddpbus_averaging_rounds", "averages sent", (JOB,),
                              registry=r)
        self.failed_rounds = Counter("ddpbus_averaging_failed_rounds", "averages a collective "
                                     "failure undid", (JOB,), registry=r)
        self.average_seconds = Histogram(
            "ddpbus_average_duration_seconds", "SyncNow to the last SyncAck", (JOB,),
            registry=r, buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
                                 10, 30))
        fine = (0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)
        self.delivery_seconds = Histogram(
            "ddpbus_sync_delivery_seconds", "SyncNow decided to held by its last rank (the "
            "ranks' clocks against the coordinator's: exact on one host)", (JOB,),
            registry=r, buckets=fine)
        self.collective_seconds = Histogram(
            "ddpbus_collective_seconds", "The collective call of an average, as the rank "
            "that waited least in it saw it", (JOB,), registry=r, buckets=fine)
        self.deaths = Counter("ddpbus_dead_ranks", "ranks declared dead", (JOB,),
                              registry=r)
        # one series per death: which rank, where, which incarnation, and why (silent:
        # heartbeat timeout; disconnected: the broker closed its connection; restarted)
        self.rank_deaths = Counter("ddpbus_rank_deaths", "ranks declared dead, named",
                                   (JOB, "rank", "host", "generation", "cause"), registry=r)
        self.rejoins = Counter("ddpbus_rejoined_ranks", "restarted ranks taken back",
                               (JOB,), registry=r)
        self.rejections = Counter("ddpbus_rejections", "inputs refused, by reason (codec: "
                                  "decode, bad-signature, stale-generation, oversize, ...; "
                                  "core: duplicate-id, dead-rank, ...)", (JOB, "reason"),
                                  registry=r)
        self.rank_rejections = gauge("ddpbus_rank_rejections", "messages a rank refused "
                                     "(bad-signature, stale-generation, ...), by reason, as "
                                     "its heartbeat reports them (since it started)",
                                     ("rank", "reason"))
        self.stream_bytes = gauge("ddpbus_stream_bytes", "bytes the job stream holds, after "
                                  "the last compaction pass")
        self.stream_messages = gauge("ddpbus_stream_messages", "messages the job stream "
                                     "holds, after the last compaction pass")
        self.purged = Counter("ddpbus_stream_purged_messages", "messages compaction removed "
                              "from the job stream, by subject class (telemetry, rank, "
                              "broadcast; subjects.md, Retention)", (JOB, "class"),
                              registry=r)
        self.job = job
        self._seen_refusals: dict[str, int] = {}
        self._seen_purged: dict[str, int] = {}
        for series in (self.rounds, self.failed_rounds, self.average_seconds, self.deaths,
                       self.rejoins):
            series.labels(job)  # present (at 0) from the first scrape

    # ---------------------------------------------------------------- updates

    def on_batch(self, msg: m.Batch) -> None:
        labels = (self.job, str(msg.rank))
        self._rank_gauges["batch_seconds"].labels(*labels).set(msg.batch_ms / 1000)
        self._rank_gauges["data_seconds"].labels(*labels).set(msg.data_ms / 1000)
        if msg.batch_loss is not None:
            self._rank_gauges["loss"].labels(*labels).set(msg.batch_loss)

    def on_resources(self, msg: m.MetricsMsg) -> None:
        r = msg.resources
        if r is None:
            return
        labels = (self.job, str(msg.rank))
        g = self._rank_gauges
        g["cpu"].labels(*labels).set(r.cpu_percent / 100)
        g["rss"].labels(*labels).set(r.ram_used_bytes)
        g["ram"].labels(*labels).set(r.ram_total_bytes)
        for key, value, scale in (("gpu", r.gpu_util_percent, 100), ("vram",
                                  r.vram_allocated_bytes, 1), ("vram_total",
                                  r.vram_total_bytes, 1)):
            if value is not None:
                g[key].labels(*labels).set(value / scale)

    def on_record(self, record: Record) -> None:
        if record.event == "average":
            self.rounds.labels(self.job).inc()
        elif record.event == "averaged":
            if record.fields.get("failed"):
                self.failed_rounds.labels(self.job).inc()
            else:
                self.average_seconds.labels(self.job).observe(
                    float(record.fields.get("reduce_ms") or 0.0) / 1000)
                for key, histogram in (("deliver_ms", self.delivery_seconds),
                                       ("collective_ms", self.collective_seconds)):
                    value = record.fields.get(key)
                    if value is not None:
                        histogram.labels(self.job).observe(float(value) / 1000)
        elif record.event == "rank-dead":
            self.deaths.labels(self.job).inc()
            f = record.fields
            self.rank_deaths.labels(self.job, str(f.get("rank", "")), str(f.get("host", "")),
                                    str(f.get("generation", "")),
                                    str(f.get("cause", ""))).inc()
        elif record.event == "rank-rejoined":
            self.rejoins.labels(self.job).inc()

    def on_rejections(self, counts: Mapping[str, int]) -> None:
        """Totals by reason so far (codec and core together); counted by their growth."""
        for reason, total in counts.items():
            grew = total - self._seen_refusals.get(reason, 0)
            if grew > 0:
                self.rejections.labels(self.job, reason).inc(grew)
                self._seen_refusals[reason] = total

    def on_retention(self, report: Mapping[str, Any]) -> None:
        """The compactor's report (retention.Compactor.report): totals, counted by growth."""
        if not report.get("passes"):
            return
        self.stream_bytes.labels(self.job).set(report["stream_bytes"])
        self.stream_messages.labels(self.job).set(report["stream_msgs"])
        for kind, total in report["purged"].items():
            grew = total - self._seen_purged.get(kind, 0)
            if grew > 0:
                self.purged.labels(self.job, kind).inc(grew)
                self._seen_purged[kind] = total

    def on_rank_rejections(self, rank: int, counts: Mapping[str, int]) -> None:
        for reason, total in counts.items():
            self.rank_rejections.labels(self.job, str(rank), reason).set(total)

    def refresh(self, s: State, *, batch_size: int, pending: int | None) -> None:
        """The gauges that mirror the core's state (called from the ticker)."""
        job = self.job
        g = self._rank_gauges
        for r in s.ranks:
            labels = (job, str(r.rank))
            ms = s.elche.smoothed_ms(r.rank)
            if ms:
                g["samples_per_second"].labels(*labels).set(1000.0 * batch_size / ms)
            if r.divergence is not None:
                g["divergence"].labels(*labels).set(r.divergence)
            g["count"].labels(*labels).set(s.elche.counts.get(r.rank, 0))
            g["alive"].labels(*labels).set(1 if r.alive else 0)
            g["generation"].labels(*labels).set(r.hello.generation if r.hello else 0)
            g["batches"].labels(*labels).set(r.batches_total)
        self.anchor.labels(job).set(s.elche.anchor)
        self.global_step.labels(job).set(s.global_step)
        self.epoch.labels(job).set(s.epoch)
        self.alive.labels(job).set(len(s.alive))
        if pending is not None:
            self.pending.labels(job).set(pending)

    def serve(self, port: int, host: str = "0.0.0.0") -> Any:  # noqa: S104 - a pod's port
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        log.info("serving Prometheus metrics on http://%s:%d/metrics", host,
                 server.server_port)
        return server
