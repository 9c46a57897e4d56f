"""``ddpbus run``: train a spec on this machine (embedded broker, coordinator, N workers)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ddpbus.orchestrator.tools import argtypes, flags

NAME = "run"
ENV = {"workers": "DDPBUS_WORKERS", "out": "DDPBUS_OUT", "policy": "DDPBUS_POLICY",
       "backend": "DDPBUS_BACKEND"}

# shown under the subcommand's --help
EXAMPLES = (
    'ddpbus run examples/digits.py:spec --workers 2',
    'ddpbus run my_job.py:spec --workers 4 --policy async --epochs 10',
    'ddpbus run my_job.py:spec --epochs 40 --resume ddpbus-runs/<job>',
)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    run_: argparse.ArgumentParser = sub.add_parser(
        NAME, help="train a spec on this machine (broker + coordinator + N workers)",
        description="Start the embedded broker, a coordinator and N worker processes on this "
        "machine, show progress, print the result. Ctrl-C stops everything cleanly.")
    run_.add_argument("spec", help="training spec: file.py:name or module:name")
    run_.add_argument("--workers", type=argtypes.positive, help="number of worker processes "
                      "(env DDPBUS_WORKERS; default 2)")
    flags.schedule(run_)
    run_.add_argument("--slowdown", action="append", default=[], metavar="RANK=FACTOR",
                      help="SIMULATION: make rank RANK's batches FACTOR times slower; "
                      "repeatable")
    run_.add_argument("--summary", type=Path, help="write the run summary JSON here")
    run_.add_argument("--out", type=Path, help="run directory: logs, events, consensus model "
                      "(default: ./ddpbus-runs/<job>)")
    run_.add_argument("--job", type=argtypes.job, help="job name (default: a fresh one)")
    run_.add_argument("--torch-threads", type=argtypes.positive, help="torch threads per "
                      "worker (default: cores / workers)")
    run_.add_argument("--device", type=argtypes.device, default="auto", help="every worker's "
                      "device: auto (default: cuda:<rank mod count> with CUDA, else cpu), "
                      "cpu, cuda, cuda:N")
    run_.add_argument("--no-progress", action="store_true", help="no live progress display")
    run_.add_argument("--wire-json", action="store_true", help="proto3 JSON payloads")
    run_.add_argument("--resume", metavar="DIR", help="continue from the latest resume "
                      "bundle of an earlier run's directory (or a bundle directory)")
    run_.add_argument("--no-auth", action="store_true", help="an open broker: no "
                      "per-identity credentials or subject permissions (messages are still "
                      "signed with the job key); for watching with a plain `nats sub`")
    return run_


def run(args: argparse.Namespace) -> int:
    from ddpbus.orchestrator.tools.local_run import LocalRun

    return LocalRun.from_args(args).run()
