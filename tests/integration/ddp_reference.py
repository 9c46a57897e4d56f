"""The parity baseline: torch DistributedDataParallel (gloo) on exactly ddpbus's shards.

Usage: python ddp_reference.py RANK WORLD STORE_FILE OUT_FILE. Rank r trains, at step k of
epoch e, the batch ddpbus's sync policy gives it (equal consecutive slices of the epoch's
shared permutation), one optimizer step per batch, gradients averaged by DDP.
``DDP_DEVICE=cuda`` trains on GPU ``rank % count`` with ``DDP_BACKEND`` (gloo, or nccl
given a GPU per rank): tests/gpu's parity check.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent / "specs"))
import parity

from ddpbus.orchestrator.core.pools import equal_split
from ddpbus.worker_agent.data import epoch_permutation


def main() -> None:
    rank, world, store_file, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    cuda = os.environ.get("DDP_DEVICE") == "cuda"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else \
        torch.device("cpu")
    dist.init_process_group(os.environ.get("DDP_BACKEND", "gloo"),
                            store=dist.FileStore(store_file, world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    torch.manual_seed(parity.SEED)
    model = parity.spec.model().to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=parity.LR)
    x_all, y_all = (t.to(device) for t in parity.TRAIN.tensors)
    n, b = len(parity.TRAIN), parity.BATCH
    shares = equal_split(n // b, range(world))
    first = sum(shares[r] for r in range(rank))
    for epoch in range(parity.EPOCHS):
        perm = torch.from_numpy(epoch_permutation(n, parity.SEED, epoch).copy()).to(device)
        for k in range(shares[rank]):
            idx = perm[(first + k) * b:(first + k + 1) * b]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(ddp(x_all[idx]), y_all[idx])
            loss.backward()
            opt.step()
    if rank == 0:
        save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
                  out)
    dist.barrier()  # nobody tears gloo down while a peer still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # skip interpreter teardown: gloo's FileStore threads can abort it ("terminate called
    # without an active exception") after everything is already written
    sys.stdout.flush()
    os._exit(0)
