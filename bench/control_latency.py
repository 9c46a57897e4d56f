"""Control-path latency, split: the command's delivery, the collective, the whole round.

ddpbus side: ``ddpbus run bench/specs/tiny.py:spec --workers 2 --policy sync`` (a model so
small the collective costs little). For every average, the coordinator's "averaged" record
splits the round (the ranks' SyncAcks carry their side of it; one host, one clock):

- (a) **decision -> SyncNow held by every rank** (``deliver_ms``): the write-ahead record
  stored first (``write_ahead_ms``), then one JetStream hop to each rank's agent. Target
  <= 2x the raw nats-py request/reply RTT at p50 and <= 4x at p99, RTT measured in the
  same run, under the same load;
- (b) **the collective under ddpbus vs a bare ``torch.distributed.all_reduce``** of a flat
  buffer of the same size (``_bare_allreduce.py``, two gloo processes): back to back in a
  loop (*hot*: the baseline the target is about), and *paced* (both idle 5 ms, then enter
  at the same instant, as ddpbus's ranks come to it after waiting for SyncNow). ddpbus's
  figure is the whole in-place average (``average_ms``: weighting, the all-reduce, the
  division and copy back) as the rank that waited least in it saw it; the all-reduce call
  alone (``collective_ms``) is shown beside it. Target <= 1.1x the hot loop;
- (c) **SyncNow published -> both SyncAcks held** (``publish_to_acks_ms``), end to end as
  before: two JetStream hops, two hand-offs to and from the training threads and the
  collective.

The RTT baseline: nats-py request/reply (200-byte payload, responder in another process,
core NATS), idle before and after, and probed every 5 ms *during* the ddpbus runs. Rounds
alternate bare collective and ddpbus run; medians and percentiles over every average.

Run: ``python bench/control_latency.py [--rounds 3] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _results import record
from _runs import ddpbus_run, median, quiet, write_json
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from ddpbus.orchestrator.runtime.nats_server import BrokerConfig, EmbeddedBroker
from ddpbus.orchestrator.transport.bus import connect
from ddpbus.worker_agent.averaging import FlatModel, wire_numel

TARGET_P50, TARGET_P99, TARGET_COLLECTIVE = 2.0, 4.0, 1.1
HERE = Path(__file__).resolve().parent
RESPONDER = """
import asyncio, sys
import nats
async def main():
    nc = await nats.connect(sys.argv[1])
    async def reply(msg):
        await nc.publish(msg.reply, msg.data)
    await nc.subscribe("rtt", cb=reply)
    await asyncio.Event().wait()
asyncio.run(main())
"""


async def _rtt(url: str, n: int, pause: float = 0.0) -> list[float]:
    nc = await connect(url, name="rtt-probe")
    out = []
    payload = b"x" * 200
    for _ in range(n):
        t = time.perf_counter()
        await nc.request("rtt", payload, timeout=5)
        out.append((time.perf_counter() - t) * 1000.0)
        if pause:
            await asyncio.sleep(pause)
    await nc.close()
    return out


async def _responder_up(url: str, within: float = 30.0) -> None:
    """Until the responder answers (it subscribes once its process has started)."""
    nc = await connect(url, name="rtt-wait")
    deadline = time.monotonic() + within
    while True:
        try:
            await nc.request("rtt", b"", timeout=0.5)
            break
        except (NoRespondersError, NatsTimeoutError):
            if time.monotonic() > deadline:
                raise RuntimeError("the request/reply responder never answered") from None
            await asyncio.sleep(0.05)  # poll interval of a deadline-bound wait
    await nc.close()


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _stats(xs: list[float]) -> dict[str, float | int]:
    return {"p50": median(xs), "p99": _percentile(xs, 0.99), "n": len(xs)}


def _flat_numel() -> int:
    """What an average of tiny.py's model all-reduces (averaging.wire_numel)."""
    sys.path.insert(0, str(HERE / "specs"))
    import tiny

    return wire_numel(FlatModel(tiny.spec.model()))


def bare_allreduce(numel: int, rounds: int = 300, period: float = 0.005) -> list[float]:
    """Per round, the faster rank's milliseconds (it waited least for its peer); ``period``
    0: back to back."""
    quiet()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "took.json"
        procs = [subprocess.Popen([sys.executable, str(HERE / "_bare_allreduce.py"), str(r),  # noqa: S603
                                   "2", str(Path(tmp) / "store"), str(numel), str(rounds),
                                   str(period), str(out)], stderr=subprocess.PIPE)
                 for r in range(2)]
        for p in procs:
            _, err = p.communicate(timeout=300)
            if p.returncode != 0:
                raise RuntimeError(f"bare all-reduce failed:\n{err.decode()[-2000:]}")
        per_rank = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]
    return [min(a, b) for a, b in zip(*per_rank, strict=True)][10:]  # skip warm-up


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="ddpbus runs (default 3)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    numel = _flat_numel()
    split: dict[str, list[float]] = {k: [] for k in (
        "deliver_ms", "write_ahead_ms", "average_ms", "collective_ms", "publish_to_acks_ms",
        "reduce_ms")}
    bare: list[float] = []  # hot: back to back
    paced: list[float] = []  # idle 5 ms, then together
    loaded: list[float] = []
    per_run: list[dict[str, Any]] = []
    with EmbeddedBroker(BrokerConfig()) as broker:
        responder = subprocess.Popen([sys.executable, "-c", RESPONDER, broker.url])  # noqa: S603
        try:
            asyncio.run(_responder_up(broker.url))
            idle = asyncio.run(_rtt(broker.url, 2000))
            for _ in range(args.rounds):
                bare += bare_allreduce(numel, period=0.0)
                paced += bare_allreduce(numel)
                quiet()  # before the prober starts: it keeps the machine from idling
                stop = threading.Event()

                def probe(stop: threading.Event = stop) -> None:
                    while not stop.is_set():
                        loaded.extend(asyncio.run(_rtt(broker.url, 50, pause=0.005)))

                prober = threading.Thread(target=probe, daemon=True)
                prober.start()
                run = ddpbus_run("tiny", "--policy", "sync", settle=False)
                stop.set()
                prober.join()
                averaged = [e for e in run.of("averaged")[5:]  # skip warm-up
                            if not e.get("failed")]
                missing = [k for k in split if any(k not in e for e in averaged)]
                if missing:
                    raise RuntimeError(f"averaged records without {missing}: {averaged[:1]}")
                for k, xs in split.items():
                    xs += [float(e[k]) for e in averaged]
                per_run.append({"rounds": run.summary["rounds"],
                                "deliver_p50_ms": median([e["deliver_ms"] for e in averaged])})
            idle += asyncio.run(_rtt(broker.url, 2000))
        finally:
            responder.kill()
    rtt = {"idle": _stats(idle), "during_runs": _stats(loaded)}
    rtt50, rtt99 = rtt["during_runs"]["p50"], rtt["during_runs"]["p99"]
    a = _stats(split["deliver_ms"])
    b = {"ddpbus_average_ms": _stats(split["average_ms"]),
         "ddpbus_collective_call_ms": _stats(split["collective_ms"]),
         "bare_all_reduce_ms": _stats(bare), "paced_all_reduce_ms": _stats(paced),
         "numel": numel}
    c = _stats(split["publish_to_acks_ms"])
    doc = {
        "a_decision_to_every_rank_ms": a | {
            "write_ahead_p50": median(split["write_ahead_ms"]),
            "ratio_p50_vs_rtt": a["p50"] / rtt50, "ratio_p99_vs_rtt": a["p99"] / rtt99,
            "target_p50": TARGET_P50, "target_p99": TARGET_P99},
        "b_collective": b | {"ratio": b["ddpbus_average_ms"]["p50"] / median(bare),
                             "call_ratio": b["ddpbus_collective_call_ms"]["p50"] / median(bare),
                             "target": TARGET_COLLECTIVE},
        "c_syncnow_to_all_acks_ms": c | {"ratio_p50_vs_rtt": c["p50"] / rtt50,
                                         "runs": per_run},
        "decision_to_all_acks_ms": _stats(split["reduce_ms"]),
        "request_reply_rtt_ms": rtt,
    }
    path = write_json("control_latency", doc, args.json)
    da, db, dc = (doc["a_decision_to_every_rank_ms"], doc["b_collective"],
                  doc["c_syncnow_to_all_acks_ms"])

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    sys.stdout.write(
        f"request/reply RTT during the runs  p50 {rtt50:.3f} ms  p99 {rtt99:.3f} ms"
        f"  (idle p50 {rtt['idle']['p50']:.3f} ms)\n"
        f"(a) decision -> SyncNow held by every rank  p50 {a['p50']:.3f} ms  p99 "
        f"{a['p99']:.3f} ms  (write-ahead record p50 {da['write_ahead_p50']:.3f} ms)\n"
        f"    ratio vs RTT  p50 {da['ratio_p50_vs_rtt']:.2f}x (target <= {TARGET_P50}x: "
        f"{verdict(da['ratio_p50_vs_rtt'] <= TARGET_P50)})  p99 {da['ratio_p99_vs_rtt']:.2f}x "
        f"(target <= {TARGET_P99}x: {verdict(da['ratio_p99_vs_rtt'] <= TARGET_P99)})\n"
        f"(b) collective of {numel} floats  ddpbus average p50 "
        f"{b['ddpbus_average_ms']['p50']:.3f} ms (its all-reduce call "
        f"{b['ddpbus_collective_call_ms']['p50']:.3f} ms)  bare all_reduce p50 "
        f"{median(bare):.3f} ms hot, {median(paced):.3f} ms paced\n"
        f"    ratio {db['ratio']:.2f}x (call alone {db['call_ratio']:.2f}x)  target <= "
        f"{TARGET_COLLECTIVE}x: {verdict(db['ratio'] <= TARGET_COLLECTIVE)}\n"
        f"(c) SyncNow published -> both SyncAcks  p50 {c['p50']:.3f} ms  p99 {c['p99']:.3f} ms"
        f"  ({dc['ratio_p50_vs_rtt']:.2f}x RTT; {c['n']} averages, {args.rounds} runs)\n"
        f"wrote {path}\n")
    record("control_latency", doc, {
        "deliver_p50_ms": a["p50"], "deliver_p99_ms": a["p99"],
        "deliver_ratio_p50": da["ratio_p50_vs_rtt"], "deliver_ratio_p99": da["ratio_p99_vs_rtt"],
        "write_ahead_p50_ms": da["write_ahead_p50"],
        "average_p50_ms": b["ddpbus_average_ms"]["p50"], "bare_all_reduce_p50_ms": median(bare),
        "paced_all_reduce_p50_ms": median(paced), "collective_ratio": db["ratio"],
        "syncnow_to_all_acks_p50_ms": c["p50"], "syncnow_to_all_acks_p99_ms": c["p99"],
        "rtt_during_runs_p50_ms": rtt50, "rtt_during_runs_p99_ms": rtt99}, args.json)


if __name__ == "__main__":
    main()
