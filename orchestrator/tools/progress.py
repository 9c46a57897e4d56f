"""Watching a run from its traffic: the live progress display and the final table.

:class:`RunMonitor` subscribes (core NATS, read-only) to every subject of a job, decodes each
message with the job key and keeps what a person watching wants: epoch, samples per second
and loss per rank, averaging rounds, the latest eval. It is only an observer: losing a
message costs a redraw, never a decision.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from rich.console import Console, Group
from rich.live import Live
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from ddpbus.codecs import DecodeError, Decoder
from ddpbus.codecs import messages as m
from ddpbus.codecs import subjects as sj

RATE_WINDOW_S = 3.0
MIN_SPAN_S = 0.5  # a rate over less than this is too early to tell


@dataclass
class RankView:
    batches: int = 0
    loss: float | None = None
    stamps: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    first: float | None = None  # when its first batch was seen

    def rate(self, now: float) -> float:
        """Batches a second over the last RATE_WINDOW_S (or since the first batch): by
        count over the window, since coalesced reports arrive in bursts that share a
        stamp (a span between the first and last stamp would read one burst as a
        second's work done in no time)."""
        while self.stamps and now - self.stamps[0] > RATE_WINDOW_S:
            self.stamps.popleft()
        if not self.stamps or self.first is None:
            return 0.0
        return len(self.stamps) / max(min(RATE_WINDOW_S, now - self.first), MIN_SPAN_S)


class RunMonitor:
    def __init__(self, job: str, key: bytes, workers: int) -> None:
        self.job = job
        self.decoder = Decoder(job=job, key=key)
        self.ranks = [RankView() for _ in range(workers)]
        self.run: m.RunConfig | None = None
        self.epoch = 0
        self.first_epoch: int | None = None  # a resumed run starts past 0
        self.epochs_done = 0
        self.rounds = 0
        self.loss: float | None = None
        self.eval: tuple[int, float] | None = None
        self.started = time.monotonic()

    async def attach(self, nc: Client) -> Any:
        return await nc.subscribe(sj.job_wildcard(self.job), cb=self._on_msg)

    async def _on_msg(self, msg: Msg) -> None:
        try:
            env = self.decoder.decode(msg.subject, msg.headers, msg.data)
        except DecodeError:
            return
        self.observe(env.message, time.monotonic())

    def observe(self, body: Any, now: float) -> None:
        if isinstance(body, m.Batch | m.Reports) and body.rank < len(self.ranks):
            view = self.ranks[body.rank]
            for batch in m.batches(body):
                view.batches += 1
                view.loss = batch.batch_loss if batch.batch_loss is not None else view.loss
                view.stamps.append(now)
                view.first = now if view.first is None else view.first
        elif isinstance(body, m.Accept):
            self.run = body.run
        elif isinstance(body, m.StartEpoch):
            self._plans([body.plan.epoch])
        elif isinstance(body, m.SetGlobalStep) and body.plans:
            self._plans([p.plan.epoch for p in body.plans])
        elif isinstance(body, m.SyncNow):
            self.rounds += 1
        elif isinstance(body, m.EpochAggregated):
            self.epochs_done = max(self.epochs_done, body.metrics.epoch + 1)
            self.loss = body.metrics.avg_loss
        elif isinstance(body, m.EvalBroadcast):
            self.eval = (body.epoch, body.metric)

    def _plans(self, epochs: list[int]) -> None:
        if self.first_epoch is None:
            self.first_epoch = min(epochs)
        self.epoch = max(self.epoch, *epochs)

    # ---------------------------------------------------------------- display

    def total_batches(self) -> int | None:
        """The batches this run trains: a resumed one only its remaining epochs'."""
        run = self.run
        if run is None:
            return None
        return (run.epochs - (self.first_epoch or 0)) * (run.dataset_size // run.batch_size)

    def renderable(self, progress: Progress, task: Any) -> Group:
        now = time.monotonic()
        batch = self.run.batch_size if self.run else 0
        total = self.total_batches()
        done = sum(r.batches for r in self.ranks)
        desc = (f"epoch {min(self.epoch + 1, self.run.epochs)}/{self.run.epochs}"
                if self.run else "forming")
        progress.update(task, total=total, completed=done, description=desc)
        table = Table(box=None, pad_edge=False)
        for col in ("rank", "samples/s", "batches", "loss"):
            table.add_column(col, justify="right")
        for i, r in enumerate(self.ranks):
            table.add_row(str(i), f"{r.rate(now) * batch:,.0f}", str(r.batches),
                          "-" if r.loss is None else f"{r.loss:.4f}")
        extra = f"averaging rounds {self.rounds}"
        if self.eval is not None:
            extra += f"   eval (epoch {self.eval[0]}) {self.eval[1]:.4f}"
        if self.loss is not None:
            extra += f"   epoch loss {self.loss:.4f}"
        caption = Table.grid()
        caption.add_row(extra)
        return Group(progress, table, caption)

    def live(self, console: Console) -> tuple[Live, Progress, Any]:
        progress = Progress(TextColumn("{task.description}"), BarColumn(),
                            TextColumn("{task.completed}/{task.total} batches"),
                            TimeElapsedColumn(), console=console)
        task = progress.add_task("starting", total=None)
        live = Live(self.renderable(progress, task), console=console, refresh_per_second=4,
                    transient=False)
        return live, progress, task


def final_table(summary: dict[str, Any]) -> Table:
    table = Table(title="ddpbus run", show_header=False, box=None)
    acc = summary.get("test_accuracy")
    losses = [x for x in summary.get("loss", []) if x is not None]
    resumed = (summary.get("coverage") or {}).get("resumed_epochs") or 0
    eval_epoch = summary.get("test_accuracy_epoch")
    rows = [
        ("result", "ok" if summary.get("ok") else f"FAILED: {summary.get('reason')}"),
        ("eval metric" + ("" if eval_epoch is None else f" (epoch {eval_epoch})"),
         "-" if acc is None else f"{acc:.4f}"),
        ("final epoch loss", "-" if not losses else f"{losses[-1]:.4f}"),
        ("epochs", f"{(summary.get('epochs') or 0) + resumed}/{summary.get('epochs_planned')}"
         + (f" ({resumed} of them resumed from a bundle)" if resumed else "")),
        ("wall time", "-" if summary.get("wall_s") is None else f"{summary['wall_s']:.2f} s"),
        ("averaging rounds", str(summary.get("rounds"))),
        ("global step", str(summary.get("global_step"))),
        ("policy / backend", f"{summary.get('policy')} / {summary.get('backend')}"),
    ]
    shares = summary.get("batch_share", {})
    batches = summary.get("batches", {})
    rows += [(f"rank {rank} batch share", f"{shares[rank]:.1%} ({batches.get(rank)} batches)")
             for rank in sorted(shares, key=int)]
    if summary.get("report"):
        rows.append(("run report", str(summary["report"])))
    for k, v in rows:
        table.add_row(k, v)
    return table


def progress_bar(what: str) -> tuple[Progress | None, Callable[[int, int], None]]:
    """A transient progress bar on stderr when a person watches it (a TTY), else nothing."""
    if not sys.stderr.isatty():
        return None, lambda _done, _total: None
    bar = Progress(TextColumn(what), BarColumn(), MofNCompleteColumn(),
                   TimeRemainingColumn(), console=Console(stderr=True), transient=True)
    task = bar.add_task(what, total=None)
    return bar, lambda done, total: bar.update(task, completed=done, total=total)
