"""Run a real job for a test: the same `ddpbus coordinator` / `ddpbus worker` commands a
cluster runs, as OS processes, against the test's own nats-server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpbus.codecs import Decoder
from ddpbus.codecs import messages as m
from ddpbus.codecs import subjects as sj
from ddpbus.orchestrator.transport.bus import Publisher, connect

ROOT = Path(__file__).resolve().parents[2]
SPECS = Path(__file__).resolve().parent / "specs"
CLI = [sys.executable, "-m", "ddpbus.orchestrator.tools.cli"]
KEY = b"integration-test-job-key-0123456789"


def wait_for(what: str, cond: Callable[[], bool], timeout: float = 90.0) -> None:
    """Until ``cond()``, polled every 50 ms; fails naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)  # poll interval of a deadline-bound wait


async def until(what: str, cond: Callable[[], bool], within: float = 30.0) -> None:
    """:func:`wait_for` inside an event loop: polled every 10 ms (the state it reads, a
    client's or a publisher's, has no event to wait on) until a deadline ``within`` s away
    (a deadline, not a count of polls: on a loaded machine each poll takes longer)."""
    deadline = time.monotonic() + within
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)  # poll interval of a deadline-bound wait


def freeze(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every one of its threads is stopped. ``kill`` only
    queues the signal: a thread running on another core goes on until the kernel next
    interrupts it, and a Go server (nats-server) served requests meanwhile (an ack a test
    assumed would never come)."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                states.append((task / "stat").read_text().rpartition(")")[2].split()[0])
            except FileNotFoundError:  # a thread that ended meanwhile
                continue
        return bool(states) and all(st in "Tt" for st in states)

    wait_for(f"process {pid} to stop", stopped, timeout)


class PublisherHooks:
    """A connection whose disconnect and reconnect reach the :class:`Publisher` later made
    on it (``hooks.publisher = Publisher(nc.jetstream())``), as the coordinator wires it."""

    def __init__(self) -> None:
        self.publisher: Publisher | None = None

    async def _lost(self) -> None:
        if self.publisher is not None:
            self.publisher.disconnected()

    async def _back(self) -> None:
        if self.publisher is not None:
            self.publisher.reconnected()

    async def connect(self, url: str, name: str) -> Any:
        return await connect(url, name=name, on_disconnect=self._lost,
                             on_reconnect=self._back)


def children(pid: int) -> set[int]:
    """The pids of ``pid``'s children (Linux ``/proc``)."""
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        out |= {int(x) for x in (task / "children").read_text().split()}
    return out


def running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie left to an init that
    does not reap counts as exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def delete_job(url: str, job: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``ddpbus delete-job`` as a user runs it (no ``DDPBUS_*`` from the test's env)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPBUS_")}
    return subprocess.run([*CLI, "delete-job", "--job", job, "--nats", url, *args],
                          capture_output=True, text=True, timeout=60, env=env, check=False)


def spec(name: str) -> str:
    return f"{SPECS / name}.py:spec"


@dataclass
class Job:
    name: str
    url: str
    tmp: Path
    workers: int
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    argv: dict[str, list[str]] = field(default_factory=dict)
    environ: dict[str, str] = field(default_factory=dict)

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = (self.tmp / f"{name}.log").open("wb")
        self.argv[name] = argv
        self.procs[name] = subprocess.Popen([*CLI, *argv], stdout=log,
                                            stderr=subprocess.STDOUT, env=self.environ,
                                            cwd=ROOT)
        log.close()
        return self.procs[name]

    def respawn(self, name: str, as_name: str) -> subprocess.Popen[bytes]:
        """The same command again (a restarted process), logging to ``as_name``."""
        return self.spawn(as_name, self.argv[name])

    @property
    def out(self) -> Path:
        return self.tmp / "out"

    def log(self, proc: str) -> str:
        path = self.tmp / f"{proc}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait(self, timeout: float = 180.0) -> dict[str, Any]:
        """Every process exits; returns the coordinator's summary. Fails with the logs."""
        deadline = time.monotonic() + timeout
        for name, p in self.procs.items():
            try:
                p.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"{name} still running after {timeout}s\n"
                                     + self.dump()) from None
        codes = {n: p.returncode for n, p in self.procs.items()}
        summary_file = self.tmp / "summary.json"
        if any(codes.values()) or not summary_file.exists():
            raise AssertionError(f"exit codes {codes}\n" + self.dump())
        return dict(json.loads(summary_file.read_text()))

    def wait_summary(self) -> dict[str, Any]:
        return dict(json.loads((self.tmp / "summary.json").read_text()))

    def dump(self) -> str:
        return "\n".join(f"----- {n}\n{self.log(n)[-6000:]}" for n in self.procs)

    def kill(self) -> None:
        """Ends every process still running, each first printing its threads' stacks to its
        log (the CLI's SIGUSR1 handler), so a hang shows where it hangs."""
        alive = [p for p in self.procs.values() if p.poll() is None]
        for p in alive:
            p.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 3.0  # faulthandler writes at once, from any state
        while alive and time.monotonic() < deadline and not all(
                "most recent call first" in self.log(n) for n, p in self.procs.items()
                if p in alive):
            time.sleep(0.05)  # poll interval of a deadline-bound wait
        for p in alive:
            if p.poll() is None:
                p.kill()
                p.wait(10)

    def events(self) -> list[dict[str, Any]]:
        path = self.tmp / "events.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() \
            else []


def start_job(url: str, tmp: Path, spec_ref: str, *, workers: int = 2, job: str = "t",
              coordinator_args: list[str] | None = None,
              worker_args: dict[int, list[str]] | None = None,
              env: dict[str, str] | None = None, final_state: bool = True) -> Job:
    tmp.mkdir(parents=True, exist_ok=True)
    key_file = tmp / "job.key"
    key_file.write_bytes(KEY)
    common = ["--job", job, "--nats", url, "--key-file", str(key_file), "--world-size",
              str(workers)]
    run = Job(job, url, tmp, workers)
    run.environ = {k: v for k, v in os.environ.items() if not k.startswith("DDPBUS_")}
    run.environ |= env or {}
    spawn = run.spawn
    spawn("coordinator", ["coordinator", *common, "--summary", str(tmp / "summary.json"),
                          "--events", str(tmp / "events.jsonl"), *(coordinator_args or []),
                          spec_ref])
    for rank in range(workers):
        extra = list((worker_args or {}).get(rank, []))
        if final_state:
            extra += ["--final-state", str(run.out / f"rank{rank}.final.safetensors")]
        spawn(f"rank-{rank}", ["worker", *common, "--rank", str(rank), "--out", str(run.out),
                               "--torch-threads", "1", *extra, spec_ref])
    return run


def stream_messages(url: str, job: str) -> list[tuple[str, m.Message]]:
    """``(Ddpbus-Type, message)`` of every message the job's stream holds, in stream order
    (each verified with the job key)."""

    async def read() -> list[tuple[str, m.Message]]:
        nc = await connect(url, name="stream-reader")
        js = nc.jetstream()
        decoder = Decoder(job=job, key=KEY)
        info = await js.stream_info(sj.stream_name(job))
        sub = await js.pull_subscribe(f"{sj.PREFIX}.{job}.>", stream=sj.stream_name(job))
        out: list[tuple[str, m.Message]] = []
        left = info.state.messages
        while left > 0:
            for msg in await sub.fetch(min(left, 500), timeout=5):
                env = decoder.decode(msg.subject, msg.headers, msg.data)
                out.append((env.msg_type, env.message))  # type: ignore[arg-type]
                left -= 1
                await msg.ack()  # a pull consumer stops at 1,000 unacknowledged
        await nc.close()
        return out

    return asyncio.run(read())


def stream_types(messages: list[tuple[str, m.Message]]) -> Counter[str]:
    """Ddpbus-Type of each of :func:`stream_messages`; the items of a coalesced Reports
    count as ``TimingMsg.Reports/<item type>``."""
    seen: Counter[str] = Counter()
    for kind, message in messages:
        seen[kind] += 1
        if isinstance(message, m.Reports):
            seen.update(f"{kind}/{type(x).__name__}" for x in message.items)
    return seen


def held_metrics(messages: list[tuple[str, m.Message]], rank: int) -> tuple[int, int]:
    """Check, in stream order, that every MetricsMsg of ``rank`` whose plan ended with its
    window's budget (the window's closing batch, as the worker judges it: its step count
    at the SyncAck that opened the window plus that window's ``step_budget``) comes after
    the SyncAck that closes the window, not with the closing batch
    (orchestrator/core/coalesce.py). A plan that ended short of the budget sends its metrics at
    once, even when the average then came before the rank trained on (it waited, say, at
    an epoch boundary). Returns (such plans, plans in all)."""
    budget: int | None = None  # of the window the latest SetGlobalStep opened
    window_end: int | None = None  # the step at which this rank's current window closes
    own: list[m.Message] = []
    ends: list[int | None] = []  # per own message: its window's closing step
    for _, x in messages:
        if isinstance(x, m.SetGlobalStep):
            budget = x.step_budget[rank] if rank < len(x.step_budget) else None
            if window_end is None and budget is not None:
                window_end = budget  # the first window opens at step 0
            continue
        if getattr(x, "rank", None) != rank:
            continue
        if isinstance(x, m.SyncAck):
            window_end = x.step_count + budget if budget is not None else None
        own.append(x)
        ends.append(window_end)
    end = held = plans = 0
    for i, x in enumerate(own):
        if not isinstance(x, m.MetricsMsg):
            continue
        plans += 1
        end += x.batches_processed  # the plan's last local step (plans go in order)
        last = next((j for j in range(i)
                     if any(b.step_count == end for b in m.batches(own[j]))), None)
        if last is None or ends[last] != end:
            continue  # lost on the way, or not the window's closing batch
        ack = next((j for j in range(last, len(own)) if isinstance(own[j], m.SyncAck)), None)
        if ack is not None and own[ack].step_count == end:  # averaged right at its end
            held += 1
            assert ack < i, (f"rank {rank}: the metrics of the plan ending at step {end} "
                             "went before the SyncAck of its window")
    return held, plans


class LiveTap:
    """Counts the (core NATS, never stored) live.* beacons of a job while it runs."""

    def __init__(self, url: str, job: str) -> None:
        self.url, self.job = url, job
        self.seen: Counter[str] = Counter()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        nc = await connect(self.url, name="live-tap")
        decoder = Decoder(job=self.job, key=KEY)

        async def on(msg: Any) -> None:
            self.seen[decoder.decode(msg.subject, msg.headers, msg.data).msg_type] += 1

        await nc.subscribe(f"{sj.PREFIX}.{self.job}.live.>", cb=on)
        await nc.flush()
        self._ready.set()
        await self._stop.wait()
        await nc.close()

    def __enter__(self) -> LiveTap:
        self._thread.start()
        self._ready.wait(30)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


def chaos_job(url: str, tmp: Path, job: str, *, epochs: int, slowdown: float,
              workers: int = 2, coordinator_args: list[str] | None = None) -> tuple[Job, Path]:
    """The ledgered digits spec (tests/integration/specs/chaos.py) under cadence, every rank
    ``slowdown`` times slower so the run lasts; returns the job and its sample ledger."""
    ledger = tmp / "ledger"
    ledger.mkdir(parents=True, exist_ok=True)
    run = start_job(url, tmp, spec("chaos"), workers=workers, job=job,
                    coordinator_args=["--policy", "cadence", *(coordinator_args or [])],
                    worker_args={r: ["--slowdown", str(slowdown)] for r in range(workers)},
                    env={"LEDGER_DIR": str(ledger), "CHAOS_EPOCHS": str(epochs)})
    return run, ledger


def epochs_trained(ledger: Path, rank: int) -> int:
    """Epochs of which ``rank`` has trained at least one sample, by its ledger."""
    path = ledger / f"rank-{rank}.txt"
    text = path.read_text() if path.exists() else ""
    return len({line.split()[0] for line in text.splitlines() if len(line.split()) == 3})


def kill_and_restart(run: Job, ledger: Path, rank: int, *, after_epochs: int) -> None:
    """SIGKILL ``rank`` once it trained ``after_epochs`` epochs, start it again at once
    (logging to ``rank-<N>b``), and wait for every process: the killed one by the signal,
    every other one cleanly."""
    deadline = time.monotonic() + 120
    while epochs_trained(ledger, rank) < after_epochs:
        assert time.monotonic() < deadline, run.dump()
        time.sleep(0.05)  # poll interval of a deadline-bound wait
    victim = run.procs[f"rank-{rank}"]
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    run.respawn(f"rank-{rank}", f"rank-{rank}b")
    for p in run.procs.values():
        p.wait(180)
        assert p.returncode == (-signal.SIGKILL if p is victim else 0), run.dump()
