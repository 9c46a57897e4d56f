"""``ddpbus delete-job``: remove a finished job's stream, KV bucket and Object Stores.

A run leaves its record on the broker on purpose: ``status``, ``replay``, ``report`` and a
later ``coordinator --resume JOB`` read it, and the stream's ``max_age`` ages its messages
out. The KV bucket and the two Object Stores (resume bundles: the model and optimizer state,
``KEEP_VERSIONS`` of them) have no age limit, so a broker that runs job after job keeps every
one's bundles until somebody deletes them. This is that somebody.

What it refuses, before deleting anything:

- a job that is running: its coordinator holds the lease (``coordinator.lease`` not yet
  expired), or a process of the job is heard on ``live.>`` (a coordinator beats every
  second, a rank too) within :data:`LISTEN`. ``--force`` does not override this: deleting
  under a live job fails its processes at their next read or write;
- a job that has not finished (no ``run.summary``): a crashed run can still be restarted or
  resumed from its bundles. ``--force`` deletes it anyway.

The job's stream goes first (a process started late then fails at once instead of
training), its KV bucket last: the summary and lease stay readable until the end, so a
deletion cut short is safe to repeat. Bundles written to a ``--bundle-dir`` are files, not
broker state: they are named and left alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Final

import nats.errors
from nats.aio.client import Client
from nats.js.client import JetStreamContext
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, NotFoundError

from ddpbus.codecs import subjects as sj
from ddpbus.codecs.errors import DdpbusError
from ddpbus.orchestrator.persist import bundles
from ddpbus.orchestrator.persist.lease import parse as parse_lease
from ddpbus.orchestrator.persist.recording import NoSuchJob
from ddpbus.orchestrator.transport.auth import Access, access

LISTEN: Final = 2.5  # seconds of listening for beats: every process beats once a second


class JobRunning(DdpbusError, RuntimeError):
    """The job's coordinator or one of its ranks is alive: nothing was deleted."""


class JobUnfinished(DdpbusError, RuntimeError):
    """The job has no summary (it may still be restarted or resumed); nothing was deleted."""


@dataclass(frozen=True, slots=True)
class Held:
    """One JetStream stream a job owns."""

    what: str  # "stream", "KV bucket", "Object Store"
    name: str  # the stream's name (a bucket's is KV_<bucket> / OBJ_<bucket>)
    messages: int
    bytes: int

    def describe(self) -> str:
        return f"{self.what} {self.name} ({self.messages} messages, {self.bytes:,} bytes)"


def owned(job: str) -> list[tuple[str, str]]:
    """(what, stream name) of everything the job holds on the broker, in deletion order."""
    return [("stream", sj.stream_name(job)),
            ("Object Store", f"OBJ_{sj.rounds_bucket(job)}"),
            ("Object Store", f"OBJ_{sj.bundles_bucket(job)}"),
            ("KV bucket", sj.kv_stream(job))]


async def held(js: JetStreamContext, job: str) -> list[Held]:
    out = []
    for what, name in owned(job):
        try:
            info = await js.stream_info(name)
        except NotFoundError:
            continue
        out.append(Held(what, name, info.state.messages, info.state.bytes))
    return out


async def _heard(nc: Client, job: str, within: float) -> str | None:
    """The first subject a process of the job beats on within ``within`` seconds."""
    heard: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def on(msg: object) -> None:
        if not heard.done():
            heard.set_result(str(getattr(msg, "subject", "")))

    sub = await nc.subscribe(sj.job_wildcard(job, "live"), cb=on)
    try:
        return await asyncio.wait_for(asyncio.shield(heard), within)
    except TimeoutError:
        return None
    finally:
        await sub.unsubscribe()


async def _kv_value(js: JetStreamContext, job: str, key: str) -> bytes | None:
    try:
        kv = await js.key_value(sj.kv_bucket(job))
        return (await kv.get(key)).value or None
    except (BucketNotFoundError, NotFoundError, KeyNotFoundError):  # no bucket, or no key
        return None


async def check(nc: Client, job: str, *, force: bool, listen: float = LISTEN) -> None:
    """Raise unless the job may be deleted (see the module's docstring)."""
    js = nc.jetstream()
    lease = await _kv_value(js, job, sj.LEASE_KEY)
    if lease is not None:
        holder = parse_lease(lease, 0)
        left = holder.expires - time.time()
        if left > 0:
            raise JobRunning(
                f"job {job!r} is running: coordinator {holder.holder} holds its lease for "
                f"{left:.1f}s more; stop the job first (nothing was deleted)")
    subject = await _heard(nc, job, listen)
    if subject is not None:
        raise JobRunning(f"job {job!r} is running: a process beats on {subject}; stop "
                         "every coordinator and rank of the job first (nothing was deleted)")
    if not force and await _kv_value(js, job, sj.SUMMARY_KEY) is None:
        raise JobUnfinished(
            f"job {job!r} has not finished (it has no run summary): its coordinator can "
            "still resume it and its bundles restart it; --force deletes it anyway "
            "(nothing was deleted)")


async def delete(server: str | Access, job: str, *, force: bool = False,
                 dry_run: bool = False, listen: float = LISTEN) -> list[str]:
    """Delete the job's streams; returns one line per stream (deleted or, dry, to delete)."""
    nc = await access(server).connect(job, name=f"ddpbus-delete-{job}")
    lines: list[str] = []
    try:
        js = nc.jetstream()
        found = await held(js, job)
        if not found:
            raise NoSuchJob(f"the broker holds no job {job!r} (no stream, KV bucket or "
                            "Object Store of it)")
        await check(nc, job, force=force, listen=listen)
        manifest = None
        with contextlib.suppress(bundles.BundleError):  # unreadable: names no directory
            manifest = await bundles.latest(js, job)
        for item in found:
            if not dry_run:
                with contextlib.suppress(NotFoundError):  # gone since listed: run twice
                    await js.delete_stream(item.name)
            lines.append(("would delete " if dry_run else "deleted ") + item.describe())
        if manifest is not None and manifest.store.get("kind") == "dir":
            lines.append(f"left alone: bundle files under {manifest.store.get('path')} "
                         "(a --bundle-dir is not broker state)")
    except nats.errors.TimeoutError:
        # a request the server's permissions refuse is dropped: the client only times out
        done = "; ".join(lines) if lines else "nothing was deleted"
        raise DdpbusError(
            f"JetStream did not answer for job {job!r} ({done}); on a secured broker "
            "delete-job needs the job coordinator's identity (--nats-nkey "
            "coordinator.nk)") from None
    else:
        return lines
    finally:
        await nc.close()
