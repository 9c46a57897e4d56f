"""Chaos-suite helpers: how many runs of each fault were made (printed at the end), and a
seeded random source per scenario whose seed is printed, so a failure can be replayed
(``DDPTEST_CHAOS_SEED=<seed>``)."""

from __future__ import annotations

import os
import random
import time
import zlib
from collections import Counter

import pytest

FAULTS: Counter[str] = Counter()


def loops(default: int, full: int) -> list[object]:
    """Run indices for a looped scenario: ``default`` runs, or ``full`` with
    DDPTEST_CHAOS_FULL=1 (those beyond the default are marked slow)."""
    n = full if os.environ.get("DDPTEST_CHAOS_FULL") == "1" else default
    return [i if i < default else pytest.param(i, marks=pytest.mark.slow) for i in range(n)]


def scenario_rng(name: str) -> tuple[random.Random, int]:
    """The scenario's own fixed seed, so that a run is the same run each time (the moment of
    a kill still varies with scheduling, which the assertions allow for);
    ``DDPTEST_CHAOS_SEED=N`` replays seed N, ``DDPTEST_CHAOS_SEED=random`` draws a new one
    per run (the flake hunt, ``make flake-hunt``)."""
    given = os.environ.get("DDPTEST_CHAOS_SEED", "")
    if given == "random":
        seed = random.Random(f"{name}-{time.time_ns()}").randrange(2**32)
    else:
        seed = int(given) if given else zlib.crc32(name.encode())
    print(f"chaos {name}: seed {seed} (replay: DDPTEST_CHAOS_SEED={seed})")
    return random.Random(seed), seed
