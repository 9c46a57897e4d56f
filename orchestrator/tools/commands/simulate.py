"""``ddpbus simulate``: many simulated ranks that speak the real protocol, to load a
coordinator."""

from __future__ import annotations

import argparse
import asyncio
import gc
from typing import Any

from ddpbus.orchestrator.tools import argtypes, flags
from ddpbus.orchestrator.transport.auth import OBSERVER

NAME = "simulate"
ENV = {**flags.READER_ENV, "ranks": "DDPBUS_WORLD_SIZE"}

# shown under the subcommand's --help
EXAMPLES = (
    'ddpbus simulate --ranks 256 --rate 20 --job sim --key-file job.key',
    'ddpbus simulate --ranks 64 --speeds lognormal:0.5 --kill 4@30 --job sim --key-file job.key',
)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    sim: argparse.ArgumentParser = sub.add_parser(
        NAME, help="many simulated ranks, to load a coordinator",
        description="Play --ranks ranks of a job in one process: the real protocol (hellos, "
        "heartbeats, Batch reports at --rate per second times each rank's speed, MetricsMsg "
        "per plan, SyncAck on SyncNow, callback results, Exiting on Shutdown), signed with "
        "the job key, without training. Start a coordinator with --world-size equal to "
        "--ranks (and a collective backend). Needs an open broker, or a login allowed every "
        "rank's subjects.")
    flags.reader(sim)
    sim.add_argument("--ranks", type=argtypes.positive, help="how many ranks (env "
                     "DDPBUS_WORLD_SIZE)")
    sim.add_argument("--rate", type=argtypes.positive_float, default=10.0, help="batches per "
                     "second of a rank of speed 1 (default 10)")
    sim.add_argument("--speeds", default="equal", help="speed distribution: equal, "
                     "uniform:LO,HI, lognormal:SIGMA or slow:FRACTION,FACTOR (default equal)")
    sim.add_argument("--dataset-size", type=argtypes.positive, help="samples the ranks say "
                     "they hold (default 1280 per rank)")
    sim.add_argument("--seed", type=int, default=0, help="seed of the speed draw")
    sim.add_argument("--intake", choices=("durable", "core"), default="durable",
                     help="how the ranks read their control subjects: durable (each from "
                     "its own consumer, acked, as a worker does; default) or core (one "
                     "core-NATS subscription for all: the lightest, for the largest loads)")
    sim.add_argument("--kill", type=argtypes.kill_spec, metavar="COUNT@SECONDS",
                     help="the COUNT highest ranks die together SECONDS after the first "
                     "batch (no Exiting, no more beats: a rack losing power), for the "
                     "coordinator to declare in one membership change")
    return sim


def run(args: argparse.Namespace) -> int:
    from ddpbus.orchestrator.core import gc_policy
    from ddpbus.orchestrator.tools.simulate import SimulatedCohort, speeds

    key = flags.reader_key(args, NAME)
    flags.require(args, [("--ranks", "ranks")], NAME)
    factors = speeds(args.speeds, args.ranks, args.seed)

    async def main() -> None:
        nc = await flags.nats_access(args, OBSERVER).connect(
            args.job, name=f"ddpbus-simulate-{args.job}")
        try:
            cohort = SimulatedCohort(nc, args.job, key, args.ranks, rate=args.rate,
                                     speed=factors, dataset_size=args.dataset_size or 0,
                                     intake=args.intake, kill=args.kill,
                                     collector=gc_policy.Collector())
            # the cohort lives as long as the process: full passes stop scanning it, and
            # run only where the cohort makes them (SimulatedCohort's collector)
            gc.collect()
            gc.freeze()
            gc_policy.take_full_passes()
            await cohort.run()
        finally:
            await nc.close()

    asyncio.run(main())
    return 0
