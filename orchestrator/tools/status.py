"""``ddpbus status``: where a job stands, read from its KV bucket and stream.

The coordinator's write-ahead snapshot (verified with the job key) gives the phase, epoch,
global step, averaging rounds, every member (generation, liveness, last heard, batch share)
and El Che's anchor and counts; the lease key says who leads and until when; the bundle
manifest names the last checkpoint; the stream and the coordinator's consumer say how much
traffic there is and how far behind the coordinator reads. Nothing here writes anything.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

from nats.js.client import JetStreamContext
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, NotFoundError

from ddpbus.codecs import Decoder
from ddpbus.codecs import subjects as sj
from ddpbus.orchestrator.core.state import State
from ddpbus.orchestrator.persist import bundles, journal, snapshot
from ddpbus.orchestrator.persist.lease import parse as parse_lease
from ddpbus.orchestrator.persist.recording import NoSuchJob
from ddpbus.orchestrator.transport.auth import Access, access


async def _get(kv: Any, key: str) -> bytes | None:
    try:
        entry = await kv.get(key)
    except KeyNotFoundError:
        return None
    return entry.value or None


def _members(s: State, now: float) -> list[dict[str, Any]]:
    total = sum(r.batches_total for r in s.ranks) or 1
    out = []
    for r in s.ranks:
        state = ("dead" if r.dead else "exited" if r.exited else "alive" if r.alive
                 else "waiting")
        out.append({
            "rank": r.rank, "state": state + (" (rejoined, awaiting consensus)" if r.fresh
                                              else ""),
            "generation": r.hello.generation if r.hello else None,
            "host": r.hello.host if r.hello else None,
            "device": r.hello.device if r.hello else None,
            "last_heard_s_ago": round(now - r.last_heard, 3) if r.last_heard else None,
            "step": r.step, "batches": r.batches_total,
            "batch_share": round(r.batches_total / total, 4),
            "count": s.elche.counts.get(r.rank), "loss": r.last_loss,
            "divergence": r.divergence,
            "death": r.death or None,
        })
    return out


def from_state(s: State, now: float) -> dict[str, Any]:
    return {
        "phase": s.phase.value, "epoch": s.epoch, "epochs": s.schedule.epochs,
        "global_step": s.global_step, "rounds": s.rounds,
        "policy": s.schedule.policy.value,
        "backend": s.backend.value if s.backend else None,
        "world_size": s.config.world_size, "alive": len(s.alive), "deaths": s.deaths,
        "rejoins": s.rejoins, "sessions": s.sessions,
        "coordinator_generation": s.config.coordinator_generation,
        "anchor": s.elche.anchor, "anchor_rank": s.elche.anchor_rank,
        "elche_phase": s.elche.phase.name.lower(),
        "members": _members(s, now),
        "outcome": None if s.outcome is None else {"ok": s.outcome[0], "why": s.outcome[1]},
        "refused": dict(s.refusals),
    }


async def gather(js: JetStreamContext, job: str, key: bytes) -> dict[str, Any]:
    """Everything ``status`` shows, as JSON-able data."""
    try:
        kv = await js.key_value(sj.kv_bucket(job))
        info = await js.stream_info(sj.stream_name(job))
    except (BucketNotFoundError, NotFoundError):
        raise NoSuchJob(f"the broker holds no job {job!r} (no stream {sj.stream_name(job)} "
                        f"or bucket {sj.kv_bucket(job)})") from None
    now = time.time()
    out: dict[str, Any] = {"job": job}
    raw = await _get(kv, sj.SNAPSHOT_KEY)
    if raw is None:
        out["phase"] = "not started (no coordinator snapshot yet)"
    else:
        snap = snapshot.decode(raw, key)
        with contextlib.suppress(snapshot.SnapshotError):  # the snapshot alone, then
            snap = journal.extend(snap, await journal.read(kv, snap.journal, key),
                                  Decoder(job=job, key=key))
        out |= from_state(snap.state, now)
        out["snapshot"] = {"stream_seq": snap.stream_seq,
                           "age_s": round(now - snap.saved_at, 3)}
    lease = await _get(kv, sj.LEASE_KEY)
    if lease:
        held = parse_lease(lease, 0)  # an unreadable value reads as expired
        out["lease"] = {"holder": held.holder, "expires_in_s": round(held.expires - now, 3)}
    else:
        out["lease"] = None
    manifest = await bundles.latest(js, job)
    out["last_checkpoint"] = None if manifest is None else {
        "version": manifest.version, "epoch": manifest.meta.get("epoch"),
        "global_step": manifest.meta.get("global_step"), "store": manifest.store}
    summary = await _get(kv, sj.SUMMARY_KEY)
    done = _json_object(summary)
    if done is not None:
        out["summary"] = {k: done.get(k) for k in ("ok", "reason", "test_accuracy",
                                                    "epochs", "rounds", "wall_s")}
    out["stream"] = {"messages": info.state.messages, "bytes": info.state.bytes,
                     "last_seq": info.state.last_seq,
                     # durables and watchers; the durables go once the run is over
                     "consumers": info.state.consumer_count}
    try:
        consumer = await js.consumer_info(sj.stream_name(job), sj.COORDINATOR_CONSUMER)
        out["stream"]["coordinator_pending"] = consumer.num_pending
    except NotFoundError:
        out["stream"]["coordinator_pending"] = None
    return out


def render(doc: dict[str, Any]) -> str:
    """The human view of :func:`gather`'s data."""
    lines = [f"job {doc['job']}: {doc.get('phase')}"]
    if "global_step" in doc:
        outcome = doc.get("outcome")
        lines.append(
            f"  epoch {doc['epoch']}/{doc['epochs']}  global step {doc['global_step']}  "
            f"averaging rounds {doc['rounds']}  {doc['policy']}/{doc['backend']}"
            + (f"  ended: {'ok' if outcome['ok'] else 'failed'} ({outcome['why']})"
               if outcome else ""))
        lines.append(
            f"  members {doc['alive']}/{doc['world_size']} alive, {doc['deaths']} deaths, "
            f"{doc['rejoins']} rejoins; coordinator generation "
            f"{doc['coordinator_generation']}")
        lines.append(f"  El Che: anchor {doc['anchor']} (rank {doc['anchor_rank']}), "
                     f"{doc['elche_phase']}")
        lines.append("  rank  state     gen  host           last heard  batches  share   "
                     "count  loss")
        for r in doc["members"]:
            heard = "-" if r["last_heard_s_ago"] is None else f"{r['last_heard_s_ago']:.1f}s"
            loss = "-" if r["loss"] is None else f"{r['loss']:.4f}"
            lines.append(f"  {r['rank']:>4}  {r['state']:<9} {r['generation'] or '-':>3}  "
                         f"{(r['host'] or '-')[:13]:<13}  {heard:>10}  {r['batches']:>7}  "
                         f"{r['batch_share']:>5.1%}  {r['count'] or '-':>5}  {loss}")
            if r.get("death"):
                lines.append(f"        dead: {r['death']}")
    lease = doc.get("lease")
    lines.append("  lease: " + ("none" if lease is None else
                                f"{lease['holder']}, expires in {lease['expires_in_s']:.1f}s"))
    ckpt = doc.get("last_checkpoint")
    lines.append("  last checkpoint: " + ("none" if ckpt is None else
                                          f"bundle v{ckpt['version']} (epoch {ckpt['epoch']}, "
                                          f"global step {ckpt['global_step']})"))
    st = doc["stream"]
    if st["coordinator_pending"] is not None:
        behind = f"coordinator behind by {st['coordinator_pending']}"
    elif doc.get("phase") == "done":
        behind = "no coordinator consumer (the run is over)"
    else:
        behind = "no coordinator consumer"
    lines.append(f"  stream: {st['messages']} messages, {st['bytes']} bytes, last seq "
                 f"{st['last_seq']}, {st['consumers']} consumers; {behind}")
    if doc.get("summary"):
        s = doc["summary"]
        lines.append(f"  summary: ok={s['ok']} accuracy={s['test_accuracy']} "
                     f"epochs={s['epochs']} rounds={s['rounds']}")
    return "\n".join(lines)


def _json_object(raw: bytes | None) -> dict[str, Any] | None:
    """A stored JSON object, None when absent or not one (status reads, never crashes)."""
    if not raw:
        return None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


async def show(nats: str | Access, job: str, key: bytes, *, as_json: bool) -> int:
    nc = await access(nats).connect(job, name=f"ddpbus-status-{job}")
    try:
        doc = await gather(nc.jetstream(), job, key)
    finally:
        await nc.close()
    print(json.dumps(doc, indent=2, default=str) if as_json else render(doc))
    return 0
