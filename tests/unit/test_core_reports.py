"""Coalesced per-batch reports (TimingMsg.Reports) in the pure core.

A Reports must do exactly what its items do when they arrive one by one: the same commands
(SyncNow, the next window, records) and the same books, whatever the grouping. Two cores
are fed the same training run, one with single Batch / LrUpdate messages, the other with
Reports of a few items each, and compared after every send.
"""

from __future__ import annotations

import statistics
from collections import Counter

import pytest
from core_harness import Core, formed, records, refusals, sends

from ddpbus.codecs import messages as m
from ddpbus.orchestrator.core.coalesce import ReportBuffer, hold_share
from ddpbus.orchestrator.core.state import Command, Phase, Timing
from ddpbus.orchestrator.persist import snapshot


def _finished_by(core: Core, rank: int, n: int) -> list[tuple[int, int]]:
    """(epoch, size) of the plans that ``n`` more batches of ``rank`` complete."""
    done, left = [], n
    for a in core.state.ranks[rank].queue:
        if a.complete:
            continue
        if a.remaining > left:
            break
        done.append((a.epoch, a.size))
        left -= a.remaining
    return done


def _send(core: Core, rank: int, n: int, *, group: int) -> list[Command]:
    """``n`` batches of ``rank`` (each with the LR it used), as single messages
    (``group`` 1) or as Reports of up to ``group`` batches; then the MetricsMsg of every
    plan they finished, as a worker sends them (its reports first)."""
    finished = _finished_by(core, rank, n)
    items: list[m.Batch | m.LrUpdate] = []
    for _ in range(n):
        core.steps[rank] += 1
        step = core.steps[rank]
        items += [m.Batch(rank=rank, batch_ms=1.0 + 0.1 * rank + 0.01 * (step % 7),
                          data_ms=0.05, step_count=step, batch_loss=1.0 / step),
                  m.LrUpdate(rank=rank, lr=0.1 / step)]
    out: list[Command] = []
    per = 2 * group
    for i in range(0, len(items), per):
        chunk = items[i:i + per]
        if group == 1:
            for item in chunk:
                out += core.feed(Timing(item))
        else:
            out += core.feed(Timing(m.Reports(rank=rank, items=tuple(chunk))))
    for epoch, size in finished:
        out += core.metrics(rank, epoch, size)
    return out


def _run(group: int, windows: int = 30) -> tuple[list[list[Command]], Core]:
    """A 2-rank cadence run, window by window: each rank trains to its budget (rank 1 in
    two bursts), then both answer the SyncNow; returns each step's commands."""
    core = formed(policy="cadence", epochs=4)
    steps: list[list[Command]] = []
    for w in range(windows):
        if core.state.phase is not Phase.TRAINING:
            break
        core.now = float(w)
        for rank in (0, 1):
            r = core.state.ranks[rank]
            todo = max(0, r.budget - r.steps)
            first = todo // 2 if rank == 1 else todo
            steps.append(_send(core, rank, first, group=group))
            core.now += 0.25
            steps.append(_send(core, rank, todo - first, group=group))
        steps += [core.ack(rank) for rank in (0, 1) if not core.state.ranks[rank].acked]
    return steps, core


@pytest.mark.parametrize("group", [2, 3, 7, m.MAX_REPORT_ITEMS // 2])
def test_reports_do_exactly_what_their_items_do_alone(group: int) -> None:
    single, a = _run(group=1)
    grouped, b = _run(group=group)
    assert len(sends([c for s in single for c in s], m.SyncNow)) >= 8  # averaged a lot
    assert grouped == single
    for ra, rb in zip(a.state.ranks, b.state.ranks, strict=True):
        assert (rb.step, rb.batches_total, rb.lr, rb.last_loss) == (
            ra.step, ra.batches_total, ra.lr, ra.last_loss)
        assert rb.lr == pytest.approx(0.1 / rb.step)  # the last LrUpdate of its last Reports
    assert (b.state.global_step, b.state.rounds) == (a.state.global_step, a.state.rounds)
    assert b.state.elche.counts == a.state.elche.counts
    # the whole state, not only the books above (a Reports looks at the gate once while
    # another rank holds it shut, where its items alone looked once each)
    assert snapshot.tree(b.state) == snapshot.tree(a.state)


def test_a_reports_closing_the_window_opens_the_gate() -> None:
    core = formed(policy="cadence")
    budget = [core.state.ranks[r].budget for r in (0, 1)]
    _send(core, 0, budget[0], group=8)
    out = _send(core, 1, budget[1], group=budget[1])
    assert len(sends(out, m.SyncNow)) == 1
    assert records(out, "average")[0]["steps"] == {0: budget[0], 1: budget[1]}


def test_a_reports_of_a_stale_step_is_refused_item_by_item() -> None:
    """A re-sent Reports whose batches were booked already changes nothing."""
    core = formed(policy="cadence")
    first = m.Reports(rank=0, items=(
        m.Batch(rank=0, batch_ms=1.0, data_ms=0.0, step_count=1),
        m.Batch(rank=0, batch_ms=1.0, data_ms=0.0, step_count=2)))
    assert not refusals(core.feed(Timing(first)))
    r = core.state.ranks[0]
    before = (r.step, r.steps, r.compute_ms)
    assert refusals(core.feed(Timing(first))) == ["stale-batch", "stale-batch"]
    assert (r.step, r.steps, r.compute_ms) == before


# ------------------------------------------------- the sender's rule (worker, simulate)


def _b(step: int) -> m.Batch:
    return m.Batch(rank=2, batch_ms=1.0, data_ms=0.0, step_count=step)


def test_reports_are_held_until_the_interval_then_go_as_one() -> None:
    buf = ReportBuffer(2)
    lr = m.LrUpdate(rank=2, lr=0.1)
    assert not buf.add([_b(1), lr], 8.0, 100.0, closing=False)
    assert not buf.add([_b(2)], 8.0625, 100.0, closing=False)
    assert buf.add([_b(3)], 8.125, 100.0, closing=False)  # the oldest is 125 ms old
    assert buf.take(100.0, durable=False) == [
        (m.Reports(rank=2, items=(_b(1), lr, _b(2), _b(3))), False)]
    assert buf.items == []
    assert not buf.add([_b(4)], 8.1875, 100.0, closing=False)  # a new interval begins


def test_ranks_hold_their_reports_for_spread_shares_of_the_interval() -> None:
    shares = [hold_share(r) for r in range(1024)]
    assert all(0.75 <= x <= 1.25 for x in shares)
    assert abs(statistics.mean(shares) - 1.0) < 0.01  # the cohort's rate is the interval's
    # evenly spread: every tenth of the range holds about a tenth of the ranks, so the
    # cohort's sends never line up into one burst an interval
    tenths = Counter(min(9, int((x - 0.75) * 20)) for x in shares)
    assert all(90 <= tenths[k] <= 115 for k in range(10)), tenths
    buf = ReportBuffer(1)  # share 1.059: an interval of 100 ms holds them 105.9 ms
    assert hold_share(1) == pytest.approx(1.059, abs=1e-3)
    assert not buf.add([_b(1)], 0.0, 100.0, closing=False)
    assert not buf.add([_b(2)], 0.105, 100.0, closing=False)
    assert buf.add([_b(3)], 0.106, 100.0, closing=False)


def test_a_closing_batch_sends_at_once_with_an_ack() -> None:
    buf = ReportBuffer(2)
    buf.add([_b(1)], 0.0, 1000.0, closing=False)
    assert buf.add([_b(2)], 0.001, 1000.0, closing=True)
    assert buf.take(1000.0, durable=True) == [(m.Reports(rank=2, items=(_b(1), _b(2))), True)]


def test_a_full_buffer_goes_before_it_outgrows_a_reports() -> None:
    buf = ReportBuffer(2)
    due = [buf.add([_b(i + 1), m.LrUpdate(rank=2, lr=1.0 / (i + 1))], 0.0, 1e9,
                   closing=False) for i in range(m.MAX_REPORT_ITEMS // 2)]
    assert due.index(True) == m.MAX_REPORT_ITEMS // 2 - 1  # at 256 items, never more
    ((msg, _),) = buf.take(1e9, durable=False)
    assert isinstance(msg, m.Reports)
    assert len(msg.items) == m.MAX_REPORT_ITEMS


def test_interval_zero_sends_every_report_alone_and_only_a_batch_acked() -> None:
    buf = ReportBuffer(2)
    lr = m.LrUpdate(rank=2, lr=0.1)
    assert buf.add([_b(1), lr], 0.0, 0.0, closing=False)
    assert buf.take(0.0, durable=True) == [(_b(1), True), (lr, False)]
    buf.add([_b(2)], 0.0, 50.0, closing=True)  # a lone report goes as itself
    assert buf.take(50.0, durable=True) == [(_b(2), True)]


def _mx(epoch: int) -> m.MetricsMsg:
    return m.MetricsMsg(rank=2, epoch=epoch, avg_loss=1.0, batches_processed=4,
                        epoch_ms=1.0, samples_processed=32)


def test_metrics_finished_mid_window_go_at_once() -> None:
    buf = ReportBuffer(2)
    buf.add([_b(1)], 0.0, 100.0, closing=False)
    assert buf.metrics(_mx(0)) == [(_mx(0), True)]


def test_metrics_behind_a_closing_flush_wait_for_the_ack_and_their_share() -> None:
    """Held past the SyncAck for the rank's share of the interval (0.868 for rank 2), so
    a thousand ranks' metrics reach the coordinator neither with their closing batches
    nor in one burst behind their acks; in order, and stored with an ack."""
    buf = ReportBuffer(2)
    buf.add([_b(1)], 0.0, 100.0, closing=True)
    buf.take(100.0, durable=True)
    assert buf.metrics(_mx(0)) == []
    assert buf.metrics(_mx(1)) == []  # behind the held one
    buf.take(100.0, durable=False)  # an empty flush (going idle) takes nothing along
    assert buf.due is None  # no time yet: the window is not over before the SyncAck
    assert buf.acked(5.0, 100.0) == []
    assert buf.due == pytest.approx(5.0 + 0.1 * hold_share(2))
    assert buf.overdue(5.08) == []
    assert buf.overdue(5.09) == [(_mx(0), True), (_mx(1), True)]
    assert buf.overdue(9.0) == []
    assert buf.due is None
    assert buf.metrics(_mx(2)) == [(_mx(2), True)]  # the next window's first, mid-window


def test_metrics_of_a_window_closed_since_wait_for_its_own_ack() -> None:
    """Short windows: the first window's metrics are still held when the next window
    closes; their time comes while the rank waits for that window's SyncNow. Only the
    acknowledged window's go: the new ones would reach the coordinator in front of the
    other ranks' closing batches (CI once caught one stored before its window's ack)."""
    buf = ReportBuffer(2)
    buf.add([_b(1)], 0.0, 100.0, closing=True)
    buf.take(100.0, durable=True)
    buf.metrics(_mx(0))
    buf.acked(1.0, 100.0)  # due at 1.0868
    buf.add([_b(2)], 1.01, 100.0, closing=True)  # the next window, closed at once
    buf.take(100.0, durable=True)
    assert buf.metrics(_mx(1)) == []
    assert buf.overdue(1.09) == [(_mx(0), True)]  # waiting for the SyncNow: not _mx(1)
    assert buf.settled == [_mx(1)]
    assert buf.overdue(5.0) == []  # no time of its own before its ack
    buf.acked(5.0, 100.0)
    assert buf.overdue(5.09) == [(_mx(1), True)]
    assert buf.settled == []


def test_held_metrics_go_behind_the_next_reports_when_sooner() -> None:
    buf = ReportBuffer(2)
    buf.add([_b(1)], 0.0, 100.0, closing=True)
    buf.take(100.0, durable=True)
    buf.metrics(_mx(0))
    buf.acked(1.0, 100.0)
    buf.add([_b(2)], 1.01, 100.0, closing=False)
    assert buf.take(100.0, durable=False) == [(_b(2), False), (_mx(0), True)]
    assert buf.due is None
    assert buf.overdue(5.0) == []


def test_held_metrics_go_right_behind_the_ack_with_interval_zero_and_before_exiting() -> None:
    buf = ReportBuffer(2)
    buf.add([_b(1)], 0.0, 0.0, closing=True)
    buf.take(0.0, durable=True)
    buf.metrics(_mx(0))
    assert buf.acked(1.0, 0.0) == [(_mx(0), True)]
    buf.add([_b(2)], 2.0, 100.0, closing=True)
    buf.take(100.0, durable=True)
    buf.metrics(_mx(1))
    assert buf.release() == [(_mx(1), True)]  # a rank about to say Exiting
