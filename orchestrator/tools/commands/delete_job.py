"""``ddpbus delete-job``: delete a finished job's stream, KV bucket and Object Stores."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from ddpbus.orchestrator.tools import flags
from ddpbus.orchestrator.transport.auth import COORDINATOR

NAME = "delete-job"
ENV = {"job": "DDPBUS_JOB", "nats": "DDPBUS_NATS_URL", "timeout": "DDPBUS_TIMEOUT",
       **flags.NATS_LOGIN_ENV}

# shown under the subcommand's --help
EXAMPLES = (
    'ddpbus delete-job --job digits --dry-run   # what would go',
    'ddpbus delete-job --job digits --nats nats://nats:4222 --nats-nkey coordinator.nk',
    'ddpbus delete-job --job digits --force     # one that never finished',
)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    delete: argparse.ArgumentParser = sub.add_parser(
        NAME, help="delete a finished job's stream, KV bucket and Object Stores",
        description="Delete everything a job holds on the broker: its stream, KV bucket and "
        "the Object Stores of its rounds and resume bundles (status, replay, report and "
        "--resume JOB read them: delete a job once nothing needs its record). Refuses a "
        "running job (its lease held, or a beat heard within 2.5 s) and, without --force, "
        "one that has not finished (no run summary). Files under a --bundle-dir stay.")
    flags.job_and_server(delete)
    delete.add_argument("--force", action="store_true", help="delete a job that has not "
                        "finished too (never a running one)")
    delete.add_argument("--dry-run", action="store_true", help="say what would be deleted, "
                        "delete nothing")
    flags.timeout(delete)
    flags.nats_login(delete)
    return delete


def run(args: argparse.Namespace) -> int:
    from ddpbus.orchestrator.tools import delete_job

    flags.require(args, [("--job", "job"), ("--nats", "nats")], NAME)
    # the coordinator's rights cover its job's streams, and only those
    lines = asyncio.run(delete_job.delete(flags.nats_access(args, COORDINATOR), args.job,
                                          force=args.force, dry_run=args.dry_run))
    sys.stdout.write("".join(f"{line}\n" for line in lines))
    return 0
