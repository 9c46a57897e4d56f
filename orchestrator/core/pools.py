"""Per-epoch work pools and the plans cut from them.

Every epoch is the permutation ``perm(seed + epoch)`` of the dataset, trimmed to whole
batches (the sub-batch remainder is dropped, a different one each epoch). The coordinator only
counts batches: an :class:`Assignment` is ``size`` consecutive batches starting at batch
``offset`` of the epoch; on the wire it is an EpochPlan in samples. A :class:`Pool` hands
batches out from a monotonic cursor, so plans of one epoch never overlap and, once the cursor
is at the end and every assignment is trained, cover the epoch exactly once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ddpbus.codecs import messages as m
from ddpbus.orchestrator.core.aggregate import RankSum


@dataclass(slots=True)
class Assignment:
    """Batches ``[offset, offset + size)`` of ``epoch``, given to one rank."""

    epoch: int
    offset: int
    size: int
    done: int = 0
    metrics: m.MetricsMsg | None = None
    # its rank died: only the first ``size`` batches (those in the consensus) stayed; the
    # rest was reassigned and this plan's metrics, if any, no longer describe it
    orphaned: bool = False

    @property
    def complete(self) -> bool:
        return self.done >= self.size

    @property
    def remaining(self) -> int:
        return self.size - self.done

    def plan(self, batch_size: int) -> m.EpochPlan:
        return m.EpochPlan(epoch=self.epoch, partition_offset=self.offset * batch_size,
                           partition_size=self.size * batch_size)


@dataclass(slots=True)
class Folded:
    """The plans of an epoch that nothing can change any more, taken out of its pool: each
    trained and reported (or orphaned) and held by no rank (in the consensus: no death can
    cut it). What the ledger and the aggregate need of them, summed, so that an open epoch
    keeps only the plans in flight, however long it runs (at 1,024 ranks every plan with
    its metrics made a full snapshot's encoding grow from 22 to 172 ms over a 30 s epoch)."""

    chunks: int = 0
    trained: int = 0  # batches
    # batch -> change of the coverage depth there (a difference map without zeros: while
    # the folded plans tile [0, x) exactly once it holds two entries, {0: 1, x: -1})
    edges: dict[int, int] = field(default_factory=dict)
    sums: dict[int, RankSum] = field(default_factory=dict)  # rank -> its metrics, summed

    def add(self, rank: int, a: Assignment) -> None:
        self.chunks += 1
        self.trained += min(a.done, a.size)
        if a.size > 0:
            _shift(self.edges, a.offset, 1)
            _shift(self.edges, a.offset + a.size, -1)
        if a.metrics is not None:
            self.sums.setdefault(rank, RankSum()).add(a.metrics)


def _shift(edges: dict[int, int], at: int, by: int) -> None:
    value = edges.get(at, 0) + by
    if value:
        edges[at] = value
    else:
        edges.pop(at, None)


@dataclass(slots=True)
class Pool:
    """One epoch's batches: ``cursor`` of ``total`` handed out so far."""

    epoch: int
    total: int
    cursor: int = 0
    assignments: list[tuple[int, Assignment]] = field(default_factory=list)  # (rank, a)
    first_dispatch_at: float | None = None
    completed_at: float | None = None
    aggregated: bool = False
    boundary_done: bool = False
    # set by compact(): the epoch's final ledger, in place of its assignments (a long run
    # keeps one small record per epoch, not every chunk of every rank with its metrics)
    closed: dict[str, Any] | None = None
    # the first ``settled`` assignments are trained and reported, for good (batches only
    # add up, metrics arrive once, a dead rank's plan is cut to what it trained): the
    # checks below resume from there, so a thousand ranks' metrics do not rescan the pool
    settled: int = 0
    folded: Folded = field(default_factory=Folded)  # settled plans no rank holds any more

    @property
    def remaining(self) -> int:
        return self.total - self.cursor

    @property
    def exhausted(self) -> bool:
        return self.cursor >= self.total

    def _settle(self) -> int:
        items, i = self.assignments, self.settled
        while i < len(items):
            a = items[i][1]
            if not (a.complete and (a.metrics is not None or a.orphaned)):
                break
            i += 1
        self.settled = i
        return i

    @property
    def trained(self) -> bool:
        """Every batch handed out and trained."""
        if not self.exhausted:
            return False
        items = self.assignments
        return all(items[i][1].complete for i in range(self._settle(), len(items)))

    @property
    def reported(self) -> bool:
        """Trained, and every assignment's metrics arrived: ready to aggregate."""
        return self.exhausted and self._settle() == len(self.assignments)

    def take(self, rank: int, size: int, now: float) -> Assignment | None:
        size = min(size, self.remaining)
        if size <= 0:
            return None
        a = Assignment(epoch=self.epoch, offset=self.cursor, size=size)
        self.cursor += size
        self.assignments.append((rank, a))
        if self.first_dispatch_at is None:
            self.first_dispatch_at = now
        return a

    def reassign(self, rank: int, offset: int, size: int) -> Assignment:
        """Batches ``[offset, offset + size)`` handed out before, now given to ``rank`` (a
        dead rank's lost work); the cursor does not move."""
        a = Assignment(epoch=self.epoch, offset=offset, size=size)
        self.assignments.append((rank, a))
        return a

    def fold(self, held: set[int]) -> None:
        """Take every settled plan that no rank holds (``held``: the ids of the plans in
        the ranks' queues and unsealed histories) out of the pool, into :attr:`folded`."""
        settled = self._settle()
        if not settled:
            return
        keep: list[tuple[int, Assignment]] = []
        for i, (rank, a) in enumerate(self.assignments):
            if i < settled and id(a) not in held:
                self.folded.add(rank, a)
            else:
                keep.append((rank, a))
        if len(keep) < len(self.assignments):
            self.assignments, self.settled = keep, 0

    def drop(self, a: Assignment) -> None:
        self.assignments = [(r, x) for r, x in self.assignments if x is not a]
        self.settled = 0

    def coverage_gaps(self) -> list[tuple[int, int]]:
        """Where the assignments fail to tile ``[0, cursor)`` exactly once: ``(batch,
        times_covered)`` for the first batch of each wrong stretch (empty = exact)."""
        edges = dict(self.folded.edges)
        for _, a in self.assignments:
            if a.size > 0:
                _shift(edges, a.offset, 1)
                _shift(edges, a.offset + a.size, -1)
        wrong, depth, last = [], 0, 0
        for at in sorted(edges):
            if at > last and depth != 1 and last < self.cursor:
                wrong.append((last, depth))
            depth += edges[at]
            last = at
        if last < self.cursor:
            wrong.append((last, depth))
        return wrong

    def compact(self) -> None:
        """Keep only the ledger: for an epoch aggregated, served at its boundary and whose
        every batch is in a completed average (nothing can reassign any of it any more)."""
        self.closed = self.ledger()
        self.assignments = []
        self.settled = 0
        self.folded = Folded()

    def ledger(self) -> dict[str, Any]:
        """The epoch's proof of coverage: the batches trained into the consensus (each
        assignment as it stood at the end: a dead rank's cut to what it had averaged), and
        where they fail to tile the epoch exactly once."""
        if self.closed is not None:
            return dict(self.closed)
        done = self.folded.trained + sum(min(a.done, a.size) for _, a in self.assignments)
        gaps = self.coverage_gaps() if self.exhausted else [(self.cursor, 0)]
        incomplete = [[a.offset, a.size - a.done] for _, a in self.assignments
                      if not a.complete]
        return {"epoch": self.epoch, "batches": self.total, "trained": done,
                "chunks": self.folded.chunks + len(self.assignments), "gaps": gaps,
                "incomplete": incomplete,
                "exact": not gaps and not incomplete and done == self.total}

    def chunks(self) -> dict[int, list[m.MetricsMsg]]:
        """The metrics of the plans not folded yet, by rank (:attr:`folded` has the sums of
        the others)."""
        out: dict[int, list[m.MetricsMsg]] = {}
        for rank, a in self.assignments:
            if a.metrics is not None:
                out.setdefault(rank, []).append(a.metrics)
        return out


def equal_split(total: int, ranks: Iterable[int]) -> dict[int, int]:
    """Equal shares of ``total`` batches; the remainder goes to the first ranks."""
    order = sorted(ranks)
    base, extra = divmod(total, len(order))
    return {r: base + (1 if i < extra else 0) for i, r in enumerate(order)}


def proportional_split(total: int, ms_per_batch: Mapping[int, float | None]) -> dict[int, int]:
    """Throughput-proportional shares (C.7): ``tp_r = 1 / max(ms_r, 0.001)``, floors, the
    remainder to the fastest ranks. Unmeasured ranks count as the slowest measured one."""
    measured = [ms for ms in ms_per_batch.values() if ms is not None]
    if not measured:
        return equal_split(total, ms_per_batch)
    slowest = max(measured)
    tp = {r: 1.0 / max(ms if ms is not None else slowest, 0.001)
          for r, ms in ms_per_batch.items()}
    norm = sum(tp.values())
    shares = {r: int(total * t / norm) for r, t in tp.items()}
    short = total - sum(shares.values())
    for r in sorted(tp, key=lambda r: (-tp[r], r)):
        if short <= 0:
            break
        shares[r] += 1
        short -= 1
    return shares
