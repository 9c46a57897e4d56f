"""Profile one rank's training thread (cProfile), without NATS or a peer: the method behind
docs/performance.md's per-step figures.

The Trainer of ``bench/specs/compute.py``'s model and data is driven as its agent would
(tests/unit/worker_harness.py: an open window over one plan, broker backend, so no
collective), its ``run()`` under cProfile in its own thread, for ``--steps`` batches. Prints
the functions by own time, then ddpbus's share of the thread: what it spends outside torch
per batch (report, plan, prefetcher, timing), the part a hand-written loop does not have.

Run: ``python bench/profile_trainer.py [--batch 64] [--steps 700] [--prefetch 0]``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=700)
    ap.add_argument("--prefetch", type=int, default=0)
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    os.environ["BENCH_BATCH"] = str(args.batch)
    sys.path[:0] = [str(ROOT / "tests" / "unit"), str(ROOT / "bench" / "specs")]
    import compute
    import torch
    import worker_harness as wh

    torch.set_num_threads(1)
    wh.N = len(compute.DATASET)  # the harness's run config names the dataset's size
    spec = wh.spec(model=compute.model, train_step=compute.step, dataset=compute.DATASET,
                   batch_size=args.batch, prefetch=args.prefetch)
    rank = wh.Rank(spec)
    rank.trainer.configure(wh.run_config(batch_size=args.batch), world_size=2)
    profile = cProfile.Profile()

    def train() -> None:
        profile.enable()
        rank.trainer.run()
        profile.disable()

    thread = threading.Thread(target=train, name="profiled-trainer")
    rank.put(wh.window(wh.plan(0, 0, wh.N)))
    started = time.perf_counter()
    thread.start()
    rank.wait_steps(min(args.steps, wh.N // args.batch))  # one plan: the whole dataset
    wall = time.perf_counter() - started
    rank.trainer.halt("profiled", clean=True)
    thread.join()
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("tottime").print_stats(args.top)
    sys.stdout.write(out.getvalue())
    own = {key: tt for key, (_, _, tt, _, _) in stats.stats.items()  # type: ignore[attr-defined]
           if "ddpbus" in key[0]}
    # the batch gather (tensor indexing, counted in data.py's own time) a hand-written
    # loop does too; the rest is ddpbus's bookkeeping: reports, plans, timing, hand-offs
    gather = sum(tt for (path, _, _), tt in own.items() if path.endswith("data.py"))
    rest = sum(own.values()) - gather
    total = sum(tt for (_, _, tt, _, _) in stats.stats.values())  # type: ignore[attr-defined]
    steps = rank.trainer.step
    sys.stdout.write(f"{steps} batches of {args.batch} in {wall:.2f} s; per batch: the "
                     f"gather {gather * 1e6 / steps:.0f} us, ddpbus's bookkeeping "
                     f"{rest * 1e6 / steps:.0f} us ({rest / total:.1%} of the thread)\n")


if __name__ == "__main__":
    main()
