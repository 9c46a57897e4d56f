"""Seconds per averaging round: the broker backend vs the gloo all-reduce, side by side.

Two rank processes hold a model of N float32 parameters. In the same processes and the same
run, each size is averaged

- by **gloo**: ddpbus's collective path (``averaging.average``: one fused all-reduce of
  the mass-premultiplied parameters, then the divide);
- by the **broker** backend's real code: each rank snapshots and stores its contribution
  (``averaging.snapshot`` + the Object Store), the coordinator-side ``Reducer`` sums and
  divides once and stores the consensus, each rank fetches and applies it
  (``apply_consensus``) — with float32 and with bfloat16 on the wire.

A round is timed from "go" to the last rank holding the consensus (the coordinator core's
own messages add a few ms on top, see ``bench/control_latency.py``). Bytes on the wire per
round are what crosses the broker: two contributions in, the consensus out once and back
to each rank. Reports medians and ratios, never a lone absolute time.

Run: ``python bench/averaging.py [--sizes 10,100] [--rounds 3] [--json PATH]``
(sizes in millions of parameters; ``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _results import record
from _runs import median, write_json

WORLD = 2


# ------------------------------------------------------------------ rank side


async def rank_main(rank: int, url: str, job: str, numel: int, rounds: int,
                    store_file: str) -> None:
    import torch
    import torch.distributed as dist

    from ddpbus.codecs import subjects as sj
    from ddpbus.orchestrator.transport import bus
    from ddpbus.worker_agent import averaging

    torch.manual_seed(rank)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.randn(numel))
    flat = averaging.FlatModel(model)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank,
                            world_size=WORLD)
    gloo = []
    for i in range(rounds + 1):  # the first is a warm-up
        dist.barrier()
        t0 = time.perf_counter()
        averaging.average(flat, 5 + rank, gamma=1.0, measure=True, device=flat.flats[0].device)
        if i:
            gloo.append(time.perf_counter() - t0)
    dist.destroy_process_group()

    nc = await bus.connect(url, name=f"bench-rank-{rank}")
    store = await bus.rounds_store(nc.jetstream(), job)
    chunk = bus.object_chunk(nc.max_payload)
    snaps: dict[int, averaging.Snapshot] = {}

    async def go(msg: Any) -> None:
        version, bf16 = json.loads(msg.data)
        snap, blob = averaging.snapshot(flat, version=version, steps=5 + rank, step=version,
                                        gamma=1.0, bf16=bf16)
        if blob is None:
            raise RuntimeError("a rank with steps has a contribution")
        digest = await bus.put_object(store, sj.round_contribution(version, rank),
                                          blob, chunk)
        snaps[version] = snap
        await msg.respond(json.dumps({"mass": snap.mass, "digest": digest,
                                      "nbytes": len(blob)}).encode())

    async def update(msg: Any) -> None:
        version = json.loads(msg.data)
        blob, _ = await bus.read_object(store, sj.round_consensus(version))
        averaging.apply_consensus(flat, snaps.pop(version), blob, alpha=1.0, measure=True)
        await msg.respond(b"ok")

    done = asyncio.Event()

    async def stop(msg: Any) -> None:
        await msg.respond(json.dumps(gloo).encode())
        done.set()

    await nc.subscribe(f"bench.{job}.go.{rank}", cb=go)
    await nc.subscribe(f"bench.{job}.update.{rank}", cb=update)
    await nc.subscribe(f"bench.{job}.stop.{rank}", cb=stop)
    await nc.publish(f"bench.{job}.up.{rank}", b"")
    await done.wait()
    await nc.close()


# ------------------------------------------------------------------ main side


async def broker_round(nc: Any, red: Any, job: str, version: int, bf16: bool
                       ) -> tuple[float, int]:
    from ddpbus.orchestrator.core.state import Contribution, Reduce

    t0 = time.perf_counter()
    replies = await asyncio.gather(*(nc.request(f"bench.{job}.go.{r}", json.dumps(
        [version, bf16]).encode(), timeout=600) for r in range(WORLD)))
    parts = [json.loads(x.data) for x in replies]
    cmd = Reduce(version=version, bf16=bf16, contributions=tuple(
        Contribution(rank=r, mass=p["mass"], step=version, digest=p["digest"],
                     nbytes=p["nbytes"]) for r, p in enumerate(parts)))
    result = await red.run(cmd)
    if not result.ok:
        raise RuntimeError(result.detail)
    await asyncio.gather(*(nc.request(f"bench.{job}.update.{r}", json.dumps(version).encode(),
                                      timeout=600) for r in range(WORLD)))
    seconds = time.perf_counter() - t0
    consensus = parts[0]["nbytes"]  # same layout and wire dtype as a contribution
    return seconds, sum(p["nbytes"] for p in parts) + consensus * (1 + WORLD)


async def transports(url: str, numel: int, rounds: int) -> dict[str, Any]:
    """The choice behind the broker backend: one contribution's bytes through the Object
    Store (acknowledged chunks, digest-checked) vs as tensor frames on a core NATS subject
    (fire and forget, reassembled by a subscriber on another connection)."""
    import numpy as np

    from ddpbus.codecs.tensor import TensorAssembler, decode_frame, encode_frames
    from ddpbus.orchestrator.transport import bus

    job = f"tr{numel}"
    pub = await bus.connect(url, name="bench-pub")
    sub_nc = await bus.connect(url, name="bench-sub")
    store = await bus.rounds_store(pub.jetstream(), job)
    data = np.random.default_rng(0).standard_normal(numel).astype(np.float32)
    blob = data.tobytes()
    chunk = bus.object_chunk(pub.max_payload)
    got: dict[str, list[float]] = {"object_put": [], "object_get": [], "frames": []}
    lost = 0
    for v in range(rounds + 1):
        t0 = time.perf_counter()
        await bus.put_object(store, f"v{v}.probe", blob, chunk)
        t1 = time.perf_counter()
        back, _ = await bus.read_object(store, f"v{v}.probe")
        t2 = time.perf_counter()
        if back != blob:
            raise RuntimeError("the Object Store gave back other bytes")
        done = asyncio.get_running_loop().create_future()
        state: dict[str, TensorAssembler] = {}

        async def on_frame(msg: Any, state: dict[str, TensorAssembler] = state,
                           done: asyncio.Future[None] = done) -> None:
            c = decode_frame(msg.data)
            if "t" not in state:
                state["t"] = TensorAssembler(c)
                complete = state["t"].complete
            else:
                complete = state["t"].add(c)
            if complete and not done.done():
                done.set_result(None)

        sub = await sub_nc.subscribe(f"bench.{job}.frames.{v}", cb=on_frame,
                                     pending_bytes_limit=256 * 2**20)
        await sub_nc.flush()
        t3 = time.perf_counter()
        for frame in encode_frames("p", "float32", (numel,), memoryview(blob),
                                   max_payload=pub.max_payload - 8 * 1024, version=v):
            await pub.publish(f"bench.{job}.frames.{v}", frame)
        delivered = True
        try:
            # (5x the Object Store's time, at least 10 s: past that the frames are lost)
            await asyncio.wait_for(done, max(10.0, 5 * (t2 - t0)))
        except TimeoutError:
            # core NATS is at most once: a frame dropped on the way (a slow consumer, a busy
            # machine) loses the whole contribution. That is the finding, counted, and the
            # reason the broker backend goes through the Object Store; a lost round's time
            # is the timeout, not a transfer, so it stays out of the median.
            lost += 1
            delivered = False
        t4 = time.perf_counter()
        await sub.unsubscribe()
        if v:
            got["object_put"].append(t1 - t0)
            got["object_get"].append(t2 - t1)
            if delivered:
                got["frames"].append(t4 - t3)
    await pub.close()
    await sub_nc.close()
    return ({k: (median(x) if x else None) for k, x in got.items()}
            | {"frames_lost": lost, "frame_rounds": rounds + 1, "bytes": len(blob)})


async def measure(url: str, numel: int, rounds: int) -> dict[str, Any]:
    from ddpbus.orchestrator.runtime import broker_reducer
    from ddpbus.orchestrator.transport import bus

    job = f"avg{numel}"
    nc = await bus.connect(url, name="bench-main")
    up = asyncio.Queue[int]()

    async def ready(msg: Any) -> None:
        await up.put(int(msg.subject.rsplit(".")[-1]))

    await nc.subscribe(f"bench.{job}.up.*", cb=ready)
    with tempfile.TemporaryDirectory() as tmp:
        # (started once, before anything is timed: blocking here costs the bench nothing)
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--url", url,  # noqa: S603, ASYNC220
                                   "--job", job, "--numel", str(numel), "--rounds",
                                   str(rounds), "--store", f"{tmp}/gloo.store"],
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
                 for r in range(WORLD)]
        try:
            for _ in range(WORLD):
                await asyncio.wait_for(up.get(), 900)
            red = broker_reducer.Reducer(nc.jetstream(), job, nc.max_payload)
            out: dict[str, Any] = {}
            for bf16 in (False, True):
                times, wire = [], 0
                for v in range(rounds + 1):  # the first is a warm-up
                    seconds, wire = await broker_round(nc, red, job, 1 + v + 100 * bf16, bf16)
                    if v:
                        times.append(seconds)
                out["bf16" if bf16 else "f32"] = {"s_per_round": median(times),
                                                   "rounds": times, "wire_bytes": wire}
            replies = await asyncio.gather(*(nc.request(f"bench.{job}.stop.{r}", b"",
                                                        timeout=60) for r in range(WORLD)))
            gloo = [t for x in replies for t in json.loads(x.data)]
            # a ring all-reduce sends 2 (W-1)/W of the buffer per rank
            out["gloo"] = {"s_per_round": median(gloo), "rounds": gloo,
                           "wire_bytes": 2 * (WORLD - 1) * (numel + 2) * 4}
        finally:
            for p in procs:
                p.wait(120)
    await nc.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10,100", help="millions of parameters (default 10,100)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="0.1 M parameters, 2 rounds")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--numel", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        asyncio.run(rank_main(args.rank, args.url, args.job, args.numel, args.rounds,
                              args.store))
        return
    from ddpbus.orchestrator.runtime.nats_server import EmbeddedBroker

    sizes = [0.1] if args.quick else [float(x) for x in args.sizes.split(",")]
    rounds = 2 if args.quick else args.rounds
    results = []
    with EmbeddedBroker() as broker:
        for size in sizes:
            numel = int(size * 1_000_000)
            r = asyncio.run(measure(broker.url, numel, rounds))
            results.append({"params": numel, **r,
                            "transport": asyncio.run(transports(broker.url, numel, rounds))})
    print(f"{'params':>8} {'gloo s':>8} {'broker f32 s':>12} {'x gloo':>7} "
          f"{'broker bf16 s':>13} {'x gloo':>7} {'wire f32 MiB':>12} {'bf16/f32':>8}")
    for r in results:
        g, f, b = (r[k]["s_per_round"] for k in ("gloo", "f32", "bf16"))
        print(f"{r['params'] / 1e6:>7.1f}M {g:>8.3f} {f:>12.3f} {f / g:>7.1f} {b:>13.3f} "
              f"{b / g:>7.1f} {r['f32']['wire_bytes'] / 2**20:>12.1f} "
              f"{r['bf16']['wire_bytes'] / r['f32']['wire_bytes']:>8.3f}")
    print("\none contribution's bytes, Object Store vs core-NATS tensor frames (median s):")
    print(f"{'params':>8} {'MiB':>7} {'obj put':>8} {'obj get':>8} {'put+get':>8} "
          f"{'frames':>8} {'frames/obj':>10} {'lost':>5}")
    for r in results:
        t = r["transport"]
        both = t["object_put"] + t["object_get"]
        frames, ratio = ((f"{t['frames']:>8.3f}", f"{t['frames'] / both:>10.2f}")
                         if t["frames"] is not None else (f"{'all lost':>8}", f"{'-':>10}"))
        print(f"{r['params'] / 1e6:>7.1f}M {t['bytes'] / 2**20:>7.1f} {t['object_put']:>8.3f} "
              f"{t['object_get']:>8.3f} {both:>8.3f} {frames} {ratio} "
              f"{t['frames_lost']:>2}/{t['frame_rounds']}")
    doc = {"world": WORLD, "rounds": rounds, "results": results}
    path = write_json("averaging", doc, args.json)
    print(f"wrote {path}")
    record("averaging-quick" if args.quick else "averaging", doc,
           {f"{r['params'] / 1e6:g}M {k} s_per_round": r[k]["s_per_round"]
            for r in results for k in ("gloo", "f32", "bf16")}, args.json)


if __name__ == "__main__":
    main()
