"""``ddpbus replay``: a recorded run's timeline, told from its stream.

Every stored message of the job is verified and decoded in stream order; the ones that
mark the run's course become one line each, stamped with the time since the first
message: ranks joining and being admitted, communicator sessions, averages (with the global
step they closed), epochs aggregated, evals, bundles, deaths and the work handed on,
rejoins, exits, and the end. ``--speed X`` paces the lines at X times the recorded pace
(default: as fast as it reads). A copy stored twice (a publisher that re-sent its backlog
after a broker outage longer than the duplicate window) is told once: per sender
incarnation, the newest id and the few unseen below it (``IdWindow``, bounded, so a
stream of millions of messages costs no more memory than a short one).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from ddpbus.codecs import Decoder, Envelope
from ddpbus.codecs import messages as m
from ddpbus.codecs import subjects as sj
from ddpbus.orchestrator.core.state import IdWindow
from ddpbus.orchestrator.persist.recording import stored
from ddpbus.orchestrator.tools.progress import progress_bar
from ddpbus.orchestrator.transport.auth import Access, access


@dataclass
class Narrator:
    """Turns decoded messages into timeline lines (pure: no I/O, no clock)."""

    start: dt.datetime | None = None
    rounds: int = 0
    global_step: int = 0
    sessions: set[bytes] = field(default_factory=set)
    dead: set[int] = field(default_factory=set)
    joined: set[int] = field(default_factory=set)  # ranks that said Hello
    seen_ids: dict[tuple[str, int], IdWindow] = field(default_factory=dict)  # by incarnation
    refused: int = 0

    def stamp(self, when: dt.datetime) -> str:
        if self.start is None:
            self.start = when
        t = (when - self.start).total_seconds()
        return f"{int(t // 60):>3}:{t % 60:06.3f}"

    def tell(self, env: Envelope) -> Iterator[str]:
        """The timeline lines this message adds (most add none)."""
        if not self._first(env.msg_id):
            return  # a re-published copy
        msg = env.message
        if isinstance(msg, m.Hello | m.Rejoin):
            yield self._arrival(msg)
        elif (told := _PLAIN.get(type(msg))) is not None:
            line = told(msg, env.rank)
            if line:
                yield line
        elif isinstance(msg, m.NewNcclSession) and msg.uid_bytes not in self.sessions:
            self.sessions.add(msg.uid_bytes)
            yield (f"{'first' if msg.initial else 'new'} session: world size "
                   f"{msg.new_world_size}")
        elif isinstance(msg, m.SyncNow):
            self.rounds += 1
            yield f"average #{self.rounds} (after global step {self.global_step})"
        elif isinstance(msg, m.SetGlobalStep):
            self.global_step = msg.global_step
        elif isinstance(msg, m.DeclareDead) and msg.rank not in self.dead:
            self.dead.add(msg.rank)
            yield f"rank {msg.rank} declared dead"
        elif isinstance(msg, m.Shutdown):
            yield f"run complete after {self.rounds} averages"

    def _first(self, msg_id: str) -> bool:
        parsed = sj.parse_msg_id(msg_id)
        if parsed is None:
            return True  # not a stream id of ours: nothing to tell it apart by
        key = (parsed.sender, parsed.generation)
        w = self.seen_ids.get(key)
        if w is None:
            self.seen_ids[key] = IdWindow.first_seen(parsed.generation, parsed.seq)
            return True
        return w.admit(parsed.seq)

    def _arrival(self, msg: m.Hello | m.Rejoin) -> str:
        hello = msg.hello if isinstance(msg, m.Rejoin) else msg
        self.dead.discard(hello.rank)
        back = isinstance(msg, m.Rejoin) or hello.rank in self.joined
        self.joined.add(hello.rank)
        if back:  # a restart with nothing acked yet says Hello rather than Rejoin
            return (f"rank {hello.rank} came back (generation {hello.generation}, "
                    f"{hello.host}) and asks to rejoin")
        return f"rank {hello.rank} joined (generation {hello.generation}, {hello.host}, " \
            f"{hello.device})"


def _epoch(msg: m.EpochAggregated, _rank: int | None) -> str:
    e = msg.metrics
    loss = f"{e.avg_loss:.4f}" if math.isfinite(e.avg_loss) else str(e.avg_loss)
    return f"epoch {e.epoch} done: loss {loss}, {e.epoch_ms / 1000:.2f} s"


# messages told the same way whatever came before
_PLAIN: dict[type, Callable[[Any, int | None], str | None]] = {
    m.Accept: lambda x, _r: f"rank {x.rank} admitted (world size {x.world_size})",
    m.Reject: lambda x, r: f"rank {r} rejected: {x.reason}",
    m.EpochAggregated: _epoch,
    m.EvalBroadcast: lambda x, _r: f"eval after epoch {x.epoch}: {x.metric:.4f}",
    m.SaveConsensusModel: lambda x, _r: f"bundle v{x.version} asked of rank "
                                        f"{x.target_rank}" if x.version else None,
    m.ExtendPartition: lambda x, r: f"rank {r} takes over {x.partition_size} samples of "
                                    f"epoch {x.epoch} (offset {x.partition_offset})",
    m.Exiting: lambda x, _r: f"rank {x.rank} exited",
    m.ShutdownWithSave: lambda x, _r: f"run aborted: {x.reason.name} (every rank saves and "
                                      "exits)",
}


async def replay(nats: str | Access, job: str, key: bytes, *, speed: float | None,
                 out: IO[str] = sys.stdout) -> int:
    decoder = Decoder(job=job, key=key)
    narrator = Narrator()
    nc = await access(nats).connect(job, name=f"ddpbus-replay-{job}")
    shown_at: dt.datetime | None = None
    bar, advance = progress_bar("replaying")
    if bar is not None:
        bar.start()
    try:
        async for when, env in stored(nc, job, decoder, advance):
            if env is None:
                narrator.refused += 1
                continue
            for told in narrator.tell(env):
                if speed is not None and shown_at is not None:
                    await asyncio.sleep(max(0.0, (when - shown_at).total_seconds()) / speed)
                shown_at = when
                line = f"{narrator.stamp(when)}  {told}"
                if bar is not None:
                    bar.console.print(line, markup=False, highlight=False)
                else:
                    print(line, file=out, flush=True)
    finally:
        if bar is not None:
            bar.stop()
        await nc.close()
    if narrator.start is None:
        print(f"job {job}: nothing recorded", file=out)
    elif narrator.refused:
        print(f"({narrator.refused} stored messages did not verify or decode; not shown)",
              file=out)
    return 0
