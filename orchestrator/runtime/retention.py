"""Bounded streams: which of a job's stored messages may go, and the task that purges them.

A job's stream would otherwise grow for the whole run (a 1,024-rank job at 10 Batch
reports a second stores gigabytes an hour). Nothing younger than ``keep`` seconds goes (the
history `ddpbus sub --since`, `replay` and `report` read); older, what each reader still
needs decides what may go, per subject class (subjects.md, "Retention"):

- **telemetry** (``timing``, ``metrics``, ``join``): read by the coordinator only, and a
  coordinator that takes over starts from the stored snapshot and replays what follows its
  stream sequence. So everything up to the sequence of a stored snapshot may go.
- **a rank's own control and admit subjects**: up to its durable's ack floor; a restarted
  incarnation resumes from that floor, never before it.
- **control.all**: up to the lowest ack floor among the members (ranks that said Hello and
  are neither dead nor exited). A rank that is not a member does not hold it back: when it
  comes back it is admitted anew and reads only what follows its Accept.

The horizon of a pass is the stream sequence of the newest snapshot stored at least
``keep`` seconds ago: every purge stays below it.

The floors are read before the members: a rank admitted after the floors were read needs
only messages published after it, above every floor read.

A stream-wide ``max_bytes`` (``provision.JobStorage``) stays as a backstop for a compactor
that cannot run (no coordinator for hours, a member that never acks); the compactor warns
when the stream passes half of it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final

import nats.errors
from nats.aio.client import Client

from ddpbus.codecs import subjects as sj
from ddpbus.codecs.errors import ConfigError

log = logging.getLogger(__name__)

TELEMETRY: Final = (sj.TIMING_RANK, sj.METRICS_RANK, sj.JOIN_RANK)
PAGE: Final = 256  # consumers per CONSUMER.LIST answer (the server's page size)
CONCURRENT: Final = 64  # purge requests in flight at once
WARN_FRACTION: Final = 0.5


@dataclass(frozen=True, slots=True)
class Retention:
    """``every_s``: seconds between passes (0: never compact, keep the whole history up to
    the stream's limits). ``keep_s``: the history younger than this always stays."""

    every_s: float = 60.0
    keep_s: float = 1800.0

    def __post_init__(self) -> None:
        if not self.every_s >= 0:  # also refuses NaN
            raise ConfigError(f"--compact-every must be >= 0 seconds, got {self.every_s}")
        if not self.keep_s >= 0:
            raise ConfigError(f"--keep-history must be >= 0 seconds, got {self.keep_s}")

    @property
    def enabled(self) -> bool:
        return self.every_s > 0


@dataclass(frozen=True, slots=True)
class Purge:
    """Remove the messages on ``subject`` (a filter) with a sequence below ``below``."""

    subject: str
    below: int
    kind: str  # telemetry | rank | broadcast


def plan(job: str, *, horizon: int, floors: dict[int, int], members: Iterable[int],
         done: dict[str, int]) -> list[Purge]:
    """The purges one pass makes; pure. ``horizon``: the stream sequence of a stored
    snapshot old enough (0: none yet: nothing goes). ``floors``: rank → its durable's ack
    floor (stream sequence). ``done``: subject → the ``below`` already purged, so unchanged
    floors cost no request (updated by the caller once a purge succeeded)."""
    out: list[Purge] = []
    if horizon <= 0:
        return out

    def want(subject: str, upto: int, kind: str) -> None:
        below = min(upto, horizon) + 1
        if upto > 0 and below > done.get(subject, 1):
            out.append(Purge(subject, below, kind))

    for spec in TELEMETRY:
        want(spec.wildcard(job), horizon, "telemetry")
    for rank, floor in sorted(floors.items()):
        want(sj.CONTROL_RANK.subject(job, rank), floor, "rank")
        want(sj.ADMIT_RANK.subject(job, rank), floor, "rank")
    member_floors = [floors.get(r, 0) for r in members]
    if member_floors:
        want(sj.CONTROL_ALL.subject(job), min(member_floors), "broadcast")
    return out


def horizon(history: Iterable[tuple[float, int]], now: float, keep_s: float) -> int:
    """The newest snapshot sequence stored at least ``keep_s`` before ``now`` (0: none)."""
    best = 0
    for at, seq in history:
        if now - at >= keep_s:
            best = max(best, seq)
    return best


class Compactor:
    """The coordinator's purge task. ``members()`` reads the core's member ranks;
    :meth:`stored` is told each snapshot stored (its stream sequence)."""

    def __init__(self, nc: Client, job: str, retention: Retention,
                 members: Callable[[], set[int]], *, max_bytes: int = -1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.nc, self.js, self.job, self.retention = nc, nc.jetstream(), job, retention
        self.stream = sj.stream_name(job)
        self.members, self.max_bytes, self.clock = members, max_bytes, clock
        self._history: deque[tuple[float, int]] = deque()
        self._done: dict[str, int] = {}
        self.passes = 0
        self.failed = 0
        self.purged: Counter[str] = Counter()  # messages, by subject class
        self.stream_bytes = 0
        self.stream_msgs = 0
        self.peak_msgs = 0
        self.peak_bytes = 0
        self._warned = False

    def stored(self, seq: int) -> None:
        now = self.clock()
        self._history.append((now, seq))
        # one entry older than the keep window is all horizon() can use
        keep = self.retention.keep_s
        while len(self._history) > 1 and now - self._history[1][0] >= keep:
            self._history.popleft()

    def report(self) -> dict[str, Any]:
        return {"every_s": self.retention.every_s,
                "keep_s": self.retention.keep_s,
                "passes": self.passes, "failed_passes": self.failed,
                "purged": dict(self.purged), "stream_bytes": self.stream_bytes,
                "stream_msgs": self.stream_msgs, "peak_stream_msgs": self.peak_msgs,
                "peak_stream_bytes": self.peak_bytes, "max_bytes": self.max_bytes}

    async def run(self) -> None:
        if not self.retention.enabled:
            return
        while True:
            await asyncio.sleep(self.retention.every_s)
            try:
                await self.compact()
            except (nats.errors.Error, TimeoutError, OSError, ValueError) as exc:
                # the broker away, a slow answer: the next pass purges what this one did not
                self.failed += 1
                log.warning("stream compaction pass failed (%s: %s); retrying in %.0fs",
                            type(exc).__name__, exc, self.retention.every_s)

    async def compact(self) -> list[Purge]:
        """One pass: read the floors, then the members, purge, then measure the stream."""
        floors = await self._floors()
        members = self.members()
        cut = horizon(self._history, self.clock(), self.retention.keep_s)
        purges = plan(self.job, horizon=cut, floors=floors, members=members,
                      done=self._done)
        for i in range(0, len(purges), CONCURRENT):
            await asyncio.gather(*(self._purge(p) for p in purges[i:i + CONCURRENT]))
        self.passes += 1
        await self._measure(floors, members)
        return purges

    async def _floors(self) -> dict[int, int]:
        """rank -> its durable's ack floor, from the server's consumer list (paged)."""
        floors: dict[int, int] = {}
        offset = 0
        while True:
            page = await self.js.consumers_info(self.stream, offset=offset or None)
            for c in page:
                rank = sj.sender_rank(c.name or "")
                if rank is not None:
                    floors[rank] = (c.ack_floor.stream_seq or 0) if c.ack_floor else 0
            offset += len(page)
            if len(page) < PAGE:
                return floors

    async def _purge(self, p: Purge) -> None:
        # a raw request: nats-py's purge_stream answers only True, not how many went
        reply = await self.nc.request(f"$JS.API.STREAM.PURGE.{self.stream}", json.dumps(
            {"filter": p.subject, "seq": p.below}).encode(), timeout=5.0)
        answer = json.loads(reply.data)
        if "error" in answer:
            raise ValueError(f"purge of {p.subject}: "
                             f"{answer['error'].get('description', answer['error'])}")
        self._done[p.subject] = p.below
        self.purged[p.kind] += int(answer.get("purged", 0))

    async def _measure(self, floors: dict[int, int], members: set[int]) -> None:
        state = (await self.js.stream_info(self.stream)).state
        self.stream_bytes, self.stream_msgs = state.bytes, state.messages
        self.peak_msgs = max(self.peak_msgs, self.stream_msgs)
        self.peak_bytes = max(self.peak_bytes, self.stream_bytes)
        if self.max_bytes > 0 and self.stream_bytes > WARN_FRACTION * self.max_bytes:
            if not self._warned:
                lagging = min(members, key=lambda r: floors.get(r, 0), default=None)
                log.warning("stream %s holds %d bytes, over half its max_bytes %d: the "
                            "oldest messages go first when it is full; the lowest ack floor "
                            "is rank %s's (%s)", self.stream, self.stream_bytes,
                            self.max_bytes, lagging, floors.get(lagging, 0)
                            if lagging is not None else "-")
                self._warned = True
        else:
            self._warned = False
