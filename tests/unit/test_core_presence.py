"""Death from the broker's word, in the pure core: a rank whose connection closed and did
not come back within ``disconnect_grace`` is dead at once, long before its heartbeat
timeout; one that reconnects inside the grace is kept; nothing else the broker says about
other connections can kill anyone (runtime/presence.py hands the advisories over)."""

from __future__ import annotations

from typing import Any

import pytest
from cluster_sim import Sim
from test_core_recovery import DATASET, EPOCHS, every_batch_once

from ddpbus.codecs import messages as m
from ddpbus.orchestrator.core.config import schedule_from
from ddpbus.orchestrator.core.state import Disconnected, Reconnected, Record, Tick, Timing
from ddpbus.orchestrator.core.transition import transition

HEARTBEAT_S = 30.0  # the default: only the broker's word can be this quick
GRACE_S = 0.5
SLOW = (10.0, 15.0, 20.0)


def make(**knobs: Any) -> Sim:
    schedule = schedule_from({"policy": "cadence", "batch_size": 8, "epochs": EPOCHS,
                              "heartbeat_timeout": HEARTBEAT_S,
                              "disconnect_grace": GRACE_S, **knobs})
    return Sim(schedule, SLOW, dataset_size=DATASET)


def training(sim: Sim, until: float = 2.5) -> None:
    """Run the cohort until ``until`` (heartbeats named each rank's connection by then)."""
    with pytest.raises(AssertionError, match="no Finish"):
        sim.run(until=until)


def test_a_killed_rank_is_dead_once_the_grace_passes_and_every_batch_lands_once() -> None:
    sim = make()
    killed_at = 2.0

    def kill() -> None:
        sim.kill(1)
        sim.unplug(1)

    sim.at(killed_at, kill)
    finish = sim.run()
    assert finish.ok, finish.reason
    [gone] = sim.records("rank-disconnected")
    assert gone == {"rank": 1, "generation": 1, "host": "sim", "reason": "Client Closed",
                    "grace_s": GRACE_S}
    [dead] = sim.records("rank-dead")
    assert dead["rank"] == 1
    assert "broker connection closed (Client Closed)" in dead["why"]
    declared = [t for t, _, msg in sim.sent_of(m.DeclareDead)]
    # within the grace and a tick of the kill: not the 30 s heartbeat timeout
    assert killed_at + GRACE_S <= declared[0] <= killed_at + GRACE_S + sim.tick + 0.01
    every_batch_once(sim)


def test_a_rank_that_reconnects_within_the_grace_is_kept() -> None:
    sim = make()
    sim.at(2.0, lambda: sim.blip(1))
    finish = sim.run()
    assert finish.ok, finish.reason
    assert [d["rank"] for d in sim.records("rank-disconnected")] == [1]
    assert sim.records("rank-reconnected") == [{"rank": 1}]
    # its first heartbeat named its connection, the one after the blip the new one
    named = [c for c in sim.records("rank-connection") if c["rank"] == 1]
    assert len(named) == 2, named
    assert named[0]["connection"] != named[1]["connection"], named
    assert not sim.records("rank-dead")
    assert not sim.sent_of(m.DeclareDead)
    every_batch_once(sim)


def test_a_heartbeat_on_a_new_connection_also_ends_the_grace() -> None:
    """The connect advisory may be missed (the watcher's own connection was away): the
    rank's next heartbeat names its new connection, which says the same."""
    sim = make(disconnect_grace=2.0)
    r = sim.ranks[1]

    def unplug_and_reconnect() -> None:
        sim.unplug(1)
        r.connects += 1  # reconnected; its next heartbeat (within 1 s) names the new one

    sim.at(2.0, unplug_and_reconnect)
    finish = sim.run()
    assert finish.ok, finish.reason
    assert not sim.records("rank-dead")


@pytest.mark.parametrize("what", ["another-connection", "server-shutdown", "exited",
                                  "before-any-heartbeat"])
def test_what_the_broker_says_of_anything_else_kills_nobody(what: str) -> None:
    sim = make()
    training(sim, until=0.5 if what == "before-any-heartbeat" else 2.5)
    state, now = sim.state, sim.now
    conn = sim.ranks[1].connection
    events = {"another-connection": Disconnected(connection="SIMSERVER/999999",
                                                 reason="Client Closed"),
              "server-shutdown": Disconnected(connection=conn, reason="Server Shutdown"),
              "exited": Disconnected(connection=conn, reason="Client Closed"),
              "before-any-heartbeat": Disconnected(connection=conn, reason="Client Closed")}
    if what == "exited":
        state, _ = transition(state, Timing(m.Exiting(rank=1)), now)
    state, out = transition(state, events[what], now)
    state, ticked = transition(state, Tick(), now + 5 * GRACE_S)
    assert not [c for c in [*out, *ticked]
                if isinstance(c, Record) and c.event in ("rank-disconnected", "rank-dead")]
    assert not state.refusals


def test_a_reconnect_named_for_a_rank_never_kills_and_a_stale_one_changes_nothing() -> None:
    sim = make()
    training(sim)
    state, out = transition(sim.state, Reconnected(rank=1), sim.now)  # it never went
    assert out == []
    assert all(r.unplugged_at is None for r in state.ranks)
    state, out = transition(state, Reconnected(rank=7), sim.now)  # outside the world
    assert out == []


def test_a_new_incarnation_is_not_killed_by_the_old_ones_connection() -> None:
    """A restarted rank's Rejoin replaces the old incarnation; the old process's
    connection closing afterwards (its last TCP segments) concerns nobody."""
    sim = make()
    old = {}

    def restart() -> None:
        old["connection"] = sim.ranks[1].connection
        sim.restart(1)

    sim.at(2.0, restart)
    sim.at(2.2, lambda: sim.to_core(Disconnected(connection=old["connection"],
                                                 reason="Client Closed")))
    finish = sim.run()
    assert finish.ok, finish.reason
    assert [d["why"] for d in sim.records("rank-dead")] == ["restarted as generation 2"]
    assert not sim.records("rank-disconnected")


def test_the_grace_is_a_checked_knob() -> None:
    from ddpbus.codecs.errors import ConfigError
    for bad in (0.0, 0.01, 31.0):
        with pytest.raises(ConfigError, match="disconnect_grace"):
            schedule_from({"disconnect_grace": bad, "heartbeat_timeout": HEARTBEAT_S})
