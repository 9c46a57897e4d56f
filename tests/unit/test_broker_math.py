"""The broker backend's numbers: worker snapshot -> reducer -> worker apply, against the
mass-weighted mean computed directly (sum and divisor from exactly the same
contributions, divided once; idle ranks have mass 0 for any gamma)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ddpbus.codecs.errors import InvalidField, MalformedPayload
from ddpbus.codecs.tensor import pack_tensors, unpack_tensors
from ddpbus.orchestrator.core.state import Contribution
from ddpbus.orchestrator.runtime.broker_reducer import (
    Accumulator,
    ReduceError,
    bf16_to_f32,
    f32_to_bf16,
)
from ddpbus.worker_agent import averaging


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.BatchNorm1d(5),
                                torch.nn.Linear(5, 3))
    with torch.no_grad():
        bn = model[1]
        assert isinstance(bn, torch.nn.BatchNorm1d)
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    return model


def _round(flats: list[averaging.FlatModel], steps: list[int], *, gamma: float,
           bf16: bool = False) -> tuple[list[averaging.Snapshot], bytes, int]:
    snaps, acc, wire = [], Accumulator(), 0
    for rank, (flat, n) in enumerate(zip(flats, steps, strict=True)):
        snap, blob = averaging.snapshot(flat, version=3, steps=n, step=10 + n, gamma=gamma,
                                        bf16=bf16)
        snaps.append(snap)
        if blob is not None:
            wire += len(blob)
            acc.add(Contribution(rank=rank, mass=snap.mass, step=snap.step, digest="d",
                                 nbytes=len(blob)), blob)
    return snaps, acc.consensus(version=3, bf16=bf16), wire


def _expected(flats: list[averaging.FlatModel], steps: list[int], gamma: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    mass = [float(n) ** gamma if n > 0 else 0.0 for n in steps]
    params = sum(w * f.flats[0].double() for w, f in zip(mass, flats, strict=True))
    movers = [f for f, n in zip(flats, steps, strict=True) if n > 0]
    buffers = sum(torch.cat([b.double().reshape(-1) for b in f.buffers()]) for f in movers)
    return params / sum(mass), buffers / len(movers)  # type: ignore[operator, return-value]


@pytest.mark.parametrize("gamma", [1.0, 0.0, -1.0])
def test_consensus_is_the_mass_weighted_mean_with_idle_ranks(gamma: float) -> None:
    steps = [3, 0, 7, 1]  # rank 1 idle: mass 0 whatever gamma (0**0 and 0**-1 guarded)
    flats = [averaging.FlatModel(_model(seed)) for seed in range(4)]
    want_params, want_buffers = _expected(flats, steps, gamma)
    snaps, blob, _ = _round(flats, steps, gamma=gamma)
    assert snaps[1].mass == 0.0
    for flat, snap in zip(flats, snaps, strict=True):
        averaging.apply_consensus(flat, snap, blob, alpha=1.0, measure=True)
        torch.testing.assert_close(flat.flats[0].double(), want_params, rtol=1e-6, atol=1e-7)
        got = torch.cat([b.double().reshape(-1) for b in flat.buffers()])
        torch.testing.assert_close(got, want_buffers, rtol=1e-6, atol=1e-7)
    assert all(torch.equal(f.flats[0], flats[0].flats[0]) for f in flats)  # equal replicas


def test_divergence_triple_compares_the_snapshot_with_the_consensus() -> None:
    flats = [averaging.FlatModel(_model(seed)) for seed in range(2)]
    pre = flats[0].flats[0].clone()
    snaps, blob, _ = _round(flats, [2, 2], gamma=1.0)
    result, consensus = averaging.apply_consensus(flats[0], snaps[0], blob, alpha=1.0,
                                                  measure=True)
    c = consensus[0]
    assert result.pre_norm == pytest.approx(float(pre.norm()), rel=1e-6)
    assert result.post_norm == pytest.approx(float(c.norm()), rel=1e-6)
    assert result.divergence == pytest.approx(float((pre - c).norm() / c.norm()), rel=1e-6)


def test_easgd_blend_is_exact_and_keeps_steps_taken_during_the_round() -> None:
    flats = [averaging.FlatModel(_model(seed)) for seed in range(2)]
    snaps, blob, _ = _round(flats, [4, 2], gamma=1.0)
    w_snap = snaps[0].flats[0].clone()
    with torch.no_grad():
        flats[0].flats[0].add_(0.25)  # trained on while the round was in flight
    w_now = flats[0].flats[0].clone()
    _, consensus = averaging.apply_consensus(flats[0], snaps[0], blob, alpha=0.5,
                                             measure=False)
    c = consensus[0]
    assert torch.equal(flats[0].flats[0], w_now + 0.5 * (c - w_snap))
    # idle during the round: exactly the reference's (1 - alpha) * W + alpha * C
    _, consensus = averaging.apply_consensus(flats[1], snaps[1], blob, alpha=0.5,
                                             measure=False)
    torch.testing.assert_close(flats[1].flats[0], 0.5 * snaps[1].flats[0] + 0.5 * c,
                               rtol=0, atol=1e-7)


def test_bf16_wire_halves_the_bytes_and_stays_within_bf16_precision() -> None:
    flats32 = [averaging.FlatModel(_model(seed)) for seed in range(2)]
    flats16 = [averaging.FlatModel(_model(seed)) for seed in range(2)]
    _snaps, blob32, wire32 = _round(flats32, [2, 5], gamma=1.0)
    snaps16, blob16, wire16 = _round(flats16, [2, 5], gamma=1.0, bf16=True)
    params32 = unpack_tensors(blob32)["param.0"]
    params16 = unpack_tensors(blob16)["param.0"]
    assert params16.dtype == "bfloat16"
    assert params16.total_bytes * 2 == params32.total_bytes
    assert wire16 < 0.7 * wire32  # (buffers stay float32)
    exact = np.frombuffer(params32.data, dtype=np.float32)
    # two contributions and the consensus each rounded to bf16's 8 significant bits
    assert np.allclose(bf16_to_f32(params16.data), exact, rtol=2 ** -6, atol=2e-3)
    averaging.apply_consensus(flats16[0], snaps16[0], blob16, alpha=1.0, measure=False)
    assert flats16[0].flats[0].dtype == torch.float32


def test_bf16_rounding_matches_torch() -> None:
    x = np.concatenate([np.random.default_rng(0).standard_normal(10_000).astype(np.float32),
                        np.array([0.0, -0.0, 1e-40, 3.0e38, np.inf, -np.inf], np.float32)])
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(f32_to_bf16(x), want)
    assert np.isnan(bf16_to_f32(f32_to_bf16(np.array([np.nan], np.float32)).data)).all()


def test_zero_mass_is_declared_not_encoded() -> None:
    snap, blob = averaging.snapshot(averaging.FlatModel(_model(0)), version=1, steps=0,
                                    step=5, gamma=-1.0, bf16=False)
    assert blob is None
    assert snap.mass == 0.0


def test_mismatched_layouts_are_refused() -> None:
    acc = Accumulator()
    a = pack_tensors([("param.0", "float32", (2,), np.ones(2, np.float32).data)])
    b = pack_tensors([("param.0", "float32", (3,), np.ones(3, np.float32).data)])
    acc.add(Contribution(rank=0, mass=1.0, step=1, digest="", nbytes=0), a)
    with pytest.raises(ReduceError, match="another layout"):
        acc.add(Contribution(rank=1, mass=1.0, step=1, digest="", nbytes=0), b)
    with pytest.raises(ReduceError, match="no parameters"):
        Accumulator().add(Contribution(rank=0, mass=1.0, step=1, digest="", nbytes=0),
                          pack_tensors([("other", "float32", (1,), np.ones(1, np.float32).data)]))
    with pytest.raises(ReduceError, match="no mass"):
        Accumulator().consensus(version=1, bf16=False)


def test_bad_blobs_are_refused() -> None:
    good = pack_tensors([("param.0", "float32", (4,), np.ones(4, np.float32).data)])
    with pytest.raises(MalformedPayload):
        unpack_tensors(good[:-3])
    with pytest.raises(MalformedPayload):
        unpack_tensors(good + b"\x01")
    with pytest.raises(InvalidField, match="twice"):
        unpack_tensors(good + good)
