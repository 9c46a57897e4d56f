"""The run report: an HTML page with PNG plots, built from a job's stream.

Everything comes from the stored traffic, so the report of a run that just ended and of
any recorded job are the same thing: ``ddpbus report --job J --out DIR`` (``ddpbus run``
writes ``<out>/report/`` at the end of every run). Plots (matplotlib, Agg): loss and eval
metric per epoch; per-rank throughput over time (from the Batch reports); batch share over
time (each window's step budgets); the anchor and the averaging interval; divergence per
rank at each average; membership events (joins, deaths, rejoins, exits) drawn on every
timeline.
"""

from __future__ import annotations

import datetime as dt
import html
import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure  # no pyplot: no global state, no display

from ddpbus.codecs import Decoder, Envelope
from ddpbus.codecs import messages as m
from ddpbus.orchestrator.persist.recording import Progress, stored
from ddpbus.orchestrator.transport.auth import Access, access


@dataclass
class Series:
    """What the plots draw, gathered from the stream in order (times in seconds)."""

    start: dt.datetime | None = None
    batch_size: int = 0
    epochs: list[tuple[int, float]] = field(default_factory=list)  # (epoch, loss)
    evals: list[tuple[int, float]] = field(default_factory=list)
    batches: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    windows: list[tuple[float, tuple[int, ...]]] = field(default_factory=list)
    averages: list[float] = field(default_factory=list)
    divergence: dict[int, list[tuple[float, float]]] = field(
        default_factory=lambda: defaultdict(list))
    events: list[tuple[float, str]] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)

    def t(self, when: dt.datetime) -> float:
        if self.start is None:
            self.start = when
        return (when - self.start).total_seconds()

    def add(self, when: dt.datetime, env: Envelope) -> None:
        if env.msg_id in self.seen:
            return  # a re-published copy
        self.seen.add(env.msg_id)
        t, msg = self.t(when), env.message
        if isinstance(msg, m.Batch | m.Reports):
            self.batches[msg.rank] += [t] * len(m.batches(msg))
        elif isinstance(msg, m.SetGlobalStep) and msg.step_budget:
            self.windows.append((t, msg.step_budget))
        elif isinstance(msg, m.SyncNow):
            self.averages.append(t)
        elif isinstance(msg, m.SyncAck) and msg.divergence is not None and \
                math.isfinite(msg.divergence):
            self.divergence[msg.rank].append((t, msg.divergence))
        elif isinstance(msg, m.EpochAggregated):
            self.epochs.append((msg.metrics.epoch, msg.metrics.avg_loss))
        elif isinstance(msg, m.EvalBroadcast):
            self.evals.append((msg.epoch, msg.metric))
        elif isinstance(msg, m.Accept):
            self.batch_size = msg.run.batch_size
        self._membership(t, msg)

    def _membership(self, t: float, msg: Any) -> None:
        if isinstance(msg, m.Hello):  # a restart with nothing acked yet says Hello again
            seen = any(w == f"rank {msg.rank} joined" for _, w in self.events)
            self.events.append((t, f"rank {msg.rank} {'rejoined' if seen else 'joined'}"))
        elif isinstance(msg, m.Rejoin):
            self.events.append((t, f"rank {msg.hello.rank} rejoined"))
        elif isinstance(msg, m.DeclareDead) and (t, f"rank {msg.rank} dead") not in \
                self.events[-4:]:
            self.events.append((t, f"rank {msg.rank} dead"))
        elif isinstance(msg, m.Exiting):
            self.events.append((t, f"rank {msg.rank} exited"))


def _timeline(ax: Any, s: Series) -> None:
    """Membership events as labelled vertical lines."""
    for t, what in s.events:
        if "joined" in what or "exited" in what:
            continue  # every run has those at its ends: only the changes stand out
        ax.axvline(t, color="tab:red" if "dead" in what else "tab:green", ls="--", lw=1)
        ax.annotate(what, (t, 1), xycoords=("data", "axes fraction"), rotation=90,
                    va="top", ha="right", fontsize=8)


def _throughput(s: Series) -> dict[int, tuple[list[float], list[float]]]:
    """Per rank: samples/s in bins of a 50th of the run (at least 0.1 s)."""
    ends = [t for times in s.batches.values() for t in times]
    if not ends:
        return {}
    width = max(0.1, max(ends) / 50)
    out = {}
    for rank, times in sorted(s.batches.items()):
        bins: dict[int, int] = defaultdict(int)
        for t in times:
            bins[int(t / width)] += 1
        xs = list(range(min(bins), max(bins) + 1))
        out[rank] = ([(x + 0.5) * width for x in xs],
                     [bins.get(x, 0) * s.batch_size / width for x in xs])
    return out


def _loss(s: Series, fig: Figure) -> None:
    ax = fig.subplots()
    if s.epochs:
        ax.plot(*zip(*s.epochs, strict=True), marker="o", label="training loss")
    ax.set_xlabel("epoch")
    ax.set_ylabel("loss")
    if s.evals:
        ev = ax.twinx()
        ev.plot(*zip(*s.evals, strict=True), marker="s", color="tab:orange", label="eval")
        ev.set_ylabel("eval metric")
    ax.set_title("loss and eval metric per epoch")


def _throughput_plot(s: Series, fig: Figure) -> None:
    ax = fig.subplots()
    for rank, (xs, ys) in _throughput(s).items():
        ax.plot(xs, ys, label=f"rank {rank}")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("samples / s")
    ax.set_title("per-rank throughput")
    ax.legend(loc="lower right")
    _timeline(ax, s)


def _share(s: Series, fig: Figure) -> None:
    ax = fig.subplots()
    if s.windows:
        width = max(len(b) for _, b in s.windows)
        times = [t for t, _ in s.windows]
        shares = [[b[r] / total if r < len(b) and (total := sum(b)) else 0.0
                   for _, b in s.windows] for r in range(width)]
        ax.stackplot(times, shares, labels=[f"rank {r}" for r in range(width)], step="post")
        ax.legend(loc="lower right")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("share of the window's batches")
    ax.set_ylim(0, 1)
    ax.set_title("batch share over time")
    _timeline(ax, s)


def _anchor(s: Series, fig: Figure) -> None:
    ax = fig.subplots()
    if s.windows:
        ax.step([t for t, _ in s.windows],
                [min([x for x in b if x > 0] or [0]) for _, b in s.windows], where="post",
                label="anchor (slowest rank's batches per window)")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("batches")
    if len(s.averages) > 1:
        iv = ax.twinx()
        gaps = [b - a for a, b in zip(s.averages, s.averages[1:], strict=False)]
        iv.plot(s.averages[1:], gaps, ".", color="tab:purple", label="averaging interval")
        iv.set_ylabel("seconds between averages")
    ax.set_title("anchor and averaging interval")
    _timeline(ax, s)


def _divergence(s: Series, fig: Figure) -> None:
    ax = fig.subplots()
    for rank, points in sorted(s.divergence.items()):
        ax.plot(*zip(*points, strict=True), ".-", label=f"rank {rank}")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("divergence at the average")
    ax.set_title("divergence per rank")
    if s.divergence:
        ax.legend(loc="upper right")
    _timeline(ax, s)


_DRAW = {"loss": _loss, "throughput": _throughput_plot, "batch_share": _share,
         "anchor": _anchor, "divergence": _divergence}


def plot(s: Series, out: Path) -> dict[str, Path]:
    """One PNG per plot in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    for name, draw in _DRAW.items():
        fig = Figure(figsize=(8, 4), layout="tight")
        draw(s, fig)
        files[name] = out / f"{name}.png"
        fig.savefig(files[name], dpi=100)
    return files


_CAPTIONS = {
    "loss": "Training loss (aggregated over ranks) and eval metric per epoch.",
    "throughput": "Samples per second of each rank, from its Batch reports.",
    "batch_share": "Each window's step budget per rank as a share of the window.",
    "anchor": "El Che's anchor and the seconds between averages.",
    "divergence": "Each rank's divergence from the consensus at every average.",
}


def page(job: str, s: Series, files: dict[str, Path]) -> str:
    rows = {
        "job": job, "epochs": len(s.epochs), "averages": len(s.averages),
        "ranks": len(s.batches), "final loss": f"{s.epochs[-1][1]:.4f}" if s.epochs else "-",
        "last eval": f"{s.evals[-1][1]:.4f}" if s.evals else "-",
        "deaths": sum("dead" in w for _, w in s.events),
        "rejoins": sum("rejoined" in w for _, w in s.events),
        "duration": f"{max([t for t, _ in s.events] or [0]):.1f} s",
    }
    table = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>"
                    for k, v in rows.items())
    figures = "".join(
        f'<figure><img class="plot" src="{p.name}" alt="{name}" data-plot="{name}">'
        f"<figcaption>{html.escape(_CAPTIONS[name])}</figcaption></figure>"
        for name, p in files.items())
    events = "".join(f"<li>{t:.2f} s: {html.escape(w)}</li>" for t, w in s.events)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>ddpbus run {html.escape(job)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:900px}}
table{{border-collapse:collapse}}th,td{{padding:.2em .8em;text-align:left}}
figure{{margin:1.5em 0}}img{{max-width:100%}}</style></head>
<body><h1>ddpbus run {html.escape(job)}</h1>
<table id="summary">{table}</table>
{figures}
<h2>Membership</h2><ul id="events">{events}</ul>
<script>
// each plot says whether it decoded (for a headless check of the page)
for (const img of document.querySelectorAll("img.plot")) {{
  const mark = () => img.setAttribute("data-loaded", img.naturalWidth > 0 ? "yes" : "no");
  if (img.complete) mark(); else {{ img.onload = mark; img.onerror = mark; }}
}}
</script></body></html>
"""


async def gather(nats: str | Access, job: str, key: bytes,
                 progress: Progress | None = None) -> Series:
    s = Series()
    decoder = Decoder(job=job, key=key)
    nc = await access(nats).connect(job, name=f"ddpbus-report-{job}")
    try:
        async for when, env in stored(nc, job, decoder, progress):
            if env is not None:
                s.add(when, env)
    finally:
        await nc.close()
    return s


async def build(nats: str | Access, job: str, key: bytes, out: Path,
                progress: Progress | None = None) -> Path:
    """Write ``out/index.html`` and its plots; returns the page's path. ``progress`` hears
    how far the stream has been read (``ddpbus report`` draws a bar with it)."""
    s = await gather(nats, job, key, progress)
    files = plot(s, out)
    index = out / "index.html"
    index.write_text(page(job, s, files))
    (out / "series.json").write_text(json.dumps({
        "epochs": s.epochs, "evals": s.evals, "averages": len(s.averages),
        "events": s.events}, indent=1))
    return index
