"""One rank of test_averaging: runs averaging.average for a list of cases, writes results.

Usage: python averaging_worker.py RANK WORLD STORE OUT_DIR CASES_JSON
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from ddpbus.worker_agent import averaging


def model(rank: int) -> torch.nn.Module:
    torch.manual_seed(100 + rank)  # a different replica on every rank
    net = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4),
                              torch.nn.Linear(4, 3))
    with torch.no_grad():
        net[1].running_mean.copy_(torch.randn(4))
        net[1].running_var.copy_(torch.rand(4) + 0.5)
    return net


def main() -> None:
    rank, world, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    cases = json.loads(sys.argv[5])
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    results = []
    for i, case in enumerate(cases):
        net = model(rank)
        flat = averaging.FlatModel(net)
        before = {k: v.clone() for k, v in net.state_dict().items()}
        res = averaging.average(flat, case["steps"][rank], gamma=case["gamma"], measure=True,
                                device=torch.device("cpu"))
        save_file({**{f"before.{k}": v for k, v in before.items()},
                   **{f"after.{k}": v.contiguous() for k, v in net.state_dict().items()}},
                  str(out / f"case{i}-rank{rank}.safetensors"))
        results.append({"realized": res.realized, "divergence": res.divergence,
                        "pre_norm": res.pre_norm, "post_norm": res.post_norm,
                        "movers": res.movers})
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # skip interpreter teardown: gloo's FileStore threads can abort it ("terminate called
    # without an active exception") after everything is already written
    sys.stdout.flush()
    os._exit(0)
