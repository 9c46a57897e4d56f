"""Shared fixtures: a real nats-server with JetStream per test (port 0, temp store)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client

from ddpbus.orchestrator.runtime.nats_server import BrokerConfig, EmbeddedBroker
from ddpbus.orchestrator.transport.bus import connect

JOB_KEY = b"test-job-key-0123456789abcdef!!"


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[EmbeddedBroker]:
    """With a system-account user (seed ``broker.config.system_seed``), as `ddpbus run`
    starts it: a coordinator given ``--nats-system-nkey`` reads its client advisories."""
    with EmbeddedBroker(BrokerConfig(port=0, store_dir=tmp_path / "store",
                                     system_seed=tmp_path / "system.nk")) as b:
        yield b


@pytest.fixture
async def nc(broker: EmbeddedBroker) -> AsyncIterator[Client]:
    client = await connect(broker.url, name="ddpbus-test")
    yield client
    await client.close()
