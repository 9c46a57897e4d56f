"""The CLI's argparse types: each takes what it names and refuses the rest with a reason."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import pytest

from ddpbus.orchestrator.tools import argtypes as a


@pytest.mark.parametrize(("kind", "text", "value"), [
    (a.nonneg, "0", 0), (a.positive, "1", 1), (a.port, "0", 0), (a.port, "65535", 65535),
    (a.seconds, "0.5", 0.5), (a.nonneg_seconds, "0", 0.0), (a.positive_float, "2", 2.0),
    (a.slowdown, "1", 1.0), (a.byte_limit, "-1", -1), (a.job, "exp-1", "exp-1"),
    (a.kill_spec, "3@1.5", (3, 1.5)), (a.device, "auto", "auto"), (a.device, "CPU", "cpu"),
    (a.device, "cuda", "cuda"), (a.device, "cuda:3", "cuda:3"),
])
def test_takes_what_it_names(kind: Callable[[str], Any], text: str, value: object) -> None:
    assert kind(text) == value


@pytest.mark.parametrize(("kind", "text", "reason"), [
    (a.nonneg, "-1", ">= 0"), (a.positive, "0", ">= 1"), (a.positive, "x", "not an integer"),
    (a.port, "70000", "is not a port"), (a.seconds, "0", "positive number of seconds"),
    (a.seconds, "nan", "positive number of seconds"), (a.nonneg_seconds, "inf", ">= 0"),
    (a.nonneg_seconds, "soon", "is not a number of seconds"),
    (a.positive_float, "inf", "finite number > 0"), (a.slowdown, "0.5", "times slower"),
    (a.byte_limit, "0", "-1 for unlimited"), (a.job, "a.b", "job name"),
    (a.device, "tpu", "not a device: auto, cpu, cuda or cuda:N"), (a.device, "cuda:x", "device"),
    (a.device, "cuda:", "device"),
    (a.kill_spec, "3", "COUNT@SECONDS"), (a.kill_spec, "0@1", "COUNT >= 1"),
])
def test_refuses_the_rest_with_a_reason(kind: Callable[[str], Any], text: str,
                                        reason: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=reason):
        kind(text)
