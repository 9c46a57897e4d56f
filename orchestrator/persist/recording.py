"""A job's recorded stream, read back in order: what replay, the run report and the tools
that tell a finished run's story all start from."""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator, Callable
from typing import Any

from nats.js.api import ConsumerConfig, DeliverPolicy, StreamInfo
from nats.js.errors import NotFoundError

from ddpbus.codecs import DecodeError, Decoder, Envelope
from ddpbus.codecs import subjects as sj
from ddpbus.codecs.errors import DdpbusError

Progress = Callable[[int, int], None]  # (stream sequence reached, last sequence)


class NoSuchJob(DdpbusError, LookupError):
    """The broker holds no such job."""


async def stream_info(js: Any, job: str) -> StreamInfo:
    """The job's stream, or :class:`NoSuchJob` naming what is missing."""
    try:
        info: StreamInfo = await js.stream_info(sj.stream_name(job))
    except NotFoundError:
        raise NoSuchJob(f"the broker holds no job {job!r} (no stream "
                        f"{sj.stream_name(job)}): check --job, and --nats for the server"
                        ) from None
    return info


async def stored(nc: Any, job: str, decoder: Decoder,
                 progress: Progress | None = None
                 ) -> AsyncIterator[tuple[dt.datetime, Envelope | None]]:
    """Every message of ``job``'s stream, in order, decoded (None: refused); ``progress``
    hears (stream sequence, last sequence) as it goes."""
    js = nc.jetstream()
    info = await stream_info(js, job)
    last = info.state.last_seq
    if info.state.messages == 0:
        return
    sub = await js.subscribe(sj.job_wildcard(job), stream=sj.stream_name(job),
                             ordered_consumer=True,
                             config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
    try:
        while True:
            msg = await sub.next_msg(timeout=10.0)
            meta = msg.metadata
            try:
                env: Envelope | None = decoder.decode(msg.subject, msg.headers, msg.data)
            except DecodeError:
                env = None
            yield meta.timestamp, env
            if progress is not None:
                progress(meta.sequence.stream, last)
            if meta.sequence.stream >= last:
                return
    finally:
        await sub.unsubscribe()
