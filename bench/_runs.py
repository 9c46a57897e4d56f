"""Shared by the training benchmarks: run `ddpbus run` and read back what it recorded."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SPECS = Path(__file__).resolve().parent / "specs"
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Run:
    summary: dict[str, Any]
    events: list[dict[str, Any]]

    def of(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == event]

    def started(self) -> float:
        return float(self.of("training-started")[0]["t"])


def ddpbus_run(spec: str, *args: str, workers: int = 2, env: dict[str, str] | None = None
               ) -> Run:
    """One `ddpbus run` in a fresh directory; raises with the logs when it fails."""
    with tempfile.TemporaryDirectory(prefix="ddpbus-bench-") as tmp:
        out = Path(tmp) / "run"
        target = spec if Path(spec).is_absolute() else SPECS / spec
        cmd = [sys.executable, "-m", "ddpbus.orchestrator.tools.cli", "--log-level", "WARNING",
               "run", f"{target}.py:spec", "--workers", str(workers), "--out", str(out),
               "--no-progress", *args]
        environ = {k: v for k, v in os.environ.items() if not k.startswith("DDPBUS_")}
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp,  # noqa: S603
                              env=environ | (env or {}), check=False)
        if done.returncode != 0:
            logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}"
                             for p in sorted((out / "logs").glob("*.log")))
            raise RuntimeError(f"ddpbus run failed ({done.returncode}):\n{done.stderr[-2000:]}"
                               f"\n{logs}")
        summary = json.loads((out / "summary.json").read_text())
        events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    return Run(summary, events)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def write_json(name: str, doc: dict[str, Any], path: Path | None = None) -> Path:
    target = path or RESULTS / f"{name}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(doc, indent=2) + "\n")
    return target
