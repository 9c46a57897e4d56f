"""torch.distributed rendezvous through NATS KV: Store semantics and a real gloo group."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from ddpbus.orchestrator.runtime.nats_server import EmbeddedBroker
from ddpbus.orchestrator.runtime.provision import ensure_job
from ddpbus.orchestrator.transport.bus import connect
from ddpbus.worker_agent.rendezvous import NatsKVStore, StoreTimeout

JOB = "rdv"

WORKER = """
import sys, datetime, torch, torch.distributed as dist
from ddpbus.worker_agent.rendezvous import NatsKVStore
url, rank, world, session = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
store = NatsKVStore(url, "rdv", timeout=datetime.timedelta(seconds=60))
dist.init_process_group("gloo", store=dist.PrefixStore(session, store), rank=rank,
                        world_size=world, timeout=datetime.timedelta(seconds=60))
t = torch.full((4,), float(rank + 1))
dist.all_reduce(t)
sys.stdout.write(f"{rank} {t.tolist()}\\n")
dist.destroy_process_group()
store.close()
"""


@pytest.fixture
def store(broker: EmbeddedBroker) -> Iterator[NatsKVStore]:
    async def provision() -> None:
        nc = await connect(broker.url, name="t")
        await ensure_job(nc.jetstream(), JOB, 1)
        await nc.close()
    asyncio.run(provision())
    s = NatsKVStore(broker.url, JOB, timeout=timedelta(seconds=5))
    yield s
    s.close()


def test_set_get_check_delete_and_count(store: NatsKVStore) -> None:
    assert store.num_keys() == 0
    assert not store.check(["a/b"])
    store.set("a/b", b"\x00\xffbytes")
    store.set("weird key: ü/../", "text")
    assert store.get("a/b") == b"\x00\xffbytes"
    assert store.get("weird key: ü/../") == b"text"
    assert store.check(["a/b", "weird key: ü/../"])
    assert store.num_keys() == 2
    assert store.delete_key("a/b")
    assert not store.delete_key("a/b")
    assert not store.check(["a/b"])
    assert store.num_keys() == 1


def test_add_is_atomic_across_threads(store: NatsKVStore) -> None:
    def bump() -> None:
        for _ in range(10):
            store.add("counter", 1)
    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.add("counter", 0) == 40
    assert store.get("counter") == b"40"


def test_compare_set_follows_tcpstore(store: NatsKVStore) -> None:
    assert store.compare_set("k", b"x", b"y") == b"x"  # absent, expected non-empty
    assert not store.check(["k"])
    assert store.compare_set("k", b"", b"first") == b"first"  # absent, expected empty
    assert store.compare_set("k", b"wrong", b"second") == b"first"
    assert store.compare_set("k", b"first", b"second") == b"second"
    assert store.get("k") == b"second"


def test_wait_times_out_with_a_clear_error(store: NatsKVStore) -> None:
    with pytest.raises(StoreTimeout, match="never"):
        store.wait(["never"], timedelta(seconds=0.3))


def test_two_gloo_processes_all_reduce_through_nats_kv(store: NatsKVStore,
                                                       broker: EmbeddedBroker,
                                                       tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    for session in ("session-a", "session-b"):  # a second group on a fresh prefix works too
        procs = [subprocess.Popen([sys.executable, str(script), broker.url, str(r), "2",
                                   session], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for r in range(2)]
        outs = [p.communicate(timeout=90) for p in procs]
        for p, (out, err) in zip(procs, outs, strict=True):
            assert p.returncode == 0, err
            assert out.split(" ", 1)[1].strip() == "[3.0, 3.0, 3.0, 3.0]"
