"""The averaging collective with real gloo processes: exact mass-weighted means.

Three ranks with different replicas average for several (steps, gamma) cases; the result
must equal ``sum(n_r^gamma * theta_r) / sum(n_r^gamma)`` over ranks that moved, float
buffers the plain mean over movers, integer buffers untouched, a zero-mass round nothing
changed, and the reported divergence and norms must match a direct computation.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
WORLD = 3
CASES = [
    {"steps": [3, 1, 2], "gamma": 1.0},
    {"steps": [3, 1, 2], "gamma": 0.0},
    {"steps": [3, 1, 2], "gamma": -1.0},
    {"steps": [0, 4, 1], "gamma": 1.0},  # an idle rank has mass 0 ...
    {"steps": [0, 4, 1], "gamma": -1.0},  # ... for any gamma (no 0^-1)
    {"steps": [0, 0, 0], "gamma": 1.0},  # the whole cohort idle: nothing changes
]


@pytest.fixture(scope="module")
def outcome(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("avg")
    procs = [subprocess.Popen([sys.executable, str(HERE / "averaging_worker.py"), str(r),
                               str(WORLD), str(out / "store"), str(out), json.dumps(CASES)],
                              stderr=subprocess.PIPE) for r in range(WORLD)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()[-2000:]
    return out


@pytest.mark.parametrize("case", range(len(CASES)))
def test_consensus_is_the_mass_weighted_mean(outcome: Path, case: int) -> None:
    steps, gamma = CASES[case]["steps"], CASES[case]["gamma"]
    files = [load_file(str(outcome / f"case{case}-rank{r}.safetensors")) for r in range(WORLD)]
    reports = [json.loads((outcome / f"rank{r}.json").read_text())[case] for r in range(WORLD)]
    mass = [n**gamma if n > 0 else 0.0 for n in steps]
    movers = [1.0 if n > 0 else 0.0 for n in steps]
    names = [k.removeprefix("before.") for k in files[0] if k.startswith("before.")]
    for name in names:
        before = [f[f"before.{name}"].double() for f in files]
        after = [f[f"after.{name}"] for f in files]
        if sum(mass) == 0 or not before[0].is_floating_point():
            for b, a in zip(before, after, strict=True):
                assert torch.equal(a.double(), b), f"{name} changed"
            continue
        for other in after[1:]:
            assert torch.equal(other, after[0]), f"ranks disagree on {name}"
        weights = movers if "running" in name else mass
        expected = sum(w * b for w, b in zip(weights, before, strict=True)) / sum(weights)
        assert torch.allclose(after[0].double(), expected, rtol=1e-6, atol=1e-7), name
    assert all(r["realized"] is (sum(mass) > 0) for r in reports)
    if sum(mass) > 0:
        params = [k for k in names if "running" not in k and "num_batches" not in k]
        post = torch.cat([files[0][f"after.{k}"].double().reshape(-1) for k in params])
        for r, report in zip(range(WORLD), reports, strict=True):
            pre = torch.cat([files[r][f"before.{k}"].double().reshape(-1) for k in params])
            assert math.isclose(report["divergence"],
                                float((pre - post).norm() / post.norm()), rel_tol=1e-4)
            assert math.isclose(report["pre_norm"], float(pre.norm()), rel_tol=1e-5)
            assert math.isclose(report["post_norm"], float(post.norm()), rel_tol=1e-5)
            assert report["movers"] == int(sum(movers))
