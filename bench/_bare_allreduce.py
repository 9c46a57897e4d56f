"""The collective baseline: a bare ``torch.distributed.all_reduce`` of one flat buffer.

Usage: python _bare_allreduce.py RANK WORLD STORE_FILE NUMEL ROUNDS PERIOD_S OUT_JSON.
Each rank sleeps until the same wall-clock instant (one host: one clock), every
``PERIOD_S`` seconds, then all-reduces a float32 buffer of ``NUMEL`` elements (gloo, on the
CPU), so the ranks come to each collective as ddpbus's do: idle a while, then both at
about the same moment, not hot in a tight loop. Each rank writes its milliseconds per
round to ``OUT_JSON.rank<N>``.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    rank, world, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    numel, rounds, period = int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
    out = Path(sys.argv[7])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    flat = torch.ones(numel)
    start = torch.tensor([time.time() + 0.5], dtype=torch.float64)
    dist.broadcast(start, src=0)  # rank 0's clock sets the schedule (the same clock here)
    took = []
    for i in range(rounds):
        wait = float(start) + i * period - time.time()
        if wait > 0:
            time.sleep(wait)  # idle until the round's instant, as a rank waits for SyncNow
        began = time.perf_counter()
        dist.all_reduce(flat)
        took.append((time.perf_counter() - began) * 1000.0)
        flat.fill_(1.0)
    dist.destroy_process_group()
    Path(f"{out}.rank{rank}").write_text(json.dumps(took))


if __name__ == "__main__":
    main()
