"""A slow rank: cadence vs sync on digits with ``--slowdown 1=2.5``.

Both runs train examples/digits.py on 2 workers, rank 1 made 2.5x slower (a simulation:
its every batch takes 2.5x as long). Time to 95 % = the coordinator's clock from training
start to the first epoch-boundary eval at >= 95 % test accuracy (evals run every epoch).
Rounds = averages over the whole run. Runs alternate; medians over ``--rounds``. Targets:
cadence reaches 95 % >= 1.7x sooner and averages >= 10x less often.

Run: ``python bench/hetero.py [--rounds 3] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from _results import record
from _runs import ROOT, Run, ddpbus_run, median, write_json

SPEED_TARGET, ROUNDS_TARGET, GOAL = 1.7, 10.0, 0.95


def time_to(run: Run, goal: float) -> float | None:
    t0 = run.started()
    hits = [e["t"] for e in run.of("eval") if e["metric"] >= goal]
    return (hits[0] - t0) if hits else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    spec = str(ROOT / "examples" / "digits")
    rows: dict[str, list[dict[str, Any]]] = {"cadence": [], "sync": []}
    for _ in range(args.rounds):
        for policy, results in rows.items():
            run = ddpbus_run(spec, "--policy", policy, "--slowdown", "1=2.5")
            results.append({"time_to_95_s": time_to(run, GOAL),
                                 "rounds": run.summary["rounds"],
                                 "accuracy": run.summary["test_accuracy"],
                                 "batch_share": run.summary["batch_share"],
                                 "wall_s": run.summary["wall_s"]})
    t = {p: median([r["time_to_95_s"] for r in rs if r["time_to_95_s"] is not None])
         for p, rs in rows.items()}
    n = {p: median([r["rounds"] for r in rs]) for p, rs in rows.items()}
    doc = {"runs": rows, "time_to_95_s": t, "rounds": n,
           "speedup": t["sync"] / t["cadence"], "rounds_ratio": n["sync"] / n["cadence"],
           "targets": {"speedup": SPEED_TARGET, "rounds_ratio": ROUNDS_TARGET}}
    for p, rs in rows.items():
        for r in rs:
            share = ", ".join(f"{k}: {v:.0%}" for k, v in r["batch_share"].items())
            t95 = "never" if r["time_to_95_s"] is None else f"{r['time_to_95_s']:.3f} s"
            sys.stdout.write(f"{p:8s} time to 95% {t95:>9}  rounds "
                             f"{r['rounds']:5d}  final acc {r['accuracy']:.4f}  batch share "
                             f"{share}\n")
    sys.stdout.write(
        f"cadence reaches 95% {doc['speedup']:.2f}x sooner (target >= {SPEED_TARGET}: "
        f"{'PASS' if doc['speedup'] >= SPEED_TARGET else 'FAIL'}), averages "
        f"{doc['rounds_ratio']:.1f}x less often (target >= {ROUNDS_TARGET}: "
        f"{'PASS' if doc['rounds_ratio'] >= ROUNDS_TARGET else 'FAIL'})\n"
        f"wrote {write_json('hetero', doc, args.json)}\n")
    record("hetero", doc, {"cadence time_to_95_s": t["cadence"], "sync time_to_95_s": t["sync"],
                           "speedup": doc["speedup"], "cadence rounds": n["cadence"],
                           "sync rounds": n["sync"], "rounds_ratio": doc["rounds_ratio"]},
           args.json)


if __name__ == "__main__":
    main()
