"""The coordinator's write-ahead record in its job's KV bucket: what a successor resumes from.

A full :mod:`snapshot <ddpbus.orchestrator.persist.snapshot>` under ``sj.SNAPSHOT_KEY`` now
and then, and :mod:`journal <ddpbus.orchestrator.persist.journal>` segments on it in between.
Every write is a compare-and-set against the revision this coordinator wrote last, so once a
successor has re-written the snapshot (``fence``) the predecessor can store nothing more: its
write fails and it knows it is deposed (``snapshot``/``append`` return False). Retried while
the broker is away.
"""

from __future__ import annotations

import logging
from typing import Any

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from ddpbus.codecs import Decoder
from ddpbus.codecs import subjects as sj
from ddpbus.codecs.errors import DdpbusError
from ddpbus.orchestrator.persist import journal, snapshot
from ddpbus.orchestrator.transport import bus

log = logging.getLogger(__name__)

FENCE_TRIES = 10  # a predecessor still writing: re-load and re-fence this often


class JobInUse(DdpbusError, RuntimeError):
    """The job's stream already holds another coordinator's progress."""


class WriteAhead:
    def __init__(self, js: Any, kv: Any, job: str, key: bytes, *, world_size: int,
                 every: float = journal.FULL_EVERY_S) -> None:
        self.kv, self.job, self.key, self.world_size = kv, job, key, world_size
        self.journal = journal.Writer(js, job, key, every=every)
        self.revision: int | None = None  # KV revision of the last snapshot written (or read)
        self.loaded = b""  # the snapshot taken over, as stored (re-written to fence)
        self.replayed = (0, 0)  # journal segments and events replayed on it
        self.snapshots = 0  # full snapshots stored by this coordinator

    async def load(self) -> snapshot.Snapshot | None:
        """The predecessor's snapshot, or None for a job nothing was decided in yet. A
        snapshot that cannot be used cannot be resumed from (JobInUse)."""
        try:
            entry = await self.kv.get(sj.SNAPSHOT_KEY)
            data = entry.value or b""
            self.revision = entry.revision
        except KeyNotFoundError:
            data = b""
        if not data:
            return None
        try:
            snap = snapshot.decode(data, self.key)
        except snapshot.SnapshotError as exc:
            raise JobInUse(f"job {self.job!r}: cannot resume: {exc}") from None
        self.loaded = data
        if snap.state.config.world_size != self.world_size:
            raise JobInUse(f"job {self.job!r} runs with world size "
                           f"{snap.state.config.world_size}, not {self.world_size}")
        return snap

    async def fence(self, snap: snapshot.Snapshot) -> snapshot.Snapshot:
        """Re-write the loaded snapshot (compare-and-set), so the predecessor, should it
        still run, can store nothing more (no snapshot, no journal segment: both expect
        the revision it wrote); then extend it by the journal segments it had stored,
        which can no longer grow."""
        for _ in range(FENCE_TRIES):
            try:
                self.revision = await bus.retry_while_away(lambda: self._store(self.loaded))
                break
            except KeyWrongLastSequenceError:  # it stored another one since: load that
                again = await self.load()
                if again is None:
                    raise JobInUse(f"job {self.job!r}: its snapshot vanished while taking "
                                   "over") from None
                snap = again
        else:
            raise JobInUse(f"job {self.job!r}: another coordinator keeps writing its "
                           "snapshot; is its lease broken?")
        try:
            segments = await journal.read(self.kv, snap.journal, self.key)
        except snapshot.SnapshotError as exc:
            raise JobInUse(f"job {self.job!r}: cannot resume: {exc}") from None
        self.replayed = (len(segments), sum(len(x.events) for x in segments))
        # (the journal's messages passed every fence when first applied: no floors here)
        return journal.extend(snap, segments, Decoder(job=self.job, key=self.key))

    def next_base(self, generation: int) -> str:
        """The journal base the next full snapshot starts (its segments' keys)."""
        return f"{generation}.{self.snapshots}"

    async def snapshot(self, snap: snapshot.Snapshot, now: float) -> bool:
        """Store a full snapshot (``now``: monotonic, for the journal's schedule); False
        when a newer coordinator has written one since ours: this one is deposed."""
        data = await snapshot.encode_in_thread(snap, self.key)
        try:
            self.revision = await bus.retry_while_away(lambda: self._store(data))
        except KeyWrongLastSequenceError:
            log.error("another coordinator wrote the snapshot since this one did: deposed")  # noqa: TRY400
            return False
        self.snapshots += 1
        await self.journal.rebased(snap.journal, now)
        return True

    async def append(self, seg: journal.Segment) -> bool:
        """Store a journal segment on the latest snapshot; False when deposed."""
        try:
            await self.journal.append(seg, self.revision or 0, bus.retry_while_away)
        except journal.Deposed as exc:
            log.error("%s: deposed", exc)  # noqa: TRY400
            return False
        return True

    async def _store(self, data: bytes) -> int:
        """One compare-and-set write of the snapshot key against our last revision."""
        key = sj.SNAPSHOT_KEY
        if self.revision is None:
            return int(await self.kv.put(key, data))
        try:
            return int(await self.kv.update(key, data, last=self.revision))
        except KeyWrongLastSequenceError:
            entry = await self.kv.get(key)
            if entry.value == data and entry.revision is not None:
                return int(entry.revision)  # ours: stored before the broker went, ack lost
            raise
