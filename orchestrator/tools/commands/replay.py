"""``ddpbus replay``: a recorded run's timeline, told from its stream."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from ddpbus.orchestrator.tools import argtypes, flags
from ddpbus.orchestrator.transport.auth import OBSERVER

NAME = "replay"
ENV = flags.READER_ENV

# shown under the subcommand's --help
EXAMPLES = (
    'ddpbus replay --job digits --key-file job.key',
    'ddpbus replay --job digits --key-file job.key --speed 10   # 10x the recorded pace',
)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        NAME, help="a recorded run's timeline, from its stream",
        description="Tell a job's run from its stream: joins and admissions, sessions, "
        "averages, epochs, evals, bundles, deaths, rejoins, exits and the end, each line "
        "stamped with the time since the run began.")
    flags.reader(p)
    p.add_argument("--speed", type=argtypes.positive_float, help="X times the recorded pace "
                   "(default: as fast as it reads; 1 = real time)")
    return p


def run(args: argparse.Namespace) -> int:
    from ddpbus.orchestrator.tools import replay

    key = flags.reader_key(args, NAME)
    return asyncio.run(replay.replay(flags.nats_access(args, OBSERVER), args.job, key,
                                     speed=args.speed))
