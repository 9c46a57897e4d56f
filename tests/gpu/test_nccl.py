"""Two CUDA ranks (skipped without CUDA): the digits coverage run, one rank per GPU with
--backend nccl where there are two GPUs or more, else both ranks on the one GPU with gloo
(NCCL refuses two ranks on one device). Checks the run finishes, every sample of every
epoch is trained exactly once and the replicas agree.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from jobs import spec, start_job
from safetensors.torch import load_file

from ddpbus.orchestrator.runtime.nats_server import EmbeddedBroker
from ddpbus.worker_agent.data import epoch_permutation

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_two_cuda_ranks_cadence_run(broker: EmbeddedBroker, tmp_path: Path) -> None:
    workers = 2
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    job = start_job(broker.url, tmp_path, spec("ledger"), job="nccl", workers=workers,
                    coordinator_args=["--backend", backend], env={"LEDGER_DIR": str(ledger)})
    summary = job.wait()
    assert summary["ok"]
    assert summary["backend"] == backend
    assert summary["test_accuracy"] >= 0.95
    trained: Counter[tuple[int, int]] = Counter()
    for f in ledger.glob("rank-*.txt"):
        trained.update(tuple(map(int, line.split())) for line in f.read_text().splitlines())
    assert set(trained.values()) == {1}
    for epoch in range(20):
        expected = set(epoch_permutation(1438, 42, epoch)[:1408].tolist())
        assert {i for e, i in trained if e == epoch} == expected
    states = [load_file(str(job.out / f"rank{r}.final.safetensors")) for r in range(workers)]
    for other in states[1:]:
        assert all(torch.equal(states[0][k], other[k]) for k in states[0])
