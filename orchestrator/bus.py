"""NATS plumbing shared by the coordinator, the workers and the tools.

Connecting goes through tenacity (nats-py's first connect to an absent server hangs unless
reconnects are bounded); publishing takes :class:`~ddpbus.codecs.Outbound` as the codec
built it. Only this module and its callers import nats; codecs never does.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import nats
from nats.aio.client import Client
from nats.js.api import PubAck
from nats.js.client import JetStreamContext
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from ddpbus.codecs import Outbound
from ddpbus.codecs.errors import DdpbusError

log = logging.getLogger(__name__)


class BusUnavailable(DdpbusError, ConnectionError):
    """The NATS server could not be reached within the connect deadline."""


async def connect(url: str, *, name: str, deadline: timedelta = timedelta(seconds=30),
                  user_credentials: str | None = None) -> Client:
    """Connect with exponential back-off until ``deadline``; afterwards reconnect forever."""
    try:
        async for attempt in AsyncRetrying(
            stop=stop_after_delay(deadline.total_seconds()),
            wait=wait_exponential(multiplier=0.05, max=2.0),
            retry=retry_if_exception_type((OSError, TimeoutError, nats.errors.Error)),
            reraise=True,
        ):
            with attempt:
                return await nats.connect(
                    url, name=name, user_credentials=user_credentials,
                    connect_timeout=2, max_reconnect_attempts=1, reconnect_time_wait=0.1,
                    allow_reconnect=True,
                )
    except (OSError, TimeoutError, nats.errors.Error) as exc:
        raise BusUnavailable(f"cannot reach NATS at {url} within {deadline}: {exc}") from exc
    raise BusUnavailable(f"cannot reach NATS at {url}")  # pragma: no cover - tenacity reraises


async def publish(js: JetStreamContext, out: Outbound, *, ack_timeout: float = 5.0) -> PubAck:
    """Publish one codec-built message to the job stream and await its ack."""
    ack: PubAck = await js.publish(out.subject, out.payload, timeout=ack_timeout,
                                   headers=out.headers)
    return ack


async def publish_core(nc: Client, out: Outbound) -> None:
    """Publish on a core-NATS (never stored) subject such as live.* or data.*."""
    await nc.publish(out.subject, out.payload, headers=out.headers)
