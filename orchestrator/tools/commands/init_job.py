"""``ddpbus init-job``: create a job's JetStream resources (idempotent)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from ddpbus.orchestrator.tools import argtypes, flags
from ddpbus.orchestrator.transport.auth import COORDINATOR, Access

NAME = "init-job"
ENV = {"job": "DDPBUS_JOB", "nats": "DDPBUS_NATS_URL", "world_size": "DDPBUS_WORLD_SIZE",
       "timeout": "DDPBUS_TIMEOUT", **flags.NATS_LOGIN_ENV}

# shown under the subcommand's --help
EXAMPLES = (
    'ddpbus init-job --job digits --world-size 2 --nats nats://nats:4222',
    'NATS_URL=nats://nats:4222 ddpbus init-job --job digits --world-size 2',
)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    init: argparse.ArgumentParser = sub.add_parser(
        NAME, help="create a job's stream, KV bucket, Object Stores and consumers",
        description="Create (or update) the JetStream stream, KV bucket, Object Stores "
        "(rounds and bundles) and durable consumers of one job, per subjects.md. Idempotent.")
    flags.job_and_server(init)
    init.add_argument("--world-size", type=argtypes.positive, help="number of ranks "
                      "(env DDPBUS_WORLD_SIZE)")
    flags.timeout(init, flags.INIT_TIMEOUT_S)  # an init container may start before NATS
    flags.nats_login(init)
    return init


async def _init_job(nats: Access, job: str, world_size: int) -> str:
    from ddpbus.orchestrator.runtime.provision import ensure_job

    nc = await nats.connect(job, name=f"ddpbus-init-{job}")
    try:
        res = await ensure_job(nc.jetstream(), job, world_size)
    finally:
        await nc.close()
    return (f"stream {res.stream}, bucket {res.bucket}, consumers "
            f"{', '.join(res.consumers)}")


def run(args: argparse.Namespace) -> int:
    flags.require(args, [("--job", "job"), ("--nats", "nats"), ("--world-size", "world_size")],
                  NAME)
    # provisioning takes the coordinator's rights
    access = flags.nats_access(args, COORDINATOR)
    sys.stdout.write(asyncio.run(_init_job(access, args.job, args.world_size)) + "\n")
    return 0
