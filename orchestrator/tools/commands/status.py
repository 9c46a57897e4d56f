"""``ddpbus status``: where a job stands, from its KV bucket and stream."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from ddpbus.orchestrator.tools import flags
from ddpbus.orchestrator.transport.auth import OBSERVER

NAME = "status"
ENV = flags.READER_ENV

# shown under the subcommand's --help
EXAMPLES = (
    'ddpbus status --job digits --key-file job.key',
    'ddpbus status --job digits --key-file job.key --json --timeout 2',
    'ddpbus status --job digits --key-file job.key --nats nats://nats:4222 --nats-nkey observer.nk',
)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        NAME, help="where a job stands",
        description="A job's phase, epoch, global step, averaging rounds, members "
        "(generation, liveness, batch share), El Che anchor and counts, last checkpoint, "
        "leader lease and stream, from its KV bucket and stream. Reads only.")
    flags.reader(p)
    p.add_argument("--json", action="store_true", help="JSON instead of text")
    return p


def run(args: argparse.Namespace) -> int:
    from ddpbus.orchestrator.tools import status

    key = flags.reader_key(args, NAME)
    return asyncio.run(status.show(flags.nats_access(args, OBSERVER), args.job, key,
                                   as_json=args.json))
