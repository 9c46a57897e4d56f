"""The ``ddpbus`` subcommands: one module each, with ``NAME`` (the subcommand), ``ENV`` (flag
destination -> ``DDPBUS_*`` variable), ``add_parser(subparsers)`` and ``run(args) -> exit
status``. :mod:`ddpbus.orchestrator.tools.cli` dispatches to them in this order."""

from __future__ import annotations

from types import ModuleType

from ddpbus.orchestrator.tools.commands import (
    broker,
    coordinator,
    delete_job,
    init_job,
    replay,
    report,
    run,
    simulate,
    status,
    sub,
    worker,
)

ALL: tuple[ModuleType, ...] = (broker, init_job, delete_job, coordinator, worker, run, sub,
                               status, replay, report, simulate)
