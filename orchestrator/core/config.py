"""Run settings: the scheduler knobs with the reference defaults, validated once.

A :class:`Schedule` is built from the user's training spec (``TrainSpec(knobs={...})``),
then overridden by command-line flags (``--policy``, ``--knob name=value``), and checked as
a whole before anything starts: an unknown knob, a wrong type or a value out of range is a
:class:`~ddpbus.codecs.errors.ConfigError` naming the knob and what it accepts. Defaults
follow the newest flodl generation.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Final

from ddpbus.codecs import messages as m
from ddpbus.codecs.errors import ConfigError

Policy = m.Policy
Backend = m.Backend

DEFAULT_ANCHOR: Final = 10
"""Batches of the slowest rank per averaging window (cadence/async); sync uses 1."""
AUTO_REPORT_INTERVAL_MS: Final = 100.0
"""The auto report interval of cohorts up to a hundred ranks (1 ms per rank beyond)."""
MAX_REPORT_INTERVAL: Final = timedelta(seconds=10)


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """Everything the coordinator decides a run with. Build it with :func:`schedule_from`."""

    policy: Policy = Policy.CADENCE
    backend: Backend = Backend.AUTO
    batch_size: int = 32
    epochs: int = 1
    seed: int = 42
    # El Che (C.1.2)
    anchor: int = DEFAULT_ANCHOR
    max_anchor: int = 1000
    min_anchor: int | None = None  # None: the initial anchor
    overhead_target: float = 0.05
    max_batch_diff: int | None = None
    relax_up: bool | None = None  # None: on for async
    max_overshoot: int | None = None  # async lookahead per window; None: derived
    # divergence guard (C.4)
    divergence_guard: bool = True
    # the learning-rate-aware window controller (core/meta.py): may shrink the window on an
    # LR cliff or a run of suppressed verdicts
    window_controller: bool = True
    divergence_threshold: float | None = None  # None: 0.3 under EASGD, else 0.05
    # averaging (C.3) and LR (C.11)
    gamma: float = 1.0
    lr_scale_ratio: float = 1.0
    # the broker backend (C.3 CPU path): EASGD blend, bf16 tensors on the wire, and how long
    # a round waits for snapshots before the late ranks' share is soft-aborted (retried)
    easgd_alpha: float | None = None  # None: 0.5 for async on the broker backend, else 1
    bf16_wire: bool = False
    snapshot_timeout: timedelta = field(default=timedelta(seconds=10))
    # dispatch (C.5): None = on for cadence/async, off for sync
    progressive: bool | None = None
    # liveness (D.2)
    heartbeat_timeout: timedelta = field(default=timedelta(seconds=30))
    # a rank whose broker connection closed (the broker's disconnect advisory, where the
    # coordinator has a system-account login) and did not come back within this is dead
    # at once, without waiting for the heartbeat timeout; a reconnect inside it (a network
    # blip, a connection the broker dropped) keeps the rank
    disconnect_grace: timedelta = field(default=timedelta(seconds=0.5))
    coordinator_timeout: timedelta = field(default=timedelta(seconds=30))
    collective_timeout: timedelta | None = None  # None: heartbeat_timeout + 2 s (D.2)
    # the backstop (D.5): an average unsettled this long, alive ranks still silent about it,
    # ends the run (ShutdownWithSave REDUCE_STALL); None: max(10 x heartbeat_timeout, 300 s)
    reduce_stall_timeout: timedelta | None = None
    # fault tolerance (D.2): the run ends once this many ranks died ("3") or this share
    # of the world ("25%"); None tolerates any partial loss
    max_failure: str | None = None
    min_world: int = 1  # fewer alive ranks than this ends the run (SingleSurvivor at 2)
    # callbacks (C.10)
    eval_every: int = 1  # epochs between evals when the spec has an eval function; 0 = never
    checkpoint_every: int = 0  # epochs between checkpoints; 0 = only the final one
    bundle_every: int = 1  # epochs between resume bundles; 0 = only with checkpoints
    callback_rank: int | None = None  # None: the fastest rank (sticky)
    param_norm_every: int = 10  # Batch.param_norm every N local steps; 0 = never
    # telemetry: a rank sends its per-batch reports at most this often, coalesced into one
    # Reports (the window-closing Batch goes at once); 0 = every report alone; None: auto
    report_interval: timedelta | None = None

    @property
    def is_sync(self) -> bool:
        return self.policy is Policy.SYNC

    @property
    def effective_anchor(self) -> int:
        """Sync averages after every step: its window is one batch."""
        return 1 if self.is_sync else self.anchor

    @property
    def effective_min_anchor(self) -> int:
        return self.min_anchor if self.min_anchor is not None else self.effective_anchor

    @property
    def effective_progressive(self) -> bool:
        return (not self.is_sync) if self.progressive is None else self.progressive

    @property
    def effective_relax_up(self) -> bool:
        return (self.policy is Policy.ASYNC) if self.relax_up is None else self.relax_up

    @property
    def effective_easgd_alpha(self) -> float:
        """1 overwrites (plain averaging); below 1 each rank moves that share of the way
        toward the consensus (EASGD: default 0.5 for async on the broker)."""
        if self.easgd_alpha is not None:
            return self.easgd_alpha
        return 0.5 if self.policy is Policy.ASYNC and self.backend is Backend.BROKER else 1.0

    @property
    def effective_divergence_threshold(self) -> float:
        """The guard's threshold: 0.05 where an average overwrites
        every replica, 0.3 where EASGD blends (alpha < 1: replicas stay further apart by
        design, and 0.05 would veto growth for good)."""
        if self.divergence_threshold is not None:
            return self.divergence_threshold
        return 0.3 if self.effective_easgd_alpha < 1 else 0.05

    def overshoot(self, epoch_batches: int) -> int:
        """Async lookahead per window (C.5): ``clamp(batches / 100, 2, 5)`` unless set."""
        if self.policy is not Policy.ASYNC:
            return 0
        if self.max_overshoot is not None:
            return self.max_overshoot
        return min(5, max(2, epoch_batches // 100))

    def report_interval_ms(self, world_size: int) -> float:
        """Auto: 100 ms, and 1 ms per rank beyond a hundred ranks, so the coordinator takes
        at most ~1,000 report messages a second from the whole cohort (plus the
        heartbeats) however large it grows and however short the batches are."""
        if self.report_interval is not None:
            return self.report_interval.total_seconds() * 1000.0
        return max(AUTO_REPORT_INTERVAL_MS, float(world_size))

    def run_config(self, dataset_size: int, world_size: int) -> m.RunConfig:
        """What every rank adopts on Accept."""
        return m.RunConfig(
            policy=self.policy, backend=self.backend, batch_size=self.batch_size,
            epochs=self.epochs, seed=self.seed, gamma=self.gamma,
            lr_scale_ratio=self.lr_scale_ratio, dataset_size=dataset_size,
            param_norm_every=self.param_norm_every,
            coordinator_timeout_s=self.coordinator_timeout.total_seconds(),
            progressive=self.effective_progressive,
            collective_timeout_s=self.effective_collective_timeout.total_seconds(),
            easgd_alpha=self.effective_easgd_alpha, bf16_wire=self.bf16_wire,
            report_interval_ms=self.report_interval_ms(world_size),
        )

    @property
    def effective_collective_timeout(self) -> timedelta:
        """How long a collective may hang on a silent peer before it fails (flodl's
        window-completion ceiling: heartbeat timeout + 2 s)."""
        if self.collective_timeout is not None:
            return self.collective_timeout
        return self.heartbeat_timeout + timedelta(seconds=2)

    @property
    def effective_reduce_stall_timeout(self) -> timedelta:
        """How long an average may stay unsettled with its alive ranks silent about it
        (flodl's reduce-stall ceiling, D.5)."""
        if self.reduce_stall_timeout is not None:
            return self.reduce_stall_timeout
        return max(10 * self.heartbeat_timeout, timedelta(seconds=300))

    def failure_limit(self, world_size: int) -> int | None:
        """Deaths that end the run (``max_failure``), or None for no limit."""
        if self.max_failure is None:
            return None
        text = self.max_failure.strip()
        if text.endswith("%"):
            share = min(max(float(text[:-1]) / 100.0, 0.0), 1.0)
            return max(1, math.ceil(share * world_size))
        return int(text)


# ------------------------------------------------------------------------ parsing


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in {"1", "true", "yes", "on"}:
        return True
    if isinstance(value, str) and value.lower() in {"0", "false", "no", "off"}:
        return False
    raise ValueError("expected true or false")


def _int(value: Any) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError("expected an integer")
    return int(value)


def _float(value: Any) -> float:
    if isinstance(value, bool):
        raise TypeError("expected a number")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError("expected a finite number")
    return out


def _seconds(value: Any) -> timedelta:
    if isinstance(value, timedelta):
        return value
    return timedelta(seconds=_float(value))


def _failure(value: Any) -> str:
    text = str(value).strip()
    number = text[:-1] if text.endswith("%") else text
    try:
        ok = float(number) > 0 if text.endswith("%") else int(number) >= 1
    except ValueError:
        ok = False
    if not ok or isinstance(value, bool):
        raise ValueError('expected a count of ranks ("2") or a share ("25%")')
    return text


def _optional(conv: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def parse(value: Any) -> Any:
        if value is None or (isinstance(value, str) and value.lower() in {"none", "auto"}):
            return None
        return conv(value)
    return parse


def _enum(cls: type[Policy] | type[Backend]) -> Callable[[Any], Any]:
    def parse(value: Any) -> Any:
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ValueError("expected one of " + " | ".join(v.value for v in cls)) from None
    return parse


_PARSERS: Final[dict[str, Callable[[Any], Any]]] = {
    "policy": _enum(Policy),
    "backend": _enum(Backend),
    "batch_size": _int,
    "epochs": _int,
    "seed": _int,
    "anchor": _int,
    "max_anchor": _int,
    "min_anchor": _optional(_int),
    "overhead_target": _float,
    "max_batch_diff": _optional(_int),
    "relax_up": _optional(_bool),
    "max_overshoot": _optional(_int),
    "divergence_guard": _bool,
    "window_controller": _bool,
    "divergence_threshold": _optional(_float),
    "gamma": _float,
    "lr_scale_ratio": _float,
    "easgd_alpha": _optional(_float),
    "bf16_wire": _bool,
    "snapshot_timeout": _seconds,
    "progressive": _optional(_bool),
    "heartbeat_timeout": _seconds,
    "disconnect_grace": _seconds,
    "coordinator_timeout": _seconds,
    "collective_timeout": _optional(_seconds),
    "reduce_stall_timeout": _optional(_seconds),
    "max_failure": _optional(_failure),
    "min_world": _int,
    "eval_every": _int,
    "checkpoint_every": _int,
    "bundle_every": _int,
    "callback_rank": _optional(_int),
    "param_norm_every": _int,
    "report_interval": _optional(_seconds),
}

KNOBS: Final = tuple(_PARSERS)
"""Every setting a spec's ``knobs`` mapping or ``--knob name=value`` may name."""


def _check(s: Schedule) -> None:
    rules: list[tuple[bool, str]] = [
        (s.batch_size >= 1, "batch_size must be >= 1"),
        (s.epochs >= 1, "epochs must be >= 1"),
        (s.seed >= 0, "seed must be >= 0"),
        (s.anchor >= 1, "anchor must be >= 1"),
        (s.max_anchor >= s.effective_anchor, f"max_anchor ({s.max_anchor}) must be >= anchor "
                                             f"({s.effective_anchor})"),
        (s.min_anchor is None or 1 <= s.min_anchor <= s.anchor,
         "min_anchor must be in 1..anchor"),
        (0.01 <= s.overhead_target <= 0.5, "overhead_target must be in [0.01, 0.5]"),
        (s.max_batch_diff is None or s.max_batch_diff >= 0, "max_batch_diff must be >= 0"),
        (s.max_overshoot is None or s.max_overshoot >= 0, "max_overshoot must be >= 0"),
        (s.max_overshoot is None or s.policy is Policy.ASYNC,
         "max_overshoot only applies to policy async (barrier-paced policies never overshoot)"),
        (s.effective_divergence_threshold > 0, "divergence_threshold must be > 0"),
        (-4.0 <= s.gamma <= 4.0, "gamma must be in [-4, 4] (1 = work weighted, 0 = equal)"),
        (s.lr_scale_ratio >= 0, "lr_scale_ratio must be >= 0 (0 disables LR scaling)"),
        (s.easgd_alpha is None or 0 < s.easgd_alpha <= 1, "easgd_alpha must be in (0, 1]"),
        (s.effective_easgd_alpha == 1 or s.backend is Backend.BROKER,
         f"easgd_alpha < 1 needs backend broker: the {s.backend.value} collectives overwrite "
         "every replica in place and keep no consensus copy to blend toward"),
        (s.effective_easgd_alpha == 1 or not s.is_sync,
         "easgd_alpha < 1 does not combine with policy sync: sync keeps every replica equal "
         "after every step, a blend would not"),
        (not s.bf16_wire or s.backend is Backend.BROKER,
         f"bf16_wire needs backend broker (the {s.backend.value} collectives reduce the "
         "parameters' own dtype in place)"),
        (s.snapshot_timeout > timedelta(0), "snapshot_timeout must be positive"),
        (s.heartbeat_timeout > timedelta(0), "heartbeat_timeout must be positive"),
        (timedelta(seconds=0.05) <= s.disconnect_grace <= s.heartbeat_timeout,
         "disconnect_grace must be in [0.05 s, heartbeat_timeout]: shorter takes a "
         "reconnecting rank for dead, longer than the heartbeat timeout never decides"),
        (s.coordinator_timeout > timedelta(0), "coordinator_timeout must be positive"),
        (s.collective_timeout is None or s.collective_timeout > timedelta(0),
         "collective_timeout must be positive"),
        (s.reduce_stall_timeout is None or s.reduce_stall_timeout > timedelta(0),
         "reduce_stall_timeout must be positive"),
        (s.min_world >= 1, "min_world must be >= 1"),
        (s.eval_every >= 0, "eval_every must be >= 0"),
        (s.checkpoint_every >= 0, "checkpoint_every must be >= 0"),
        (s.bundle_every >= 0, "bundle_every must be >= 0"),
        (s.callback_rank is None or s.callback_rank >= 0, "callback_rank must be >= 0"),
        (s.param_norm_every >= 0, "param_norm_every must be >= 0"),
        (s.report_interval is None or timedelta(0) <= s.report_interval <= MAX_REPORT_INTERVAL,
         "report_interval must be in [0, 10] seconds (0 sends every batch report alone)"),
    ]
    for ok, text in rules:
        if not ok:
            raise ConfigError(text)


def _unknown(name: str) -> ConfigError:
    close = difflib.get_close_matches(name, KNOBS, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"unknown knob {name!r}{hint}; known knobs: {', '.join(KNOBS)}")


def schedule_from(*layers: Mapping[str, Any]) -> Schedule:
    """Merge knob mappings (later layers win) into a checked :class:`Schedule`.

    Values may be typed (``{"anchor": 20}``) or text from a command line
    (``{"anchor": "20"}``). ``None`` in a later layer means "not given".
    """
    values: dict[str, Any] = {}
    for layer in layers:
        for name, raw in layer.items():
            if name not in _PARSERS:
                raise _unknown(name)
            if raw is None and name not in values:
                continue
            try:
                values[name] = _PARSERS[name](raw)
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"knob {name}={raw!r}: {exc}") from None
    schedule = Schedule(**values)
    _check(schedule)
    # resolved once here, from the policy and backend it depends on (a resume bundle and
    # the run summary then name the number the guard used)
    return dataclasses.replace(schedule,
                               divergence_threshold=schedule.effective_divergence_threshold)


def parse_knob_assignments(items: list[str]) -> dict[str, str]:
    """``["anchor=20", "gamma=0.5"]`` -> ``{"anchor": "20", "gamma": "0.5"}`` (checked later)."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ConfigError(f"--knob {item!r}: expected NAME=VALUE")
        name = name.strip().replace("-", "_")
        if name not in _PARSERS:
            raise _unknown(name)
        out[name] = value.strip()
    return out


def describe(schedule: Schedule) -> dict[str, Any]:
    """The schedule as plain JSON-able values (for logs, KV and the run summary)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(schedule):
        value = getattr(schedule, f.name)
        if isinstance(value, Policy | Backend):
            value = value.value
        elif f.name == "easgd_alpha":
            value = schedule.effective_easgd_alpha
        elif f.name == "divergence_threshold":
            value = schedule.effective_divergence_threshold
        elif value is None and f.name.endswith("_timeout"):
            value = None
        elif isinstance(value, timedelta):
            value = value.total_seconds()
        out[f.name] = value
    return out
