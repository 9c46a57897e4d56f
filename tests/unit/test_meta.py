"""The learning-rate-aware window controller (core/meta.py, flodl C.9): an LR cliff or a run
of suppressed verdicts shrinks El Che's window; what it leans on and what it leaves alone."""

from __future__ import annotations

import pytest
from core_harness import Core, formed, records

from ddpbus.codecs import messages as m
from ddpbus.orchestrator.core.elche import STABLE, GuardVerdict, Phase, Verdict
from ddpbus.orchestrator.core.meta import MetaController
from ddpbus.orchestrator.core.state import Command, Timing

SUPPRESS = GuardVerdict(Verdict.SUPPRESS_GROWTH)


def test_an_lr_cliff_nudges_down_once_and_a_gentle_decay_never() -> None:
    meta = MetaController()
    assert meta.observe(STABLE, lr=0.1, anchor=8, phase=Phase.STABLE) == (STABLE, [])
    assert meta.observe(STABLE, lr=0.08, anchor=8, phase=Phase.STABLE) == (STABLE, [])  # -20 %
    verdict, why = meta.observe(STABLE, lr=0.01, anchor=8, phase=Phase.STABLE)  # MultiStepLR
    assert why == ["lr-cliff"]
    assert verdict == GuardVerdict(Verdict.NUDGE_DOWN, factor=0.5)  # flat anchor: the base
    assert meta.observe(STABLE, lr=0.01, anchor=4, phase=Phase.STABLE) == (STABLE, [])
    assert meta.observe(STABLE, lr=0.05, anchor=4, phase=Phase.STABLE) == (STABLE, [])  # up


def test_a_rising_anchor_is_cut_harder_and_a_falling_one_gently() -> None:
    rising, falling = MetaController(), MetaController()
    for a in (4, 6, 8):
        rising.observe(STABLE, lr=0.1, anchor=a, phase=Phase.STABLE)
    for a in (8, 6, 4):
        falling.observe(STABLE, lr=0.1, anchor=a, phase=Phase.STABLE)
    hard, _ = rising.observe(STABLE, lr=0.01, anchor=10, phase=Phase.STABLE)
    soft, _ = falling.observe(STABLE, lr=0.01, anchor=2, phase=Phase.STABLE)
    assert hard.factor < 0.5 < soft.factor
    assert hard.factor >= 0.1
    assert soft.factor <= 0.95


@pytest.mark.parametrize(("phase", "runs", "base"), [
    (Phase.WARMUP, 5, 0.3), (Phase.STABLE, 3, 0.5), (Phase.MATURE, 2, 0.7)])
def test_suppressed_growth_k_averages_running_nudges_down(phase: Phase, runs: int,
                                                          base: float) -> None:
    meta = MetaController()
    for _ in range(runs - 1):
        assert meta.observe(SUPPRESS, lr=None, anchor=8, phase=phase)[1] == []
    verdict, why = meta.observe(SUPPRESS, lr=None, anchor=8, phase=phase)
    assert why == ["convergence"]
    assert verdict.factor == pytest.approx(base)
    meta.observe(STABLE, lr=None, anchor=8, phase=phase)  # a stable one breaks the run
    assert meta.observe(SUPPRESS, lr=None, anchor=8, phase=phase)[1] == []


def test_both_watchers_multiply_and_probe_or_disabled_never_fire() -> None:
    meta = MetaController()
    for lr in (0.1, 0.1):
        meta.observe(SUPPRESS, lr=lr, anchor=8, phase=Phase.MATURE)
    verdict, why = meta.observe(SUPPRESS, lr=0.01, anchor=8, phase=Phase.MATURE)
    assert why == ["lr-cliff", "convergence"]
    assert verdict.factor == pytest.approx(0.5 * 0.7)
    probe = MetaController()
    for _ in range(6):
        assert probe.observe(SUPPRESS, lr=None, anchor=8, phase=Phase.PROBE)[1] == []
    off = MetaController(enabled=False)
    off.observe(STABLE, lr=0.1, anchor=8, phase=Phase.STABLE)
    assert off.observe(STABLE, lr=0.001, anchor=8, phase=Phase.STABLE) == (STABLE, [])


def _average(core: Core, lr: float) -> list[Command]:
    out: list[Command] = []
    for r in core.state.ranks:
        out += core.feed(Timing(m.LrUpdate(rank=r.rank, lr=lr)))
        out += core.train(r.rank, r.target - r.steps)
    out += core.ack(0) + core.ack(1)
    return out


def test_the_ranks_lr_updates_reach_the_controller_and_shrink_the_window() -> None:
    core = formed(policy="cadence", progressive=False, epochs=50, anchor=8)
    _average(core, 0.1)
    before = core.state.elche.anchor
    out = _average(core, 0.01)  # the LR fell 90 % since the last average
    [nudge] = records(out, "window-nudge")
    assert nudge["why"] == ["lr-cliff"]
    out += _average(core, 0.01)  # the next window is opened under the verdict
    assert core.state.elche.anchor < before
    sync = formed(policy="sync", progressive=False, epochs=50)
    _average(sync, 0.1)
    assert not records(_average(sync, 0.01), "window-nudge")  # no window to shrink
