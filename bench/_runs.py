"""Shared by the training benchmarks: run `ddpbus run` and read back what it recorded."""

from __future__ import annotations

import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SPECS = Path(__file__).resolve().parent / "specs"
RESULTS = Path(__file__).resolve().parent / "results"


# the CPU accounts the processes log as they exit (INFO): each rank's (agent.py), the
# coordinator's and the embedded nats-server's (local_run.py)
_RANK_CPU = re.compile(r"rank \d+: cpu ([\d.]+) s over [\d.]+ s: training thread ([\d.]+) s, "
                       r"agent loop ([\d.]+) s, other threads ([\d.]+) s; the training "
                       r"thread waited ([\d.]+) s for the coordinator and averaged for "
                       r"([\d.]+) s")
_COORDINATOR_CPU = re.compile(r"coordinator: cpu ([\d.]+) s over")
_BROKER_CPU = re.compile(r"nats-server: cpu ([\d.]+) s")


def _idle_jiffies() -> tuple[int, int]:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[3] + fields[4], sum(fields)  # (idle + iowait, all)


def quiet(share: float = 0.95, span: float = 0.5, within: float | None = None) -> bool:
    """Until the machine has been idle ``share`` of a ``span`` (up to ``within`` seconds;
    False if it never was): what a run leaves behind (its processes' exit, the kernel
    writing back its stream files) otherwise lands in the next timed run. Measured here:
    two hand-written baseline runs back to back right after a ddpbus run differed by up to
    35 % without this wait, and 4 of 5 rounds stayed within 7 % with it. ``within``
    defaults to ``$BENCH_IDLE_WAIT_S`` or 10 (the test suite's smoke runs, which time
    nothing, set 1)."""
    if within is None:
        within = float(os.environ.get("BENCH_IDLE_WAIT_S", "10"))
    if not Path("/proc/stat").exists():
        return False  # (not Linux: no gate)
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        idle0, all0 = _idle_jiffies()
        time.sleep(span)  # the window the idle share is measured over
        idle1, all1 = _idle_jiffies()
        if all1 > all0 and (idle1 - idle0) / (all1 - all0) >= share:
            return True
    sys.stderr.write(f"bench: the machine was never {share:.0%} idle in {within:.0f} s; "
                     "timing anyway (expect noise)\n")
    return False


def children_cpu_s() -> float:
    """User + system CPU of every child this process has reaped so far (and of theirs)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


@dataclass
class Run:
    summary: dict[str, Any]
    events: list[dict[str, Any]]
    # CPU seconds by where they went: training_threads, agent_loops, worker_other_threads
    # (torch's and gloo's), coordinator, broker, and total (every process of the run, from
    # rusage); rest = total minus the others (the launcher, each process's start-up); and
    # two wall figures summed over the ranks: wall_waiting_for_coordinator, wall_averaging
    cpu: dict[str, float]

    def of(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == event]

    def started(self) -> float:
        return float(self.of("training-started")[0]["t"])


def ddpbus_run(spec: str, *args: str, workers: int = 2, env: dict[str, str] | None = None,
               settle: bool = True) -> Run:
    """One `ddpbus run` in a fresh directory; raises with the logs when it fails.
    ``settle``: first wait for an idle machine (:func:`quiet`; False where the caller
    did, and keeps it busy on purpose)."""
    with tempfile.TemporaryDirectory(prefix="ddpbus-bench-") as tmp:
        out = Path(tmp) / "run"
        target = spec if Path(spec).is_absolute() else SPECS / spec
        cmd = [sys.executable, "-m", "ddpbus.orchestrator.tools.cli", "--log-level", "INFO",
               "run", f"{target}.py:spec", "--workers", str(workers), "--out", str(out),
               "--no-progress", *args]
        environ = {k: v for k, v in os.environ.items() if not k.startswith("DDPBUS_")}
        if settle:
            quiet()
        cpu0 = children_cpu_s()
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp,  # noqa: S603
                              env=environ | (env or {}), check=False)
        total = children_cpu_s() - cpu0
        if done.returncode != 0:
            logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}"
                             for p in sorted((out / "logs").glob("*.log")))
            raise RuntimeError(f"ddpbus run failed ({done.returncode}):\n{done.stderr[-2000:]}"
                               f"\n{logs}")
        summary = json.loads((out / "summary.json").read_text())
        events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
        logs = "\n".join(p.read_text() for p in sorted((out / "logs").glob("*.log")))
    return Run(summary, events, _cpu(logs, done.stderr, total))


def _cpu(logs: str, stderr: str, total: float) -> dict[str, float]:
    ranks = [tuple(map(float, g)) for g in _RANK_CPU.findall(logs)]
    found = {"training_threads": sum(r[1] for r in ranks),
             "agent_loops": sum(r[2] for r in ranks),
             "worker_other_threads": sum(r[3] for r in ranks),
             "coordinator": sum(map(float, _COORDINATOR_CPU.findall(logs))),
             "broker": sum(map(float, _BROKER_CPU.findall(stderr))),
             # wall seconds, summed over the ranks: their training threads' waits
             "wall_waiting_for_coordinator": sum(r[4] for r in ranks),
             "wall_averaging": sum(r[5] for r in ranks)}
    return found | {"total": total, "rest": max(0.0, total - sum(r[0] for r in ranks)
                                                - found["coordinator"] - found["broker"])}


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def write_json(name: str, doc: dict[str, Any], path: Path | None = None) -> Path:
    target = path or RESULTS / f"{name}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(doc, indent=2) + "\n")
    return target
