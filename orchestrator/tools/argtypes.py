"""The argparse types of every ``ddpbus`` subcommand: each turns one flag's text into its
value or raises ``ArgumentTypeError`` with the reason (argparse prints it, exit 2)."""

from __future__ import annotations

import argparse

from ddpbus.codecs import subjects as sj
from ddpbus.codecs.errors import ConfigError

INF = float("inf")


def _number(text: str, kind: type[int] | type[float], what: str) -> int | float:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def nonneg(text: str) -> int:
    value = int(_number(text, int, "an integer"))
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def positive(text: str) -> int:
    value = int(_number(text, int, "an integer"))
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def port(text: str) -> int:
    value = int(_number(text, int, "a port number"))
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0-65535; 0 = any free port)")
    return value


def _finite(text: str, what: str, low: float, *, closed: bool, rule: str) -> float:
    """A finite float above ``low`` (or at it, ``closed``); NaN and infinity are refused."""
    value = float(_number(text, float, what))
    if not ((value >= low if closed else value > low) and value < INF):
        raise argparse.ArgumentTypeError(f"{text} {rule}")
    return value


def seconds(text: str) -> float:
    return _finite(text, "a number of seconds", 0.0, closed=False,
                   rule="must be a positive number of seconds")


def nonneg_seconds(text: str) -> float:
    return _finite(text, "a number of seconds", 0.0, closed=True,
                   rule="must be a number of seconds >= 0")


def positive_float(text: str) -> float:
    return _finite(text, "a number", 0.0, closed=False, rule="must be a finite number > 0")


def slowdown(text: str) -> float:
    return _finite(text, "a number", 1.0, closed=True, rule="must be >= 1 (how many times slower)")


def byte_limit(text: str) -> int:
    value = int(_number(text, int, "a number of bytes"))
    if value < 1 and value != -1:
        raise argparse.ArgumentTypeError(f"{value} must be a positive number of bytes, or "
                                         "-1 for unlimited")
    return value


def device(text: str) -> str:
    """A worker's device: auto, cpu, cuda or cuda:N."""
    value = text.strip().lower()
    if value in ("auto", "cpu", "cuda") or (value.startswith("cuda:")
                                             and value[5:].isdigit()):
        return value
    raise argparse.ArgumentTypeError(f"{text!r} is not a device: auto, cpu, cuda or cuda:N")


def job(text: str) -> str:
    try:
        return sj.check_job(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def kill_spec(text: str) -> tuple[int, float]:
    count, at, secs = text.partition("@")
    try:
        spec = int(count), float(secs)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not COUNT@SECONDS") from None
    if not at or spec[0] < 1 or not 0 <= spec[1] < INF:
        raise argparse.ArgumentTypeError(f"{text!r}: COUNT@SECONDS with COUNT >= 1 and "
                                         "SECONDS >= 0")
    return spec
