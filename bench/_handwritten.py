"""The overhead baseline: a hand-written torch.distributed loop, no ddpbus, no NATS.

Usage: python _handwritten.py RANK WORLD STORE_FILE SCHEDULE_JSON OUT_JSON. Replays the
averaging schedule ddpbus recorded (per average, how many steps each rank ran) on the same
model, data and batch size: train those steps, then a mass-weighted parameter average
(count all-reduce, then the weighted parameter all-reduce over one flat buffer) exactly when
ddpbus averaged. Rank 0 writes the wall time from the first step to the last average.
``BENCH_DEVICE=cuda`` trains on GPU ``rank % count`` (data and parameters there; the
training loop waits for the GPU only where a careful user's would: reading the loss), with
``BENCH_BACKEND`` (gloo, or nccl given a GPU per rank).
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent / "specs"))
import compute


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    store, schedule, out = sys.argv[3], json.loads(Path(sys.argv[4]).read_text()), sys.argv[5]
    torch.set_num_threads(1)
    cuda = os.environ.get("BENCH_DEVICE") == "cuda"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else \
        torch.device("cpu")
    backend = os.environ.get("BENCH_BACKEND", "gloo")
    dist.init_process_group(backend, store=dist.FileStore(store, world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=120),
                            **({"device_id": device} if backend == "nccl" else {}))
    torch.manual_seed(0)
    model = compute.model().to(device)
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for p in params:  # parameters become views into one flat buffer, like a careful user
        n = p.numel()
        p.data = flat[offset:offset + n].view_as(p)
        offset += n
    opt = torch.optim.SGD(params, lr=compute.LR)
    x_all, y_all = (t.to(device) for t in compute.DATASET.tensors)
    perm = torch.randperm(len(x_all), generator=torch.Generator().manual_seed(rank)).to(device)
    batch, cursor = compute.BATCH, 0
    dist.barrier()
    start, cpu0 = time.perf_counter(), time.process_time()
    for steps in schedule:
        n = steps[rank]
        for _ in range(n):
            idx = perm[cursor:cursor + batch]
            cursor = (cursor + batch) % (len(perm) - batch)
            opt.zero_grad(set_to_none=True)
            loss = compute.step(model, (x_all[idx], y_all[idx]))
            loss.backward()
            opt.step()
            float(loss.detach())
        counts = torch.tensor([float(n), 1.0 if n else 0.0], dtype=torch.float64,
                              device=device)
        dist.all_reduce(counts)
        with torch.no_grad():
            flat.mul_(n / float(counts[0]))
            dist.all_reduce(flat)
    if cuda:
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - start
    Path(f"{out}.cpu{rank}").write_text(str(time.process_time() - cpu0))  # the timed part's
    if rank == 0:
        Path(out).write_text(json.dumps({"wall_s": wall}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # skip interpreter teardown: gloo's FileStore threads can abort it ("terminate called
    # without an active exception") after everything is already written
    sys.stdout.flush()
    os._exit(0)
