"""Coordinator snapshots: a round trip restores a working core; anything not signed with
the job key, or naming a class outside ddpbus, is refused before it is unpickled."""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import zlib

import pytest
from cluster_sim import Sim

from ddpbus.codecs import Outbound
from ddpbus.orchestrator import snapshot
from ddpbus.orchestrator.config import schedule_from
from ddpbus.orchestrator.core import transition
from ddpbus.orchestrator.state import Tick

KEY = b"snapshot-test-key-0123456789abcdef"


def _ran() -> Sim:
    sim = Sim(schedule_from({"policy": "cadence", "batch_size": 8, "epochs": 2}),
              (2.0, 3.0), dataset_size=640)
    sim.run()
    return sim


def _snap(sim: Sim) -> snapshot.Snapshot:
    out = Outbound(subject="ddpbus.j.control.all", headers={"Nats-Msg-Id": "coordinator.g1.7"},
                   payload=b"\x01\x02")
    return snapshot.Snapshot(state=sim.state, stream_seq=123, outbox=[out],
                             coordinator_generation=1, saved_at=1.5)


def test_round_trip_restores_the_same_core() -> None:
    sim = _ran()
    back = snapshot.decode(snapshot.encode(_snap(sim), KEY), KEY)
    assert back.stream_seq == 123
    assert back.outbox[0].headers["Nats-Msg-Id"] == "coordinator.g1.7"
    assert repr(back.state.ranks) == repr(sim.state.ranks)
    assert back.state.aggregated == sim.state.aggregated
    # the restored core still decides: same input, same output as the original
    _, ours = transition(back.state, Tick(), 99.0)
    _, theirs = transition(sim.state, Tick(), 99.0)
    assert repr(ours) == repr(theirs)


def test_a_flipped_byte_or_another_key_is_refused() -> None:
    data = bytearray(snapshot.encode(_snap(_ran()), KEY))
    data[-5] ^= 0xFF
    with pytest.raises(snapshot.SnapshotError, match="signature"):
        snapshot.decode(bytes(data), KEY)
    with pytest.raises(snapshot.SnapshotError, match="signature"):
        snapshot.decode(snapshot.encode(_snap(_ran()), KEY), b"another-key" * 3)
    with pytest.raises(snapshot.SnapshotError, match="not a ddpbus"):
        snapshot.decode(b"garbage", KEY)


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("echo pwned",))


def test_a_signed_pickle_naming_a_foreign_class_is_not_built() -> None:
    body = zlib.compress(pickle.dumps(_Evil()))
    data = snapshot.MAGIC + hmac.new(KEY, body, hashlib.sha256).digest() + body
    with pytest.raises(snapshot.SnapshotError, match="may not"):
        snapshot.decode(data, KEY)
