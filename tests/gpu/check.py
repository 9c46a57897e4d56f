"""The GPU check, in one command (<= 10 min): what only a machine with CUDA can show.

    python tests/gpu/check.py [--rounds 3] [--skip-bench]

Runs tests/gpu (two CUDA ranks' digits run; sync parity with torch DDP; the dead-peer
release; the CUDA data path: prefetch, bf16, event timing), then ``bench/overhead.py`` on
cuda (both sides on the GPUs, NCCL with a GPU per rank, else gloo), and prints one table;
the table also goes to bench/results/gpu-check-<time>.md. With no CUDA it says so and runs
nothing (exit 0): there is nothing to check.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from datetime import UTC, datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _tests(notes: Path, junit: Path) -> list[tuple[str, str, str]]:
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    str(ROOT / "tests" / "gpu"), f"--junitxml={junit}"], cwd=ROOT,
                   env=os.environ | {"GPU_CHECK_NOTES": str(notes)}, check=False,
                   timeout=420)
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):  # noqa: S314 (our own file)
        failed = case.find("failure") if case.find("failure") is not None else \
            case.find("error")
        skipped = case.find("skipped")
        outcome = ("FAILED: " + (failed.get("message") or "")[:80] if failed is not None
                   else "skipped" if skipped is not None else "passed")
        rows.append((case.get("name", "?"), outcome, f"{float(case.get('time', 0)):.1f} s"))
    if notes.exists():
        rows += [(n["what"], "figure", n["figure"])
                 for n in map(json.loads, notes.read_text().splitlines())]
    return rows


def _bench(rounds: int, backend: str, out: Path) -> list[tuple[str, str, str]]:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "overhead.py"),
                           "--device", "cuda", "--backend", backend, "--rounds", str(rounds),
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          check=False, timeout=420)
    if done.returncode != 0:
        return [("bench/overhead.py on cuda", "FAILED", done.stderr.strip()[-200:])]
    doc = json.loads(out.read_text())
    return [(f"overhead {name} (cuda, {backend})", "ratio", f"{w['median_ratio']:.3f} "
             f"(target >= {doc['target']}; prefetch=2: {w['prefetch_median_ratio']:.3f})")
            for name, w in doc["workloads"].items()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="bench/overhead.py rounds")
    ap.add_argument("--skip-bench", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.stdout.write("no CUDA device here: nothing to check (run this where a GPU is)\n")
        return 0
    count = torch.cuda.device_count()
    backend = "nccl" if count >= 2 else "gloo"
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        rows = _tests(Path(tmp) / "notes.jsonl", Path(tmp) / "junit.xml")
        if not args.skip_bench:
            rows += _bench(args.rounds, backend, Path(tmp) / "overhead.json")
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(count))
    head = (f"GPU check: {count} GPU(s) ({names}), torch {torch.__version__}, CUDA "
            f"{torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
            f"ranks' backend {backend}, {time.monotonic() - started:.0f} s")
    width = max(len(r[0]) for r in rows)
    table = "\n".join([head, "", f"| {'check':{width}s} | outcome | figure |",
                       f"|{'-' * (width + 2)}|---------|--------|",
                       *(f"| {a:{width}s} | {b} | {c} |" for a, b, c in rows)])
    sys.stdout.write(table + "\n")
    results = ROOT / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    (results / f"gpu-check-{stamp}.md").write_text(table + "\n")
    return 1 if any(b.startswith("FAILED") for _, b, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
