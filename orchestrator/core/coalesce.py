"""Coalesced per-batch reports: one rule for the worker's trainer and for ``ddpbus simulate``.

A rank holds its per-batch reports (Batch, LrUpdate) while they come faster than the run's
report interval and sends them as one ``TimingMsg.Reports`` once the oldest is its share of
that old (0.75 to 1.25 of it, by rank: the ranks' sends spread over the interval), at
``MAX_REPORT_ITEMS - 1`` items (room for a batch's two), or at once when a Batch closes its
window (stored with an ack: the coordinator's gate waits on it). Whatever else the rank
sends goes after the reports it holds, and a rank going idle sends them first
(subjects.md, "Coalesced reports").

The MetricsMsg of a plan finished by the window's closing batch is held: it goes behind
the rank's next reports, or its share of the report interval after its SyncAck, or before
its Exiting, whichever comes first. The gate waits on the closing batches only; sent with
them, a thousand ranks' metrics would queue at the coordinator in front of the last one,
and sent right behind the SyncAcks, in front of the epoch's aggregate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from ddpbus.codecs import messages as m

Report = m.Batch | m.LrUpdate


GOLDEN: Final = (5 ** 0.5 - 1) / 2  # rank r's share of the spread: frac(r * GOLDEN)


def hold_share(rank: int) -> float:
    """How much of the report interval ``rank`` holds its reports: 0.75 to 1.25, 1 on
    average over the ranks, evenly spread (the golden-ratio sequence). Every rank starts
    its window at the same broadcast; with one interval for all, a thousand ranks would
    flush together, once an interval, and keep doing so; held for different spans, their
    messages come spread over the interval."""
    return 0.75 + 0.5 * ((rank * GOLDEN) % 1.0)


@dataclass(slots=True)
class ReportBuffer:
    """The per-batch reports of ``rank`` not sent yet."""

    rank: int
    items: list[Report] = field(default_factory=list)
    since: float = 0.0  # when the first of them was made (seconds, any monotonic clock)
    closed: bool = False  # the last flush closed the rank's window
    settled: list[m.MetricsMsg] = field(default_factory=list)  # metrics held since then
    acked_held: int = 0  # how many of them (the first) had their window's SyncAck
    due: float | None = None  # when those go at the latest (same clock)

    def add(self, items: list[Report], now: float, interval_ms: float, *, closing: bool
            ) -> bool:
        """Hold ``items`` (made at ``now``); True when the buffer is due to go."""
        if not self.items:
            self.since = now
        self.items += items
        return (closing or (now - self.since) * 1000.0 >= interval_ms * hold_share(self.rank)
                or len(self.items) > m.MAX_REPORT_ITEMS - 2)

    def take(self, interval_ms: float, *, durable: bool) -> list[tuple[m.Message, bool]]:
        """Empty the buffer into ``(message, durable)`` pairs to send in order: one Reports,
        or a lone report as itself (with interval 0 every report alone, as flodl sends
        them; only a Batch ever needs the ack). A window-closing flush (``durable``) holds
        the metrics that follow it; any other flush takes the held ones behind it."""
        items, self.items = self.items, []
        if len(items) > 1 and interval_ms > 0:
            out: list[tuple[m.Message, bool]] = [
                (m.Reports(rank=self.rank, items=tuple(items)), durable)]
        else:
            out = [(x, durable and isinstance(x, m.Batch)) for x in items]
        if durable:
            self.closed = True
        elif items:
            out += self.release()
        return out

    def metrics(self, msg: m.MetricsMsg) -> list[tuple[m.Message, bool]]:
        """A finished plan's MetricsMsg: to send now, or (an empty list) held behind the
        window's closing flush (or behind metrics held already: they keep their order)."""
        if self.closed or self.settled:
            self.settled.append(msg)
            return []
        return [(msg, True)]

    def acked(self, now: float, interval_ms: float) -> list[tuple[m.Message, bool]]:
        """The rank answered SyncNow at ``now``: its window is over. The held metrics go
        behind its next reports, or ``hold_share`` of the interval from now, whichever is
        first (:meth:`overdue`); with interval 0 at once, behind the SyncAck."""
        self.closed = False
        if interval_ms <= 0:
            return self.release()
        self.acked_held = len(self.settled)
        if self.settled and self.due is None:
            self.due = now + interval_ms / 1000.0 * hold_share(self.rank)
        return []

    def overdue(self, now: float) -> list[tuple[m.Message, bool]]:
        """The held metrics whose window's SyncAck went, once their time has come; those
        of a window closed since (its SyncAck still to come) stay held, for its own ack."""
        if self.due is None or now < self.due:
            return []
        ready, self.settled = self.settled[:self.acked_held], self.settled[self.acked_held:]
        self.acked_held, self.due = 0, None
        return [(x, True) for x in ready]

    def release(self) -> list[tuple[m.Message, bool]]:
        """Every held MetricsMsg (stored with an ack, like every MetricsMsg), now: behind
        the rank's reports, or before it says Exiting."""
        settled, self.settled, self.acked_held, self.due = self.settled, [], 0, None
        return [(x, True) for x in settled]
