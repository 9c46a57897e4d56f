"""Control-path latency: SyncNow publish -> every SyncAck, vs a raw NATS request/reply.

ddpbus side: ``ddpbus run bench/specs/tiny.py:spec --workers 2 --policy sync`` (a model so
small the collective costs ~0.3 ms); the coordinator's decision log has, for every average,
``publish_to_acks_ms`` = time from handing SyncNow to the publisher (JetStream) to holding
both SyncAcks: two stored JetStream hops, two hand-offs to and from the training threads,
and the gloo all-reduce. That is the measure the target is about. Shown beside it:
``reduce_ms``, from the decision instead, which adds the write-ahead snapshot stored before
anything is published. Baseline: nats-py request/reply (200-byte payload, responder in
another process, core NATS), measured in the same run right before, *during* (same machine
load) and after the ddpbus runs. Reports medians and the ratio; target <= 2x.

Run: ``python bench/control_latency.py [--rounds 3] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from _results import record
from _runs import ddpbus_run, median, write_json
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from ddpbus.orchestrator.runtime.nats_server import BrokerConfig, EmbeddedBroker
from ddpbus.orchestrator.transport.bus import connect

TARGET = 2.0
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="ddpbus runs (default 3)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    with EmbeddedBroker(BrokerConfig()) as broker:
        responder = subprocess.Popen([sys.executable, "-c", RESPONDER, broker.url])  # noqa: S603
        try:
            asyncio.run(_responder_up(broker.url))
            idle = asyncio.run(_rtt(broker.url, 2000))
            loaded: list[float] = []
            reduce_ms: list[float] = []
            decided_ms: list[float] = []
            per_run: list[dict[str, Any]] = []
            for _ in range(args.rounds):
                stop = threading.Event()

                def probe(stop: threading.Event = stop) -> None:
                    while not stop.is_set():
                        loaded.extend(asyncio.run(_rtt(broker.url, 50, pause=0.005)))

                prober = threading.Thread(target=probe, daemon=True)
                prober.start()
                run = ddpbus_run("tiny", "--policy", "sync")
                stop.set()
                prober.join()
                averaged = run.of("averaged")[5:]  # skip warm-up
                xs = [e["publish_to_acks_ms"] for e in averaged]
                reduce_ms += xs
                decided_ms += [e["reduce_ms"] for e in averaged]
                per_run.append({"rounds": run.summary["rounds"], "p50_ms": median(xs)})
            after = asyncio.run(_rtt(broker.url, 2000))
        finally:
            responder.kill()
    rtt_idle = median(idle + after)
    rtt_loaded = median(loaded)
    ours = median(reduce_ms)
    doc = {
        "syncnow_to_all_acks_ms": {"p50": ours, "p99": _percentile(reduce_ms, 0.99),
                                   "n": len(reduce_ms), "runs": per_run},
        "decision_to_all_acks_ms": {"p50": median(decided_ms),
                                    "p99": _percentile(decided_ms, 0.99)},
        "request_reply_rtt_ms": {"idle_p50": rtt_idle, "idle_p99": _percentile(idle + after,
                                                                               0.99),
                                 "during_runs_p50": rtt_loaded, "n_during": len(loaded)},
        "ratio_vs_idle_rtt": ours / rtt_idle,
        "ratio_vs_loaded_rtt": ours / rtt_loaded,
        "target": TARGET,
    }
    path = write_json("control_latency", doc, args.json)
    p99 = doc["syncnow_to_all_acks_ms"]["p99"]
    sys.stdout.write(
        f"SyncNow -> all SyncAcks      p50 {ours:.3f} ms  p99 {p99:.3f} ms"
        f"  ({len(reduce_ms)} averages, {args.rounds} runs)\n"
        f"decision -> all SyncAcks     p50 {doc['decision_to_all_acks_ms']['p50']:.3f} ms"
        f"  (with the write-ahead snapshot)\n"
        f"request/reply RTT idle       p50 {rtt_idle:.3f} ms\n"
        f"request/reply RTT during run p50 {rtt_loaded:.3f} ms\n"
        f"ratio vs idle RTT   {doc['ratio_vs_idle_rtt']:.2f}x   "
        f"vs RTT under the same load {doc['ratio_vs_loaded_rtt']:.2f}x   target <= {TARGET}x: "
        f"{'PASS' if doc['ratio_vs_loaded_rtt'] <= TARGET else 'FAIL'}\n"
        f"wrote {path}\n")
    record("control_latency", doc, {
        "syncnow_to_all_acks_p50_ms": ours, "syncnow_to_all_acks_p99_ms": p99,
        "decision_to_all_acks_p50_ms": doc["decision_to_all_acks_ms"]["p50"],
        "rtt_idle_p50_ms": rtt_idle, "rtt_during_runs_p50_ms": rtt_loaded,
        "ratio_vs_loaded_rtt": doc["ratio_vs_loaded_rtt"]}, args.json)


if __name__ == "__main__":
    main()
