"""The reducer against a real nats-server: contributions in the job's round bucket in,
the consensus out; an altered or missing contribution fails the round and stores nothing."""

from __future__ import annotations

import numpy as np
import pytest

from ddpbus.codecs import subjects as sj
from ddpbus.codecs.tensor import pack_tensors, unpack_tensors
from ddpbus.orchestrator.core.state import Contribution, Reduce
from ddpbus.orchestrator.runtime import broker_reducer
from ddpbus.orchestrator.runtime.nats_server import EmbeddedBroker
from ddpbus.orchestrator.transport import bus
from ddpbus.orchestrator.transport.bus import connect


def _blob(values: np.ndarray, mass: float) -> bytes:
    scaled = (values * mass).astype(np.float32)
    return pack_tensors([("param.0", "float32", scaled.shape, scaled.data),
                         ("buffers", "float32", (2,), np.array([1.0, 3.0], np.float32).data)])


@pytest.mark.parametrize("fault", ["none", "altered", "missing", "oversized"])
async def test_reduce_round_trip_and_refusals(broker: EmbeddedBroker, fault: str) -> None:
    nc = await connect(broker.url, name="reducer-test")
    js = nc.jetstream()
    store = await bus.rounds_store(js, "red")
    chunk = bus.object_chunk(nc.max_payload)
    rng = np.random.default_rng(3)
    params = [rng.standard_normal(300_000).astype(np.float32) for _ in range(3)]
    masses = [2.0, 5.0, 1.0]
    contributions = []
    for rank, (p, mass) in enumerate(zip(params, masses, strict=True)):
        blob = _blob(p, mass)
        digest = await bus.put_object(store, sj.round_contribution(1, rank), blob,
                                          chunk)
        contributions.append(Contribution(rank=rank, mass=mass, step=1, digest=digest,
                                          nbytes=len(blob)))
    if fault == "altered":  # someone replaced rank 1's object after it announced it
        await bus.put_object(store, sj.round_contribution(1, 1),
                                 _blob(params[1], 9.0), chunk)
    elif fault == "missing":
        await store.delete(sj.round_contribution(1, 2))
    elif fault == "oversized":  # replaced by far more than it announced: never read
        await bus.put_object(store, sj.round_contribution(1, 2),
                             _blob(np.zeros(3_000_000, np.float32), 1.0), chunk)
    result = await broker_reducer.Reducer(js, "red", nc.max_payload).run(
        Reduce(version=1, contributions=tuple(contributions)))
    names = {i.name for i in await store.list(ignore_deletes=True)}
    if fault == "none":
        assert result.ok, result.detail
        blob, stored = await bus.read_object(store, sj.round_consensus(1))
        assert result.digest == stored  # what the Update names, for every rank to check
        out = unpack_tensors(blob)
        want = sum(m * p.astype(np.float64) for m, p in zip(masses, params, strict=True))
        got = np.frombuffer(out["param.0"].data, dtype=np.float32)
        np.testing.assert_allclose(got, want / sum(masses), rtol=1e-6, atol=1e-6)
        assert np.frombuffer(out["buffers"].data, np.float32).tolist() == [1.0, 3.0]
        assert names == {"v1.consensus"}  # the contributions are gone once reduced
    else:
        assert not result.ok
        assert {"altered": "not the one it announced", "missing": "not in the store",
                "oversized": "bytes, not the"}[fault] in result.detail
        assert "v1.consensus" not in names
    await nc.close()


async def test_a_rank_applies_only_the_consensus_its_update_names(
        broker: EmbeddedBroker) -> None:
    """A consensus replaced in the round bucket (any identity that writes the bucket could)
    is refused by the rank that fetches it, counted as consensus-digest."""
    from ddpbus.codecs import messages as m
    from ddpbus.worker_agent.agent import fetch_consensus

    nc = await connect(broker.url, name="consensus-test")
    store = await bus.rounds_store(nc.jetstream(), "fenced")
    chunk = bus.object_chunk(nc.max_payload)
    real = _blob(np.ones(1000, np.float32), 1.0)
    digest = await bus.put_object(store, sj.round_consensus(4), real, chunk)
    update = m.Update(version=4, realized=True, accepted=(0, 1), digest=digest)
    got = await fetch_consensus(store, update)
    assert (got.blob, got.refused, got.error) == (real, "", "")
    await bus.put_object(store, sj.round_consensus(4), _blob(np.ones(1000, np.float32), 7.0),
                         chunk)
    got = await fetch_consensus(store, update)
    assert got.blob is None
    assert got.refused == "consensus-digest"
    assert "not the one the Update names" in got.error
    await nc.close()
