"""The spread behind the training tests' accuracy bounds (issue 33).

Runs the ledgered digits job of ``tests/integration/test_training.py`` the way those tests
do (a real nats-server, ``ddpbus coordinator`` and two ``ddpbus worker`` processes, gloo or
the broker backend), once per seed (``--knob seed=S``: the epochs' permutations and the
initial weights), for every policy the tests cover, and reports each variant's test
accuracy: min, median, max. A test's bound sits below the worst accuracy seen here, with
margin; its docstring quotes the spread.

    python tests/accuracy_spread.py --seeds 20            # every variant, seeds 0..19
    python tests/accuracy_spread.py --seeds 5 --only async-partitions
    python tests/accuracy_spread.py --seeds 20 --only run-demo run-resumed  # test_run_cli

The ``run-*`` variants are ``tests/integration/test_run_cli.py``'s: ``ddpbus run`` on the
digits example (the demo, 20 epochs; and 3 epochs resumed to 6), seed by ``--knob seed=S``.

Under cadence and async the averaging schedule follows the measured speeds, so even a fixed
seed is not one fixed run: the spread covers scheduling too. Output:
``bench/results/accuracy-spread-<UTC time>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "integration"))

from jobs import spec, start_job  # noqa: E402

from ddpbus.orchestrator.runtime.nats_server import BrokerConfig, EmbeddedBroker  # noqa: E402

RESULTS = HERE.parent / "bench" / "results"
RUN = [sys.executable, "-m", "ddpbus.orchestrator.tools.cli", "run"]
DIGITS = str(HERE.parent / "examples" / "digits.py") + ":spec"
CLI_VARIANTS = {"run-demo": 20, "run-resumed": 6}  # name: epochs of the run measured
# (name, coordinator args, epochs, rank-1 slowdown): the test_training.py variants
VARIANTS: list[tuple[str, list[str], int, str | None]] = [
    ("sync-progressive", ["--policy", "sync", "--knob", "progressive=true"], 10, None),
    ("sync-partitions", ["--policy", "sync", "--knob", "progressive=false"], 10, None),
    ("cadence-progressive", ["--policy", "cadence", "--knob", "progressive=true"], 20, None),
    ("cadence-partitions", ["--policy", "cadence", "--knob", "progressive=false"], 20, None),
    ("async-progressive", ["--policy", "async", "--knob", "progressive=true"], 20, None),
    ("async-partitions", ["--policy", "async", "--knob", "progressive=false"], 20, None),
    ("broker-cadence", ["--policy", "cadence", "--backend", "broker"], 20, None),
    ("broker-async-easgd", ["--policy", "async", "--backend", "broker"], 20, None),
    ("broker-cadence-bf16-throttled", ["--policy", "cadence", "--backend", "broker",
                                       "--knob", "bf16_wire=true", "--knob",
                                       "max_batch_diff=1"], 20, "2.5"),
]


def one_run(url: str, tmp: Path, name: str, args: list[str], epochs: int,
            slowdown: str | None, seed: int) -> float:
    ledger = tmp / "ledger"
    ledger.mkdir(parents=True)
    job = start_job(url, tmp, spec("ledger"), job=f"{name}-{seed}",
                    coordinator_args=[*args, "--knob", f"seed={seed}"],
                    worker_args={1: ["--slowdown", slowdown]} if slowdown else None,
                    env={"LEDGER_DIR": str(ledger), "LEDGER_EPOCHS": str(epochs)},
                    final_state=False)
    summary = job.wait(300)
    assert summary["ok"], summary
    return float(summary["test_accuracy"])


def cli_run(tmp: Path, name: str, seed: int) -> float:
    """test_run_cli's run of the digits example with seed ``seed``: its test accuracy."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPBUS_")}
    knob = ["--knob", f"seed={seed}", "--no-progress"]

    def run(*args: str) -> None:
        done = subprocess.run([*RUN, DIGITS, "--workers", "2", *knob, *args], cwd=tmp,
                              env=env, capture_output=True, text=True, timeout=300,
                              check=False)
        assert done.returncode == 0, done.stderr[-3000:]

    tmp.mkdir(parents=True)
    if name == "run-resumed":
        run("--epochs", "3", "--out", str(tmp / "first"))
        run("--epochs", "6", "--resume", str(tmp / "first"), "--out", str(tmp / "second"))
        out = tmp / "second"
    else:
        run("--out", str(tmp / "demo"))
        out = tmp / "demo"
    return float(json.loads((out / "summary.json").read_text())["test_accuracy"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20, help="seeds 0..N-1 (default 20)")
    parser.add_argument("--only", nargs="+", choices=[*(v[0] for v in VARIANTS),
                                                      *CLI_VARIANTS],
                        help="these variants only")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or RESULTS / f"accuracy-spread-{stamp}.json"
    chosen = [v for v in VARIANTS if not args.only or v[0] in args.only]
    cli_chosen = [v for v in CLI_VARIANTS if not args.only or v in args.only]
    report: dict[str, Any] = {"when": stamp, "seeds": args.seeds, "variants": {}}
    with tempfile.TemporaryDirectory() as work, \
            EmbeddedBroker(BrokerConfig(port=0, store_dir=Path(work) / "store")) as broker:
        for name, extra, epochs, slowdown in chosen:
            accs = [one_run(broker.url, Path(work) / f"{name}-{s}", name, extra, epochs,
                            slowdown, s) for s in range(args.seeds)]
            row = {"min": min(accs), "median": statistics.median(accs), "max": max(accs),
                   "accuracies": accs, "epochs": epochs}
            report["variants"][name] = row
            print(f"{name:32s} min {row['min']:.4f}  median {row['median']:.4f}  "
                  f"max {row['max']:.4f}  ({len(accs)} seeds)", flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=2) + "\n")
        for name in cli_chosen:
            accs = [cli_run(Path(work) / f"{name}-{s}", name, s) for s in range(args.seeds)]
            report["variants"][name] = {"min": min(accs), "median": statistics.median(accs),
                                        "max": max(accs), "accuracies": accs,
                                        "epochs": CLI_VARIANTS[name]}
            print(f"{name:32s} min {min(accs):.4f}  median {statistics.median(accs):.4f}  "
                  f"max {max(accs):.4f}  ({len(accs)} seeds)", flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"report: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
