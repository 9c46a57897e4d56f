"""`ddpbus replay`'s narrator tells a copy stored twice once, and remembers a bounded
window of ids per sender incarnation however long the stream."""

from __future__ import annotations

import datetime as dt

from ddpbus.codecs import Decoder, Encoder, Envelope
from ddpbus.codecs import messages as m
from ddpbus.codecs import subjects as sj
from ddpbus.orchestrator.core.state import ID_HOLES
from ddpbus.orchestrator.tools.replay import Narrator

JOB, KEY = "told", b"k" * 32
ALL = sj.CONTROL_ALL.subject(JOB)
T0 = dt.datetime(2026, 12, 6, tzinfo=dt.UTC)


def envelopes(generation: int, msgs: list[tuple[m.Message, int]]) -> list[Envelope]:
    """Each message as the coordinator of ``generation`` stored it with sequence ``seq``."""
    enc = Encoder(job=JOB, key=KEY, sender=sj.COORDINATOR, generation=generation)
    dec = Decoder(job=JOB, key=KEY)
    return [dec.decode(out.subject, out.headers, out.payload)
            for out in (enc.encode(ALL, msg, seq=seq) for msg, seq in msgs)]


def told(narrator: Narrator, envs: list[Envelope]) -> list[str]:
    lines: list[str] = []
    for env in envs:
        narrator.stamp(T0)
        lines += narrator.tell(env)
    return lines


def test_a_copy_stored_twice_is_told_once_and_late_ones_are_told() -> None:
    sync = m.SyncNow()
    envs = envelopes(1, [(sync, 1), (sync, 2), (sync, 1), (sync, 4), (sync, 3), (sync, 3),
                         (m.Shutdown(), 5), (m.Shutdown(), 5)])
    envs += envelopes(2, [(sync, 1)])  # the next coordinator numbers from 1 again
    assert told(Narrator(), envs) == ["average #1 (after global step 0)",
                                      "average #2 (after global step 0)",
                                      "average #3 (after global step 0)",
                                      "average #4 (after global step 0)",  # 3, late
                                      "run complete after 4 averages",
                                      "average #5 (after global step 0)"]


def test_the_ids_remembered_stay_bounded() -> None:
    narrator = Narrator()
    # a long stream with a gap every fourth sequence (the copies the stream never got)
    told(narrator, envelopes(1, [(m.SetGlobalStep(global_step=s, plans=[], step_budget=[]), s)
                                 for s in range(1, 20_000) if s % 4]))
    [window] = narrator.seen_ids.values()
    assert window.high == 19_999
    assert len(window.holes) <= ID_HOLES
