"""``ddpbus worker``: one rank's worker agent."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from ddpbus.codecs import subjects as sj
from ddpbus.orchestrator.tools import argtypes, flags

NAME = "worker"
ENV = {
    "job": "DDPBUS_JOB", "nats": "DDPBUS_NATS_URL", "key_file": "DDPBUS_KEY_FILE",
    "world_size": "DDPBUS_WORLD_SIZE", "rank": "DDPBUS_RANK", "out": "DDPBUS_OUT",
    "device": "DDPBUS_DEVICE", "torch_threads": "DDPBUS_TORCH_THREADS",
    "spec": "DDPBUS_SPEC", "bundle_dir": "DDPBUS_BUNDLE_DIR", **flags.NATS_LOGIN_ENV,
}
# a worker that decided to exit gets this long (its trainer's join and the final flush take
# up to 30 s each) before it dumps its threads' stacks and exits 1 regardless
EXIT_GRACE = timedelta(seconds=90)

# shown under the subcommand's --help
EXAMPLES = (
    'ddpbus worker examples/digits.py:spec --rank 0 --job digits --world-size 2 \\',
    '    --key-file job.key --nats nats://nats:4222 --out /vol/out',
    'DDPBUS_RANK=1 DDPBUS_JOB=digits ... ddpbus worker   # every flag has its variable',
)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    worker: argparse.ArgumentParser = sub.add_parser(
        NAME, help="run one rank's worker agent",
        description="Run the worker agent of one rank: trains the plans the coordinator "
        "sends and averages through torch.distributed.")
    flags.member(worker)
    worker.add_argument("--rank", type=argtypes.nonneg, help="this worker's rank (env "
                        "DDPBUS_RANK)")
    worker.add_argument("--out", type=Path, help="directory for consensus and rank saves "
                        "(env DDPBUS_OUT)")
    worker.add_argument("--device", type=argtypes.device, help="auto (default: cuda:<rank "
                        "mod count> with CUDA, else cpu), cpu, cuda, cuda:N (env "
                        "DDPBUS_DEVICE)")
    worker.add_argument("--torch-threads", type=argtypes.positive, help="torch intra-op "
                        "threads")
    worker.add_argument("--slowdown", type=argtypes.slowdown, default=1.0, help="SIMULATION: "
                        "make every batch FACTOR times slower (to watch El Che balance on one "
                        "machine)")
    worker.add_argument("--final-state", type=Path, help="on Shutdown, write this rank's "
                        "final parameters to this safetensors file")
    worker.add_argument("--wire-json", action="store_true", help="publish proto3 JSON")
    worker.add_argument("--bundle-dir", type=Path, help="write resume bundles to this "
                        "directory (a volume every rank and the coordinator share) instead "
                        "of the job's Object Store (env DDPBUS_BUNDLE_DIR)")
    worker.add_argument("spec", nargs="?", help="training spec (env DDPBUS_SPEC)")
    return worker


def run(args: argparse.Namespace) -> int:
    from ddpbus.worker_agent.agent import WorkerAgent, WorkerSettings
    from ddpbus.worker_agent.spec import load_spec

    flags.require(args, [("--job", "job"), ("--nats", "nats"), ("--world-size", "world_size"),
                         ("--rank", "rank"), ("SPEC", "spec")], NAME)
    key = flags.read_key(args.key_file)
    spec = load_spec(args.spec)
    settings = WorkerSettings(job=args.job, rank=args.rank, world_size=args.world_size,
                              nats=flags.nats_access(args, sj.rank_consumer(args.rank)),
                              key=key, out_dir=args.out, final_state=args.final_state,
                              device=args.device or "auto", slowdown=args.slowdown,
                              torch_threads=args.torch_threads, wire_json=args.wire_json,
                              exit_grace=EXIT_GRACE, bundle_dir=args.bundle_dir)
    rc = asyncio.run(WorkerAgent(settings, spec).run())
    from ddpbus.worker_agent.trainer import GRAVEYARD

    if GRAVEYARD:
        # a released collective's group: freeing it at the interpreter's exit would wait
        # for its dead peer until the collective timeout (trainer.GRAVEYARD); all is said
        # and stored by now, so leave without finalization
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc
