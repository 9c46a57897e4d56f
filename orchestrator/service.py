"""The coordinator's asyncio shell around the pure core (``ddpbus coordinator``).

It only translates: stream deliveries (timing, metrics, join) and live heartbeats become
events, a 100 ms ticker becomes :class:`Tick`, SIGTERM/SIGINT become :class:`Stop`; the
commands :func:`~ddpbus.orchestrator.core.transition` returns become publishes (in order,
through one :class:`~ddpbus.orchestrator.bus.Publisher`), event-log lines and, at the end,
the run summary. CoordHeartbeat goes out every second on live.coordinator, whatever the core
is doing. A message that fails decoding, signing or fencing is counted, logged once per
reason, and never reaches the core.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import time
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from ddpbus.codecs import DecodeError, Decoder, Encoder
from ddpbus.codecs import messages as m
from ddpbus.codecs import subjects as sj
from ddpbus.codecs.errors import DdpbusError
from ddpbus.orchestrator import bus
from ddpbus.orchestrator.config import describe
from ddpbus.orchestrator.core import initial_state, transition
from ddpbus.orchestrator.provision import ensure_job
from ddpbus.orchestrator.state import (
    Admit,
    CoreConfig,
    Event,
    Finish,
    Joined,
    Metrics,
    Record,
    Refuse,
    Send,
    Stop,
    Tick,
    Timing,
)
from ddpbus.orchestrator.summary import summarize

log = logging.getLogger(__name__)
events_log = logging.getLogger("ddpbus.orchestrator.events")

TICK_S = 0.1
SUMMARY_KEY = "run.summary"
CONFIG_KEY = "run.config"


class JobInUse(DdpbusError, RuntimeError):
    """The job's stream already holds another coordinator's progress."""


@dataclass(frozen=True, kw_only=True)
class CoordinatorSettings:
    job: str
    nats_url: str
    key: bytes
    summary_path: Path | None = None
    events_path: Path | None = None
    wire_json: bool = False
    connect_deadline: timedelta = timedelta(seconds=30)


class Coordinator:
    def __init__(self, settings: CoordinatorSettings, config: CoreConfig) -> None:
        self.settings = settings
        self.config = config
        self.clock = time.monotonic
        self.state = initial_state(config, self.clock())
        self.rejected: Counter[str] = Counter()
        self.finish: asyncio.Future[Finish] | None = None
        self._events_file: IO[str] | None = None

    async def run(self) -> int:
        s = self.settings
        nc = await bus.connect(s.nats_url, name=f"ddpbus-{s.job}-coordinator",
                               deadline=s.connect_deadline)
        try:
            return await self._run(nc)
        finally:
            with contextlib.suppress(Exception):
                await nc.close()
            if self._events_file is not None:
                self._events_file.close()

    async def _run(self, nc: Client) -> int:
        s = self.settings
        js = nc.jetstream()
        await ensure_job(js, s.job, self.config.world_size)
        await self._check_fresh(js)
        kv = await js.key_value(sj.kv_bucket(s.job))
        generation = await bus.next_generation(kv, sj.COORDINATOR)
        self.config = dataclasses.replace(self.config, coordinator_generation=generation)
        self.state = initial_state(self.config, self.clock())
        await kv.put(CONFIG_KEY, json.dumps(describe(self.config.schedule)).encode())
        self.encoder = Encoder(job=s.job, key=s.key, sender=sj.COORDINATOR,
                               generation=generation, wire_json=s.wire_json)
        self.decoder = Decoder(job=s.job, key=s.key)
        self.nc, self.publisher = nc, bus.Publisher(js)
        if s.events_path is not None:
            s.events_path.parent.mkdir(parents=True, exist_ok=True)
            self._events_file = s.events_path.open("a", encoding="utf-8")
        loop = asyncio.get_running_loop()
        self.finish = loop.create_future()
        reader = bus.StreamReader(nc, sj.stream_name(s.job), sj.COORDINATOR_CONSUMER,
                                  self._on_stream)
        live = await nc.subscribe(sj.LIVE_RANK.wildcard(s.job), cb=self._on_live)
        tasks = [asyncio.create_task(c, name=n) for c, n in (
            (self.publisher.run(), "publisher"), (reader.run(), "stream-reader"),
            (self._ticker(), "ticker"), (self._beacon(), "coord-heartbeat"))]
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._signal, sig)
        log.info("coordinator generation %d for job %s: waiting for %d ranks", generation,
                 s.job, self.config.world_size)
        try:
            done = await self.finish
            stored = await self.publisher.flush(30.0)
        finally:
            await live.unsubscribe()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        summary = summarize(self.state) | {"decode_rejections": dict(self.rejected)}
        await kv.put(SUMMARY_KEY, json.dumps(summary).encode())
        if s.summary_path is not None:
            s.summary_path.parent.mkdir(parents=True, exist_ok=True)
            s.summary_path.write_text(json.dumps(summary, indent=2) + "\n")
        (log.info if done.ok else log.error)("run %s: %s", "complete" if done.ok else "ended",
                                            done.reason)
        return 0 if done.ok and stored else 1

    async def _check_fresh(self, js: Any) -> None:
        info = await js.consumer_info(sj.stream_name(self.settings.job),
                                      sj.COORDINATOR_CONSUMER)
        if info.ack_floor is not None and (info.ack_floor.stream_seq or 0) > 0:
            raise JobInUse(f"job {self.settings.job!r} already has a coordinator's progress in "
                           "its stream (resuming a coordinator is not in this build); start a "
                           "new job name")

    # ------------------------------------------------------------------ events

    def apply(self, event: Event) -> None:
        """Run one event through the core and carry out its commands, in order."""
        self.state, commands = transition(self.state, event, self.clock())
        job = self.settings.job
        for c in commands:
            if isinstance(c, Send):
                subject = (sj.CONTROL_ALL.subject(job) if c.rank is None
                           else sj.CONTROL_RANK.subject(job, c.rank))
                self.publisher.submit(self.encoder.encode(subject, c.msg))
            elif isinstance(c, Admit):
                self.publisher.submit(self.encoder.encode(
                    sj.ADMIT_RANK.subject(job, c.msg.rank), c.msg))
            elif isinstance(c, Record):
                self._record(c)
            elif isinstance(c, Refuse):
                log.warning("refused (%s): %s", c.reason, c.detail)
            elif isinstance(c, Finish) and self.finish is not None and not self.finish.done():
                self.finish.set_result(c)

    def _record(self, c: Record) -> None:
        line = json.dumps({"t": round(self.clock(), 6), "event": c.event, **c.fields},
                          default=str)
        events_log.info("%s", line)
        if self._events_file is not None:
            self._events_file.write(line + "\n")
            self._events_file.flush()

    def _decode(self, msg: Msg) -> m.Message | None:
        try:
            body = self.decoder.decode(msg.subject, msg.headers, msg.data).message
        except DecodeError as exc:
            self.rejected[exc.reason] += 1
            if self.rejected[exc.reason] == 1:
                log.warning("dropped a message (%s); further %s drops are counted only", exc,
                            exc.reason)
            return None
        return body  # type: ignore[return-value]

    async def _on_stream(self, msg: Msg) -> None:
        body = self._decode(msg)
        if isinstance(body, m.MetricsMsg):
            self.apply(Metrics(body))
        elif isinstance(body, m.Hello | m.Rejoin):
            self.apply(Joined(body))
        elif body is not None:
            self.apply(Timing(body))  # type: ignore[arg-type]

    async def _on_live(self, msg: Msg) -> None:
        body = self._decode(msg)
        if isinstance(body, m.Heartbeat):
            self.apply(Timing(body))

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            self.apply(Tick())

    async def _beacon(self) -> None:
        out = None
        subject = sj.LIVE_COORDINATOR.subject(self.settings.job)
        while True:
            out = self.encoder.encode(subject, m.CoordHeartbeat())
            with contextlib.suppress(Exception):
                await bus.publish_core(self.nc, out)
            await asyncio.sleep(1.0)

    def _signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        log.info("%s: asking every rank to save and exit", name)
        self.apply(Stop(reason=f"stopped by {name}"))
