"""``ddpbus sub``: a job's traffic, verified and decoded (like ``nats sub``)."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from ddpbus.orchestrator.tools import argtypes, flags
from ddpbus.orchestrator.transport.auth import OBSERVER

NAME = "sub"
ENV = flags.READER_ENV

# shown under the subcommand's --help
EXAMPLES = (
    'ddpbus sub --job digits --key-file job.key                  # live, every subject',
    'ddpbus sub --job digits --key-file job.key --since 10m --rank 0',
    "ddpbus sub 'timing.>' --job digits --key-file job.key --json --count 5",
    'NATS_URL=nats://nats:4222 ddpbus sub --job digits --key-file job.key --since 1 --follow',
)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        NAME, help="show a job's traffic, decoded",
        description="Like `nats sub`, but every message is verified with the job key and "
        "decoded: one line per message (time, stream sequence, subject, type, sender and "
        "generation, key fields) or JSON lines. Live unless --since reads the job's stream.")
    p.add_argument("subject", nargs="?", help="subject or wildcard inside the job "
                   "(default ddpbus.<job>.>)")
    flags.reader(p)
    p.add_argument("--rank", type=argtypes.nonneg, help="only this rank's messages")
    p.add_argument("--type", help="only this message type (Batch or TimingMsg.Batch)")
    p.add_argument("--json", action="store_true", help="JSON lines")
    p.add_argument("--since", metavar="SEQ|TIME", help="read the stream from this sequence, "
                   "age (10m, 2h) or ISO time up to its end, instead of live")
    p.add_argument("--follow", action="store_true", help="with --since: keep going after the "
                   "end of the stream")
    p.add_argument("--count", type=argtypes.positive, help="stop after N messages")
    return p


def run(args: argparse.Namespace) -> int:
    from ddpbus.orchestrator.tools import sub

    key = flags.reader_key(args, NAME)
    return asyncio.run(sub.from_args(args, key, flags.nats_access(args, OBSERVER)).run())
