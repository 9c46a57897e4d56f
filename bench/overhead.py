"""ddpbus overhead: a 2-worker gloo run vs a hand-written loop on the same schedule.

ddpbus side: ``ddpbus run bench/specs/compute.py:spec --workers 2`` (cadence, a
compute-bound MLP); throughput = samples / the coordinator's training time (first Batch
reported -> last average acknowledged by every rank). Baseline: ``_handwritten.py`` replays
the averaging schedule ddpbus recorded (steps per rank per average) with plain
torch.distributed on the same model, data and batch size, timed from its first step to its
last average. Two workloads: batches of 64 (~1.5 ms each here: where a per-step cost shows
most) and 256 (~5 ms). Runs alternate; medians over ``--rounds``; target throughput ratio
>= 0.97 at both. Beside it, in the same rounds: ddpbus with every per-batch report sent
alone (``report_interval=0``, as flodl does) against the same baseline, to show what
coalesced reports are worth, and ddpbus with ``prefetch=2`` (batches read on a background
thread; the default is 0 for this in-memory dataset on the CPU), which must not cost.
The noise floor, in the same rounds: the baseline run a second time on the same schedule,
its ratio to the first (a difference between ddpbus and the baseline smaller than this
spread is not resolved). Every timed run starts once the machine is idle
(``_runs.quiet``), so what the previous run left behind does not land in it.

Where the time goes: CPU seconds per 1,000 samples, ddpbus's split by the accounts its
processes log at exit (each rank's training thread, its agent loop, torch's and gloo's other
threads; the coordinator; the embedded nats-server; the rest: the launcher and every
process's start-up), beside the hand-written run's total (rusage of its processes). On a
2-core machine every CPU second outside the training threads is taken from them.

Run: ``python bench/overhead.py [--rounds 3] [--json PATH]``. To profile one worker's
training thread and agent loop, see docs/performance.md ("Profiling a worker").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _results import record
from _runs import children_cpu_s, ddpbus_run, median, quiet, write_json

HERE = Path(__file__).resolve().parent
TARGET = 0.97
WORKLOADS = {"batch 64": {"BENCH_BATCH": "64", "BENCH_EPOCHS": "3"},
             "batch 256": {"BENCH_BATCH": "256", "BENCH_EPOCHS": "6"}}
SPLIT = ("training_threads", "agent_loops", "worker_other_threads", "coordinator", "broker",
         "rest")


def handwritten(schedule: list[list[int]], env: dict[str, str]) -> tuple[float, float, float]:
    """(wall s from first step to last average, CPU s of both processes in that span, CPU s
    of both processes in all)."""
    quiet()
    cpu0 = children_cpu_s()
    with tempfile.TemporaryDirectory() as tmp:
        sched, out = Path(tmp) / "schedule.json", Path(tmp) / "out.json"
        sched.write_text(json.dumps(schedule))
        procs = [subprocess.Popen([sys.executable, str(HERE / "_handwritten.py"), str(r),  # noqa: S603
                                   "2", str(Path(tmp) / "store"), str(sched), str(out)],
                                  env=os.environ | env, stderr=subprocess.PIPE)
                 for r in range(2)]
        for p in procs:
            _, err = p.communicate(timeout=600)
            if p.returncode != 0:
                raise RuntimeError(f"hand-written baseline failed:\n{err.decode()[-2000:]}")
        timed = sum(float(Path(f"{out}.cpu{r}").read_text()) for r in range(2))
        return float(json.loads(out.read_text())["wall_s"]), timed, children_cpu_s() - cpu0


def _one(env: dict[str, str], backend: tuple[str, ...]) -> dict[str, Any]:
    run = ddpbus_run("compute", *backend, env=env)
    alone = ddpbus_run("compute", "--knob", "report_interval=0", *backend, env=env)
    ahead = ddpbus_run("compute", *backend, env=env | {"BENCH_PREFETCH": "2"})
    schedule = [[e["steps"]["0"], e["steps"]["1"]] for e in run.of("average")]
    samples = run.summary["global_step"] * int(env["BENCH_BATCH"])
    ours = run.summary["train_s"]
    theirs, their_loop_cpu, their_cpu = handwritten(schedule, env)
    again, _, _ = handwritten(schedule, env)  # the same baseline twice: the noise floor
    per_k = 1000.0 / samples
    # the uncoalesced run's own schedule differs a little (El Che adapts); compare its
    # throughput, not its time, with the baseline's
    alone_rate = alone.summary["global_step"] * int(env["BENCH_BATCH"]) / alone.summary["train_s"]
    return {"ddpbus_train_s": ours, "handwritten_wall_s": theirs,
            "ddpbus_samples_per_s": samples / ours, "handwritten_samples_per_s": samples / theirs,
            "ratio": theirs / ours, "averages": len(schedule),
            "baseline_again_ratio": theirs / again,
            "steps": run.summary["global_step"],
            "reports_alone_samples_per_s": alone_rate,
            "reports_alone_ratio": alone_rate / (samples / theirs),
            "prefetch_ratio": (ahead.summary["global_step"] * int(env["BENCH_BATCH"])
                               / ahead.summary["train_s"]) / (samples / theirs),
            "messages": run.summary["messages_handled"],
            "cpu_s_per_1k_samples": {k: v * per_k for k, v in run.cpu.items()
                                     if not k.startswith("wall_")},
            # of each rank's training time, the share its training thread stood waiting
            # for the coordinator, and the share it spent in averages
            "waiting_share": run.cpu["wall_waiting_for_coordinator"] / (2 * ours),
            "averaging_share": run.cpu["wall_averaging"] / (2 * ours),
            "handwritten_cpu_s_per_1k_samples": their_cpu * per_k,
            "handwritten_loop_cpu_s_per_1k_samples": their_loop_cpu * per_k,
            "reports_alone_messages": alone.summary["messages_handled"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--quick", action="store_true", help="smoke run: one short workload")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where both sides train (cuda: GPU rank %% count)")
    ap.add_argument("--backend", choices=["gloo", "nccl"], default="gloo",
                    help="both sides' collectives (nccl needs a GPU per rank)")
    args = ap.parse_args()
    device = {"BENCH_DEVICE": args.device, "BENCH_BACKEND": args.backend}
    backend = ("--backend", args.backend, "--device",
               "auto" if args.device == "cuda" else "cpu")  # auto: cuda:<rank mod count>
    doc: dict[str, Any] = {"target": TARGET, "device": args.device, "backend": args.backend,
                           "workloads": {}}
    workloads = {"batch 256 (quick)": {"BENCH_BATCH": "256", "BENCH_EPOCHS": "1"}} \
        if args.quick else WORKLOADS
    for name, env in workloads.items():
        rows = [_one(env | device, backend) for _ in range(args.rounds)]
        ratio = median([r["ratio"] for r in rows])
        alone = median([r["reports_alone_ratio"] for r in rows])
        prefetch = median([r["prefetch_ratio"] for r in rows])
        floor = [r["baseline_again_ratio"] for r in rows]
        doc["workloads"][name] = {"runs": rows, "median_ratio": ratio,
                                  "baseline_again_median_ratio": median(floor),
                                  "baseline_again_spread": [min(floor), max(floor)],
                                  "reports_alone_median_ratio": alone,
                                  "prefetch_median_ratio": prefetch}
        for r in rows:
            sys.stdout.write(f"{name:10s} ddpbus {r['ddpbus_samples_per_s']:9.0f} samples/s  "
                             f"hand-written {r['handwritten_samples_per_s']:9.0f} samples/s  "
                             f"ratio {r['ratio']:.3f}  ({r['averages']} averages, "
                             f"{r['steps']} steps, {r['messages']} messages)  reports alone "
                             f"{r['reports_alone_samples_per_s']:9.0f} samples/s, ratio "
                             f"{r['reports_alone_ratio']:.3f} ({r['reports_alone_messages']} "
                             f"messages)\n")
        cpu = {k: median([r["cpu_s_per_1k_samples"][k] for r in rows]) for k in
               (*SPLIT, "total")}
        their_cpu = median([r["handwritten_cpu_s_per_1k_samples"] for r in rows])
        their_loop = median([r["handwritten_loop_cpu_s_per_1k_samples"] for r in rows])
        doc["workloads"][name] |= {"median_cpu_s_per_1k_samples": cpu,
                                   "median_handwritten_cpu_s_per_1k_samples": their_cpu,
                                   "median_handwritten_loop_cpu_s_per_1k_samples": their_loop}
        sys.stdout.write(f"{name:10s} CPU s per 1k samples (medians): ddpbus {cpu['total']:.3f} "
                         "(" + ", ".join(f"{k.replace('_', ' ')} {cpu[k]:.3f}" for k in SPLIT)
                         + f"); hand-written {their_cpu:.3f} (its timed loop {their_loop:.3f},"
                         " against ddpbus's training threads)\n")
        waiting = median([r["waiting_share"] for r in rows])
        averaging = median([r["averaging_share"] for r in rows])
        doc["workloads"][name] |= {"median_waiting_share": waiting,
                                   "median_averaging_share": averaging}
        sys.stdout.write(f"{name:10s} of a rank's training time (medians): waiting for the "
                         f"coordinator {waiting:.1%}, averaging {averaging:.1%}\n")
        sys.stdout.write(f"{name:10s} median throughput ratio {ratio:.3f}  target >= {TARGET}: "
                         f"{'PASS' if ratio >= TARGET else 'FAIL'}  (every report alone: "
                         f"{alone:.3f}; prefetch=2: {prefetch:.3f})\n"
                         f"{name:10s} noise floor: the baseline against itself, median "
                         f"{median(floor):.3f}, spread {min(floor):.3f}-{max(floor):.3f}\n")
    sys.stdout.write(f"wrote {write_json('overhead', doc, args.json)}\n")
    record(("overhead-quick" if args.quick else "overhead")
           + ("-cuda" if args.device == "cuda" else ""), doc,
           {f"{name} {k}": w[k] for name, w in doc["workloads"].items()
            for k in ("median_ratio", "reports_alone_median_ratio", "prefetch_median_ratio",
                      "baseline_again_median_ratio")},
           args.json)


if __name__ == "__main__":
    main()
