"""The flake hunt (issue 33): run the integration and chaos tests several times in a row
with one core kept busy, and say which tests failed in which round.

A test that fails in any round and passes in another is a flake: a bug in the test or in
the code, to be found and fixed at its cause (never with a retry or a wider bound).

    python tests/flake_hunt.py --rounds 5 -- -n 2 --dist worksteal   # what `make flake-hunt` runs
    python tests/flake_hunt.py --rounds 2 --no-hog -- -k publisher
    python tests/flake_hunt.py --rounds 5 --full -- -n 2   # the full chaos loops too

Each round runs pytest once over ``--paths`` (every test there, the slow ones included,
with a fresh chaos seed per scenario: DDPTEST_CHAOS_SEED=random; ``--full`` adds the full
chaos loops), on the pytest workers the arguments after ``--`` ask for: with ``-n 2`` on a
two-core machine the hog makes three busy processes for two cores, harsher than CI),
writing a JUnit XML per round. The hog is ``python -c 'while 1: pass'`` started here and
killed by its pid at the end, whatever happens. The outcome of every round, the failures
with their first message line, and the wall times go to
``bench/results/flake-hunt-<UTC time>.json``; the exit status is 1 when any round failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


@contextmanager
def cpu_hog(enabled: bool) -> Iterator[int | None]:
    """A busy loop on one core for as long as the block runs (its pid, or None)."""
    if not enabled:
        yield None
        return
    hog = subprocess.Popen([sys.executable, "-c", "while 1: pass"])
    try:
        yield hog.pid
    finally:
        hog.kill()
        hog.wait()


def outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """Test id -> (outcome, first line of its failure message) from a JUnit XML file."""
    out: dict[str, tuple[str, str]] = {}
    if not junit.exists():
        return out
    # pytest's own JUnit file, written by this script's round: trusted input
    for case in ET.parse(junit).iter("testcase"):  # noqa: S314
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                outcome = "failed" if kind != "skipped" else "skipped"
                message = (node.get("message") or "").splitlines()[0][:300] \
                    if node.get("message") else ""
                break
        out[test] = (outcome, message)
    return out


def run_round(i: int, paths: list[str], extra: list[str], work: Path, *, full: bool
              ) -> dict[str, Any]:
    junit = work / f"round-{i}.xml"
    env = {**os.environ, "DDPTEST_CHAOS_SEED": "random"}
    if full:
        env["DDPTEST_CHAOS_FULL"] = "1"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"--junitxml={junit}", *paths, *extra], cwd=ROOT, env=env,
                          check=False, capture_output=True, text=True)
    wall = time.monotonic() - started
    (work / f"round-{i}.log").write_text(done.stdout + done.stderr)
    results = outcomes(junit)
    failed = {t: msg for t, (o, msg) in results.items() if o == "failed"}
    counts = {o: sum(1 for x, _ in results.values() if x == o)
              for o in ("passed", "failed", "skipped")}
    summary = (done.stdout.strip().splitlines() or [""])[-1]
    print(f"round {i}: {summary} ({wall:.0f} s wall)", flush=True)
    for test, msg in failed.items():
        print(f"  FAILED {test}: {msg}", flush=True)
    return {"round": i, "exit": done.returncode, "wall_s": round(wall, 1), **counts,
            "failed_tests": failed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="arguments after -- go to pytest")
    parser.add_argument("--rounds", type=int, default=5, help="runs in a row (default 5)")
    parser.add_argument("--no-hog", dest="hog", action="store_false",
                        help="leave both cores free")
    parser.add_argument("--paths", nargs="+", default=["tests/integration", "tests/chaos"],
                        help="what each round runs (default: integration and chaos)")
    parser.add_argument("--full", action="store_true", help="the full chaos loops too "
                        "(DDPTEST_CHAOS_FULL=1: 20 worker kills, 10 coordinator kills...)")
    parser.add_argument("--out", type=Path, default=None,
                        help="the JSON report (default bench/results/flake-hunt-<time>.json)")
    args, extra = parser.parse_known_args(argv)
    extra = [x for x in extra if x != "--"]
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or RESULTS / f"flake-hunt-{stamp}.json"
    work = ROOT / "build" / f"flake-hunt-{stamp}"
    work.mkdir(parents=True, exist_ok=True)
    with cpu_hog(args.hog) as hog:
        print(f"flake hunt: {args.rounds} rounds of {' '.join(args.paths)}"
              + (f", CPU hog pid {hog}" if hog else ", no hog"), flush=True)
        rounds = [run_round(i, args.paths, extra, work, full=args.full)
                  for i in range(1, args.rounds + 1)]
    flaky = sorted({t for r in rounds for t in r["failed_tests"]})
    report = {
        "when": stamp, "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
            text=True, check=False).stdout.strip(),
        "machine": {"cores": os.cpu_count(), "python": platform.python_version()},
        "hog": args.hog, "full_chaos": args.full, "paths": args.paths, "pytest_args": extra,
        "rounds": rounds,
        "failed_in_any_round": {t: [r["round"] for r in rounds if t in r["failed_tests"]]
                                for t in flaky},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    walls = sorted(r["wall_s"] for r in rounds)
    print(f"flake hunt: {sum(1 for r in rounds if r['exit'] == 0)}/{len(rounds)} rounds "
          f"green, median round {walls[len(walls) // 2]:.0f} s; {len(flaky)} test(s) failed "
          f"in some round; report {out}", flush=True)
    return 0 if not flaky and all(r["exit"] == 0 for r in rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
