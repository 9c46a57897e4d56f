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
    with EmbeddedBroker(BrokerConfig(port=0, store_dir=tmp_path / "store")) as b:
        yield b


@pytest.fixture
async def nc(broker: EmbeddedBroker) -> AsyncIterator[Client]:
    client = await connect(broker.url, name="ddpbus-test")
    yield client
    await client.close()
