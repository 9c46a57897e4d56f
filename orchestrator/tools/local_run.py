"""``ddpbus run``: the whole job on this machine (embedded broker, coordinator, N workers).

Every process is a real OS process started with the same commands a cluster would run
(``ddpbus coordinator`` and ``ddpbus worker``), each in its own session so a terminal's
Ctrl-C reaches only this launcher, which then stops them in order: the coordinator first
(it tells every rank to save and exit), then whatever is left, with bounded waits. A
launcher killed outright takes them along (:mod:`ddpbus.orchestrator.runtime.children`). Logs go
to ``<out>/logs``; the decision log to ``<out>/events.jsonl``; the summary to
``<out>/summary.json`` (and ``--summary``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from rich.console import Console

from ddpbus.codecs import subjects as sj
from ddpbus.codecs.errors import ConfigError, DdpbusError
from ddpbus.orchestrator.core.config import Schedule
from ddpbus.orchestrator.persist import bundles
from ddpbus.orchestrator.runtime.children import tied_to_parent
from ddpbus.orchestrator.runtime.nats_server import BrokerConfig, EmbeddedBroker
from ddpbus.orchestrator.tools.flags import load_schedule, schedule_overrides
from ddpbus.orchestrator.tools.progress import RunMonitor, final_table
from ddpbus.orchestrator.transport import auth

log = logging.getLogger(__name__)

STOP_GRACE_S = 30.0
KILL_GRACE_S = 10.0


def parse_slowdowns(items: list[str], workers: int) -> dict[int, float]:
    out: dict[int, float] = {}
    for item in items:
        rank_text, sep, factor_text = item.partition("=")
        try:
            rank, factor = int(rank_text), float(factor_text)
        except ValueError:
            rank, factor = -1, 0.0
        if not sep or not 0 <= rank < workers or not factor >= 1.0:
            raise ConfigError(f"--slowdown {item!r}: expected RANK=FACTOR with 0 <= RANK < "
                              f"{workers} and FACTOR >= 1")
        out[rank] = factor
    return out


def _resume_dir(source: str | None, schedule: Schedule) -> str | None:
    """``ddpbus run --resume DIR``: the embedded broker is new each run, so the bundle
    comes from a directory; checked against the run before anything starts."""
    if source is None:
        return None
    path = Path(source)
    if not path.is_dir():
        raise ConfigError(f"--resume {source}: no such directory")
    try:
        manifest = bundles.read_directory(path)
        bundles.check_fits(manifest, seed=schedule.seed, batch_size=schedule.batch_size,
                           epochs=schedule.epochs)
    except bundles.BundleError as exc:
        raise ConfigError(str(exc)) from None
    return str(path.resolve())


@dataclass
class LocalRun:
    spec_ref: str
    workers: int
    overrides: dict[str, Any]
    slowdowns: dict[int, float]
    out_dir: Path
    job: str
    summary_path: Path | None = None
    torch_threads: int = 1
    device: str = "auto"  # each worker's (--device)
    progress: bool = True
    wire_json: bool = False
    resume: str | None = None  # a directory holding the bundle to continue from
    authenticate: bool = True  # per-identity nkeys and permissions (``--no-auth``: open)
    report_path: Path | None = None  # the run report, once written
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _logs: list[IO[bytes]] = field(default_factory=list)
    _stop: bool = False
    _credentials: auth.Credentials | None = None
    _system_seed: Path | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LocalRun:
        workers = args.workers if args.workers is not None else 2
        if workers < 1:
            raise ConfigError("--workers must be >= 1")
        _, schedule = load_schedule(args)  # every setting checked before anything starts
        job = args.job or f"run-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
        threads = args.torch_threads or max(1, (os.cpu_count() or 1) // workers)
        return cls(spec_ref=args.spec, workers=workers, overrides=schedule_overrides(args),
                   slowdowns=parse_slowdowns(list(args.slowdown or []), workers),
                   out_dir=args.out or Path("ddpbus-runs") / job, job=job,
                   summary_path=args.summary, torch_threads=threads, device=args.device,
                   progress=not args.no_progress and sys.stderr.isatty(),
                   wire_json=args.wire_json, resume=_resume_dir(args.resume, schedule),
                   authenticate=not args.no_auth)

    # --------------------------------------------------------------- processes

    def _flags(self) -> list[str]:
        flags: list[str] = []
        for name, value in self.overrides.items():
            if name in ("policy", "backend", "epochs", "batch_size"):
                flags += [f"--{name.replace('_', '-')}", str(value)]
            else:
                flags += ["--knob", f"{name}={value}"]
        return flags + (["--wire-json"] if self.wire_json else [])

    def _spawn(self, name: str, argv: list[str]) -> None:
        logs = self.out_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        out = (logs / f"{name}.log").open("wb")
        self._logs.append(out)
        cmd = [sys.executable, "-m", "ddpbus.orchestrator.tools.cli", *argv]
        env = {k: v for k, v in os.environ.items() if not k.startswith("DDPBUS_")}
        # SIGKILL if the launcher dies uncleaned, as its own cleanup would
        self.procs[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,  # noqa: S603
                                            env=env, start_new_session=True,
                                            preexec_fn=tied_to_parent(signal.SIGKILL))  # noqa: PLW1509 (children.py)

    def _login(self, identity: str) -> list[str]:
        creds = self._credentials
        return [] if creds is None else ["--nats-nkey", str(creds.seed(identity))]

    def _access(self, url: str) -> auth.Access:
        """The launcher's own connection (progress, report): the read-only observer."""
        creds = self._credentials
        login = None if creds is None else auth.NatsAuth(nkey=creds.seed(auth.OBSERVER))
        return auth.Access(url=url, auth=login, identity=auth.OBSERVER)

    def _start(self, url: str, key_file: Path) -> None:
        common = ["--job", self.job, "--nats", url, "--key-file", str(key_file),
                  "--world-size", str(self.workers)]
        self._spawn("coordinator", ["coordinator", *common, *self._login(auth.COORDINATOR),
                                    "--nats-system-nkey", str(self._system_seed),
                                    *self._flags(),
                                    "--summary", str(self.out_dir / "summary.json"),
                                    "--events", str(self.out_dir / "events.jsonl"),
                                    *(["--resume", self.resume] if self.resume else []),
                                    self.spec_ref])
        for rank in range(self.workers):
            argv = ["worker", *common, *self._login(sj.rank_consumer(rank)),
                    "--rank", str(rank), "--out", str(self.out_dir),
                    "--bundle-dir", str(self.out_dir / "bundles"),
                    "--torch-threads", str(self.torch_threads), "--device", self.device]
            if rank in self.slowdowns:
                argv += ["--slowdown", str(self.slowdowns[rank])]
            if self.wire_json:
                argv.append("--wire-json")
            self._spawn(f"rank-{rank}", [*argv, self.spec_ref])

    def _signal(self, name: str, sig: signal.Signals) -> None:
        proc = self.procs.get(name)
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)

    async def _wait(self, names: list[str], within: float) -> bool:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if all(self.procs[n].poll() is not None for n in names):
                return True
            await asyncio.sleep(0.05)
        return False

    async def _shutdown(self) -> None:
        """Coordinator first (it drains the ranks), then stragglers, with bounded waits."""
        self._signal("coordinator", signal.SIGTERM)
        await self._wait(["coordinator"], STOP_GRACE_S)
        ranks = [n for n in self.procs if n != "coordinator"]
        if not await self._wait(ranks, STOP_GRACE_S):
            for n in ranks:
                self._signal(n, signal.SIGTERM)
            if not await self._wait(ranks, KILL_GRACE_S):
                for n in self.procs:
                    self._signal(n, signal.SIGKILL)
                await self._wait(list(self.procs), KILL_GRACE_S)

    # -------------------------------------------------------------------- main

    def run(self) -> int:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        key_file = self.out_dir / ".job.key"
        key = secrets.token_hex(32).encode()
        key_file.touch(mode=0o600)
        key_file.write_bytes(key)
        creds_dir = self.out_dir / ".credentials"
        if self.authenticate:  # the broker admits exactly this job's identities
            self._credentials = auth.write_credentials(creds_dir, self.job, self.workers)
        # the coordinator's system-account login: a killed worker is dead at once
        self._system_seed = creds_dir / "system.nk"
        creds_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        broker = EmbeddedBroker(BrokerConfig(
            port=0, auth_file=self._credentials.config if self._credentials else None,
            system_seed=self._system_seed))
        console = Console(stderr=True)
        try:
            broker.start()
            return asyncio.run(self._main(broker.url, key, key_file, console))
        finally:
            for n in self.procs:
                self._signal(n, signal.SIGKILL)
            for f in self._logs:
                f.close()
            if (cpu := broker.cpu_seconds()) is not None:  # read by bench/overhead.py
                log.info("nats-server: cpu %.3f s", cpu)
            broker.stop()
            key_file.unlink(missing_ok=True)
            shutil.rmtree(creds_dir, ignore_errors=True)  # useless once the broker is gone

    async def _main(self, url: str, key: bytes, key_file: Path, console: Console) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._request_stop)
        # the coordinator makes the job's stream, bucket and consumers; workers wait for them
        nc = await self._access(url).connect(self.job, name=f"ddpbus-run-{self.job}")
        try:
            monitor = RunMonitor(self.job, key, self.workers)
            # the monitor decodes every message: only pay for it when someone watches
            sub = await monitor.attach(nc) if self.progress else None
            started = time.monotonic()
            self._start(url, key_file)
            failed = await self._supervise(monitor, console)
            if sub is not None:
                await sub.unsubscribe()
        finally:
            await nc.close()
        wall = time.monotonic() - started
        await self._write_report(url, key, console)
        return self._report(console, wall, failed)

    async def _write_report(self, url: str, key: bytes, console: Console) -> None:
        """The run's HTML report with plots, from its stream (the broker is still up)."""
        from ddpbus.orchestrator.runtime import html_report

        try:
            with console.status("writing the run report"):
                index = await html_report.build(self._access(url), self.job, key,
                                           self.out_dir / "report")
        except (DdpbusError, OSError, ValueError) as exc:
            console.print(f"[yellow]no run report[/yellow]: {exc}")
            return
        self.report_path = index

    def _request_stop(self) -> None:
        self._stop = True

    async def _supervise(self, monitor: RunMonitor, console: Console) -> str | None:
        """Wait for the coordinator; on Ctrl-C or a crashed process, stop everything."""
        live = None
        if self.progress:
            live, progress, task = monitor.live(console)
            live.start()
        failed: str | None = None
        try:
            while self.procs["coordinator"].poll() is None:
                if live is not None:
                    live.update(monitor.renderable(progress, task))
                crashed = [n for n, p in self.procs.items() if p.poll() not in (None, 0)]
                if self._stop or crashed:
                    failed = "stopped by Ctrl-C" if self._stop else f"{crashed[0]} exited " \
                        f"with status {self.procs[crashed[0]].returncode}"
                    break
                await asyncio.sleep(0.25)
            await self._shutdown()
        finally:
            if live is not None:
                live.update(monitor.renderable(progress, task))
                live.stop()
        return failed

    def _report(self, console: Console, wall: float, failed: str | None) -> int:
        out = Console()
        summary_file = self.out_dir / "summary.json"
        try:
            summary = json.loads(summary_file.read_text())
        except (OSError, json.JSONDecodeError):
            summary = {"ok": False, "reason": failed or "the coordinator wrote no summary"}
        if failed and summary.get("ok"):
            summary["ok"], summary["reason"] = False, failed
        summary["launcher_wall_s"] = wall
        summary["out_dir"] = str(self.out_dir)
        summary["job"] = self.job
        summary["report"] = str(self.report_path) if self.report_path else None
        if self.summary_path is not None:
            self.summary_path.parent.mkdir(parents=True, exist_ok=True)
            self.summary_path.write_text(json.dumps(summary, indent=2) + "\n")
        out.print(final_table(summary))
        codes = {n: p.returncode for n, p in self.procs.items()}
        if not summary.get("ok") or any(codes.values()):
            console.print(f"[red]run failed[/red]: {summary.get('reason')}; exit codes "
                          f"{codes}; logs in {self.out_dir / 'logs'}")
            for name, code in codes.items():
                if code:
                    console.print(f"--- {name} (exit {code}), last lines:")
                    console.print(_tail(self.out_dir / "logs" / f"{name}.log"), markup=False)
            return 130 if self._stop else 1
        return 0


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"

