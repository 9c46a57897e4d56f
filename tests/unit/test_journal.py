"""The write-ahead journal: a snapshot plus the events applied after it, replayed at their
recorded times, is exactly the state the live core reached (so a coordinator can store a
segment the size of the traffic before each batch of commands, and a full snapshot only
now and then)."""

from __future__ import annotations

import json

import pytest
from cluster_sim import Sim

from ddpbus.codecs import Decoder, Encoder
from ddpbus.codecs import messages as m
from ddpbus.codecs import subjects as sj
from ddpbus.orchestrator.core.config import schedule_from
from ddpbus.orchestrator.core.state import Event, Joined, Metrics, State
from ddpbus.orchestrator.core.transition import initial_state, transition
from ddpbus.orchestrator.persist import journal, snapshot

KEY = b"journal-test-key-0123456789abcdef"
JOB = "jj"
DECODER = Decoder(job=JOB, key=KEY)


def _as_received(event: Event) -> Event | journal.Wire:
    """A message event as the shell journals it: the signed bytes off the bus."""
    msg = getattr(event, "msg", None)
    if msg is None:
        return event  # a tick, a stop, a reducer's result: kept as the event itself
    family = (sj.LIVE_RANK if isinstance(msg, m.Heartbeat) else sj.METRICS_RANK
              if isinstance(event, Metrics) else sj.JOIN_RANK if isinstance(event, Joined)
              else sj.TIMING_RANK)
    enc = Encoder(job=JOB, key=KEY, sender=sj.rank_consumer(msg.rank), generation=1)
    out = enc.encode(family.subject(JOB, msg.rank), msg)
    return journal.Wire(out.subject, out.headers, out.payload, stream=False)


def _tree(state: State) -> str:
    return json.dumps(snapshot._Encoder().document(state), sort_keys=True)


def _sealed(events: list, seq: int) -> journal.Segment:
    seg = journal.Segment(events=events, stream_seq=seq, outbox=[], coordinator_generation=1,
                          saved_at=0.0)
    return journal.decode(journal.encode(seg, KEY), KEY)  # through the stored format


@pytest.mark.parametrize("policy", ["sync", "cadence", "async"])
@pytest.mark.parametrize("cut", [0.2, 0.5, 0.8])
def test_snapshot_plus_segments_is_the_live_state(policy: str, cut: float) -> None:
    sim = Sim(schedule_from({"policy": policy, "batch_size": 8, "epochs": 3}),
              (2.0, 3.0, 5.0), dataset_size=960, has_eval=True)
    sim.run()
    events = sim.delivered
    assert len(events) > 200
    # the live core again, stopped at the cut: its full snapshot, stored and loaded
    at = int(len(events) * cut)
    state = initial_state(sim.config, 0.0)
    for now, event in events[:at]:
        state, _ = transition(state, event, now)
    snap = snapshot.decode(snapshot.encode(snapshot.Snapshot(
        state=state, stream_seq=at, outbox=[], coordinator_generation=1, saved_at=0.0,
        journal="1.0"), KEY), KEY)
    # the rest as segments of uneven sizes (a group commit takes what arrived)
    rest = [(_as_received(event), now) for now, event in events[at:]]
    assert any(isinstance(e, journal.Wire) for e, _ in rest)
    segments, i, size = [], 0, 1
    while i < len(rest):
        segments.append(_sealed(rest[i:i + size], at + i + size))
        i, size = i + size, size * 3 % 17 + 1
    resumed = journal.extend(snap, segments, DECODER)
    assert resumed.stream_seq == segments[-1].stream_seq
    assert _tree(resumed.state) == _tree(sim.state)


def test_no_segments_leave_the_snapshot_as_it_is() -> None:
    sim = Sim(schedule_from({"policy": "cadence", "batch_size": 8, "epochs": 1}), (2.0, 3.0),
              dataset_size=320)
    sim.run()
    snap = snapshot.Snapshot(state=sim.state, stream_seq=9, outbox=[],
                             coordinator_generation=1, saved_at=0.0)
    assert journal.extend(snap, [], DECODER) is snap


def _small_snapshot() -> snapshot.Snapshot:
    sim = Sim(schedule_from({"policy": "sync", "batch_size": 8, "epochs": 1}), (2.0,),
              dataset_size=64)
    sim.run()
    return snapshot.Snapshot(state=sim.state, stream_seq=1, outbox=[],
                             coordinator_generation=1, saved_at=0.0)


def test_a_segment_signed_with_another_key_or_holding_a_snapshot_is_refused() -> None:
    seg = journal.Segment(events=[], stream_seq=1, outbox=[], coordinator_generation=1,
                          saved_at=0.0)
    with pytest.raises(snapshot.SnapshotError, match="signature"):
        journal.decode(journal.encode(seg, KEY), b"another-key-0123456789abcdef0000")
    snap = _small_snapshot()
    with pytest.raises(snapshot.SnapshotError, match="not a DDPBUS-JOURNAL-1 record"):
        journal.decode(snapshot.encode(snap, KEY), KEY)


GOOD = {"stream_seq": 1, "generation": 1, "saved_at": 0.0, "events": [], "outbox": []}


@pytest.mark.parametrize(("doc", "match"), [
    ([], "expected document"),
    (GOOD | {"extra": 1}, "expected document"),
    (GOOD | {"stream_seq": "1"}, "wrong types"),
    (GOOD | {"events": [[0.0]]}, "malformed journal event"),
    (GOOD | {"events": [[0.0, "s", {}, "AA==", "yes"]]}, "malformed journal message"),
    (GOOD | {"events": [[0.0, "s", {"a": 1}, "AA==", True]]}, "string map"),
    (GOOD | {"events": [[0.0, "s", {}, "not base64!", True]]}, "not base64"),
    (GOOD | {"events": [[0.0, {"classes": [["os:system", []]], "root": {"$o": 0, "v": []}}]]},
     "may not"),
    (GOOD | {"outbox": [["s", {}]]}, "malformed journal command"),
])
def test_a_signed_but_malformed_segment_is_refused(doc: object, match: str) -> None:
    """Signed with the job key yet not a segment (a bug, or a key in the wrong hands):
    refused with a reason, never half-applied."""
    with pytest.raises(snapshot.SnapshotError, match=match):
        journal.decode(snapshot.sign(journal.MAGIC, doc, KEY), KEY)


def test_a_segment_round_trips() -> None:
    from ddpbus.codecs import Outbound
    from ddpbus.orchestrator.core.state import Reduced, Tick
    wire = journal.Wire("ddpbus.jj.timing.rank.0", {"Ddpbus-Type": "TimingMsg.Batch"},
                        b"\x00\x01", stream=True)
    out = Outbound(subject="ddpbus.jj.control.all", headers={"Nats-Msg-Id": "c.1"},
                   payload=b"\xff")
    seg = journal.Segment(events=[(wire, 1.5), (Tick(), 2.0), (Reduced(3, True), 2.5)],
                          stream_seq=9, outbox=[out], coordinator_generation=4, saved_at=3.0)
    assert journal.decode(journal.encode(seg, KEY), KEY) == seg


def test_a_journaled_message_that_does_not_verify_is_refused() -> None:
    enc = Encoder(job=JOB, key=b"another-key-0123456789abcdef0000", sender="rank-0",
                  generation=1)
    out = enc.encode(sj.LIVE_RANK.subject(JOB, 0), m.Heartbeat(rank=0, step_count=1))
    seg = _sealed([(journal.Wire(out.subject, out.headers, out.payload, stream=False), 1.0)],
                  1)
    snap = _small_snapshot()
    with pytest.raises(snapshot.SnapshotError, match="does not decode"):
        journal.extend(snap, [seg], DECODER)
