"""Death from the broker's word, end to end: real coordinator and worker processes on a
real nats-server with a system account, the coordinator logged in to it
(``--nats-system-nkey``) so it reads the broker's client advisories.

One job, two faults on rank 1, each an outcome that must hold whenever it lands:

1. the broker drops rank 1's connection (``$SYS.REQ.SERVER.<id>.KICK``, what a network
   blip or a load balancer's reset looks like to the server); nats-py reconnects within
   ~0.1 s, inside the 0.5 s ``disconnect_grace``: rank 1 stays in the cohort, and its
   next heartbeat names its new connection;
2. rank 1 is SIGKILLed: the broker's disconnect advisory, not the heartbeat timeout (60 s
   here, longer than the whole run), declares it dead; the survivor finishes every epoch.

The broker restart, which closes every connection at once, is the chaos suite's
``test_the_broker_restarted_on_its_store_loses_nothing`` (its coordinator reads the
advisories too): no rank may die of it.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path
from typing import Any

from jobs import epochs_trained, spec, start_job, wait_for

from ddpbus.codecs import subjects as sj
from ddpbus.orchestrator.runtime.nats_server import EmbeddedBroker
from ddpbus.orchestrator.transport import auth
from ddpbus.orchestrator.transport.bus import connect

JOB = "presence"


def kick(broker: EmbeddedBroker, name: str) -> dict[str, Any]:
    """Have the server drop the client connection called ``name`` (a system request)."""
    seed = broker.config.system_seed
    assert seed is not None

    async def go() -> dict[str, Any]:
        nc = await connect(broker.url, name="test-kicker",
                           auth=auth.NatsAuth(nkey=seed))
        try:
            ping = json.loads((await nc.request("$SYS.REQ.SERVER.PING", b"", 5)).data)
            server = ping["server"]["id"]
            connz = json.loads((await nc.request(f"$SYS.REQ.SERVER.{server}.CONNZ",
                                                 b"{}", 5)).data)["data"]
            [cid] = [c["cid"] for c in connz["connections"] if c.get("name") == name]
            reply = await nc.request(f"$SYS.REQ.SERVER.{server}.KICK",
                                     json.dumps({"cid": cid}).encode(), 5)
            return {"cid": cid, "reply": json.loads(reply.data)}
        finally:
            await nc.close()

    return asyncio.run(go())


def test_a_dropped_connection_that_comes_back_is_kept_and_a_killed_rank_dies_at_once(
        broker: EmbeddedBroker, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    job = start_job(broker.url, tmp_path, spec("chaos"), workers=2, job=JOB,
                    coordinator_args=["--policy", "cadence", "--knob", "heartbeat_timeout=60",
                                      "--nats-system-nkey", str(broker.config.system_seed)],
                    worker_args={0: ["--slowdown", "3"], 1: ["--slowdown", "3"]},
                    env={"LEDGER_DIR": str(ledger), "CHAOS_EPOCHS": "3"})
    try:
        def seen(event: str) -> list[dict[str, Any]]:
            """The records so far (a line still being written is left for later)."""
            path = tmp_path / "events.jsonl"
            text = path.read_text() if path.exists() else ""
            whole = text[:text.rfind("\n") + 1]
            return [e for e in map(json.loads, whole.splitlines()) if e["event"] == event]

        wait_for("rank 1 to train an epoch", lambda: epochs_trained(ledger, 1) >= 1)
        wait_for("the coordinator to read the broker's advisories",
                 lambda: "reading the broker's client advisories" in job.log("coordinator"))

        def named() -> list[str]:
            """The connections rank 1's heartbeats named, as the coordinator read them."""
            return [e["connection"] for e in seen("rank-connection") if e["rank"] == 1]

        # (its first heartbeat after its admission names it: up to a heartbeat interval on)
        wait_for("rank 1's heartbeat naming its connection", named)
        [first] = named()
        kicked = kick(broker, sj.rank_connection_name(JOB, 1))
        assert "error" not in kicked["reply"], kicked
        wait_for("rank 1's reconnect", lambda: seen("rank-reconnected"))
        # a disconnect counts only for the connection a signed heartbeat named: until the
        # coordinator has read the one naming the new connection, a kill would be left to
        # the heartbeat timeout (the race CI once lost), so the kill waits for it
        wait_for("rank 1's heartbeat naming its new connection", lambda: len(named()) == 2)
        assert named()[1] != first
        victim = job.procs.pop("rank-1")  # its exit status is the kill's
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        summary = job.wait(240)  # the coordinator and rank 0 exit 0
        events = job.events()
    finally:
        job.kill()
    gone = [e for e in events if e["event"] == "rank-disconnected"]
    # a killed process's socket closes with a FIN or, with data unread, an RST: the broker
    # says "Client Closed" or "Read Error" (both seen), whichever the kernel sent
    assert [(e["rank"], e["reason"]) for e in gone][:1] == [(1, "Kicked")]
    assert [e["rank"] for e in gone] == [1, 1]
    assert gone[1]["reason"] in ("Client Closed", "Read Error"), gone
    assert [e["rank"] for e in events if e["event"] == "rank-reconnected"] == [1]
    assert [e["rank"] for e in events if e["event"] == "rank-connection"].count(1) == 2
    [dead] = [e for e in events if e["event"] == "rank-dead"]
    assert (dead["rank"], dead["cause"], dead["generation"]) == (1, "disconnected", 1)
    assert dead["host"]
    assert f"broker connection closed ({gone[1]['reason']})" in dead["why"]
    assert summary["ok"], summary
    assert summary["coverage"]["exact"], summary["coverage"]


async def test_a_login_outside_the_system_account_is_refused(broker: EmbeddedBroker) -> None:
    """Its ``$SYS`` subscriptions would be accepted and stay silent: refused at start."""
    import pytest

    from ddpbus.codecs.errors import ConfigError
    from ddpbus.orchestrator.runtime.presence import Presence
    nc = await connect(broker.url, name="not-system")  # the global account, anonymous
    try:
        with pytest.raises(ConfigError, match="not in the broker's system account"):
            await Presence.check_system(nc)
    finally:
        await nc.close()


class _Msg:
    def __init__(self, subject: str, data: bytes) -> None:
        self.subject, self.data = subject, data


def _advisory(kind: str, *, name: str, cid: int, reason: str = "") -> _Msg:
    doc = {"type": f"io.nats.server.advisory.v1.client_{kind.lower()}",
           "server": {"id": "NSERVER1", "name": "n1"},
           "client": {"id": cid, "name": name, "acc": "$G"}, "reason": reason}
    return _Msg(f"$SYS.ACCOUNT.$G.{kind}", json.dumps(doc).encode())


async def test_only_this_jobs_watched_connections_and_unplugged_ranks_become_events() -> None:
    from ddpbus.orchestrator.core.state import Disconnected, Reconnected
    from ddpbus.orchestrator.runtime.presence import Presence
    applied: list[object] = []

    async def apply(event: object) -> bool:
        applied.append(event)
        return True

    p = Presence(JOB, apply, watched=lambda: {"NSERVER1/7"}, unplugged=lambda: {1})
    rank1 = sj.rank_connection_name(JOB, 1)
    for msg in (
        _advisory("DISCONNECT", name=rank1, cid=7, reason="Client Closed"),  # applied
        _advisory("DISCONNECT", name=rank1, cid=8, reason="Client Closed"),  # not watched
        _advisory("DISCONNECT", name="ddpbus-other-rank-1", cid=7),  # another job's name
        _advisory("DISCONNECT", name="ddpbus-store-rank-1", cid=7),  # a store connection
        _advisory("CONNECT", name=rank1, cid=9),  # applied: rank 1 is unplugged
        _advisory("CONNECT", name=sj.rank_connection_name(JOB, 0), cid=10),  # 0 is not
        _Msg("$SYS.ACCOUNT.$G.CONNS", b"{}"),  # another account event
        _Msg("$SYS.ACCOUNT.$G.LEAFNODE.CONNECT", b"{}"),  # not a client's
        _Msg("$SYS.ACCOUNT.$G.DISCONNECT", b"not json"),  # counted, ignored
        _Msg("$SYS.ACCOUNT.$G.DISCONNECT", b'{"client": {"id": "x"}, "server": {}}'),
        _Msg("$SYS.ACCOUNT.$G.DISCONNECT", b"x" * 70_000),  # oversize
    ):
        await p._on_advisory(msg)  # type: ignore[arg-type]
    assert applied == [Disconnected(connection="NSERVER1/7", reason="Client Closed"),
                       Reconnected(rank=1)]
    assert p.malformed == 3
