"""Coordinator snapshots: a round trip restores a working core; anything not signed with
the job key, or naming a class outside ddpbus, is refused before it is unpickled."""

from __future__ import annotations

import hashlib
import hmac
import json
import zlib

import pytest
from cluster_sim import Sim

from ddpbus.codecs import Outbound
from ddpbus.orchestrator.core.config import schedule_from
from ddpbus.orchestrator.core.pools import Assignment
from ddpbus.orchestrator.core.state import Tick
from ddpbus.orchestrator.core.summary import summarize
from ddpbus.orchestrator.core.transition import transition
from ddpbus.orchestrator.persist import snapshot

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


def _signed(tree: object, magic: bytes = snapshot.MAGIC) -> bytes:
    body = zlib.compress(json.dumps(tree).encode())
    return magic + hmac.new(KEY, body, hashlib.sha256).digest() + body


@pytest.mark.parametrize("path", ["os:system", "builtins:eval", "subprocess:Popen",
                                  "ddpbus.orchestrator.persist.snapshot:_class",
                                  "ddpbus.orchestrator.snapshot:_class"])
def test_a_signed_snapshot_naming_a_foreign_class_builds_nothing(path: str) -> None:
    with pytest.raises(snapshot.SnapshotError, match=r"may not|not a ddpbus class"):
        snapshot.decode(_signed({"classes": [[path, []]], "root": {"$o": 0, "v": []}}), KEY)
    with pytest.raises(snapshot.SnapshotError, match=r"may not|not a ddpbus class"):
        snapshot.decode(_signed({"$o": path, "id": 0, "f": {}}, snapshot.OLDER[0]), KEY)


def test_shared_objects_stay_shared() -> None:
    sim = _ran()
    a = Assignment(epoch=1, offset=0, size=1)  # one object in two places, as in a live run
    sim.state.pools[1].assignments.append((0, a))
    sim.state.ranks[0].history.append(a)
    back = snapshot.decode(snapshot.encode(_snap(sim), KEY), KEY)
    assert back.state.ranks[0].history[-1] is back.state.pools[1].assignments[-1][1]


def _without(data: bytes, cls: str, field: str) -> bytes:
    """``data`` as an older ddpbus wrote it: class ``cls`` without ``field``."""
    doc = json.loads(zlib.decompress(data[len(snapshot.MAGIC) + 32:]))
    index = next(i for i, (path, _) in enumerate(doc["classes"]) if path.endswith(cls))
    at = doc["classes"][index][1].index(field)
    del doc["classes"][index][1][at]

    def strip(node: object) -> None:
        if isinstance(node, dict):
            if node.get("$o") == index:
                del node["v"][at]
            for v in node.values():
                strip(v)
        elif isinstance(node, list):
            for v in node:
                strip(v)

    strip(doc["root"])
    return _signed(doc)


def test_a_field_added_since_takes_its_default() -> None:
    sim = _ran()
    sim.state.pools[1].settled = 3
    data = snapshot.encode(_snap(sim), KEY)
    back = snapshot.decode(_without(data, ":Snapshot", "journal"), KEY)
    assert back.journal == ""
    back = snapshot.decode(_without(data, ":Pool", "settled"), KEY)
    assert back.state.pools[1].settled == 0  # a safe start: the checks rescan once
    with pytest.raises(snapshot.SnapshotError, match="lacks field epoch"):
        snapshot.decode(_without(data, ":Pool", "epoch"), KEY)  # no default: refused


def test_a_snapshot_written_before_the_layered_layout_still_loads() -> None:
    """Its classes are named by their old flat modules (``ddpbus.orchestrator.state:…``):
    a coordinator upgraded mid-job resumes from it, to the same state."""
    data = snapshot.encode(_snap(_ran()), KEY)
    doc = json.loads(zlib.decompress(data[len(snapshot.MAGIC) + 32:]))
    old = {new: was for was, new in snapshot.MOVED.items()}
    renamed = 0
    for row in doc["classes"]:
        module, _, name = row[0].partition(":")
        if module in old:
            row[0], renamed = f"{old[module]}:{name}", renamed + 1
    assert renamed >= 3  # the snapshot, the state and its parts
    back = snapshot.decode(_signed(doc), KEY)
    assert snapshot.document(back) == snapshot.document(snapshot.decode(data, KEY))


def test_the_format_is_not_pickle() -> None:
    data = snapshot.encode(_snap(_ran()), KEY)
    body = zlib.decompress(data[len(snapshot.MAGIC) + 32:])
    doc = json.loads(body)
    assert doc["classes"][doc["root"]["$o"]][0] == "ddpbus.orchestrator.persist.snapshot:Snapshot"


def test_a_long_run_keeps_its_state_the_size_of_the_cohort() -> None:
    """Epochs that are aggregated, served and in the consensus everywhere keep only their
    coverage ledger (no chunks, no per-chunk metrics) and the aggregate history only the
    latest epoch's per-rank columns: 8x the epochs, not 8x the snapshot."""
    sizes = {}
    for epochs in (5, 40):
        sim = Sim(schedule_from({"policy": "cadence", "batch_size": 8, "epochs": epochs}),
                  (2.0, 3.0), dataset_size=640)
        sim.run()
        sizes[epochs] = len(snapshot.encode(_snap(sim), KEY))
        assert all(p.closed is not None and not p.assignments
                   for p in sim.state.pools.values())
        summary = summarize(sim.state)
        assert summary["coverage"]["exact"], summary["coverage"]
        assert summary["coverage"]["batches"] == epochs * 80
        assert not any(e.per_rank_compute_only_ms for e in sim.state.aggregated[:-1])
        assert sum(summary["compute_ms"].values()) == pytest.approx(
            sum(r.batches * r.ms_per_batch for r in sim.ranks))
    assert sizes[40] < 2 * sizes[5], sizes
