"""Every ``ddpbus`` failure is one clear line and a non-zero exit, never a traceback (issue 37).

Each subcommand is run, as a separate process the way a user runs it, against each case that
applies to it:

- a bad setting: exit 2, under the subcommand's own usage;
- a job the broker does not hold (a real nats-server): exit 1, one line naming the job;
- a server nobody listens on: exit 1 within ``--timeout``, one line naming the URL;
- Ctrl-C while it waits for NATS (every command that connects) or, for ``sub``, while it
  listens: exit 130, nothing but a newline and the log lines it had printed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from jobs import CLI

from ddpbus.orchestrator.runtime.nats_server import EmbeddedBroker

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
SPEC = str(ROOT / "examples" / "digits.py") + ":spec"
NOISE = ("Traceback", "KeyboardInterrupt", "Exception ignored", "Task was destroyed",
         "was never awaited")


@pytest.fixture
def key(tmp_path: Path) -> Path:
    path = tmp_path / "job.key"
    path.write_bytes(os.urandom(32))
    return path


@pytest.fixture
def dead_url() -> Iterator[str]:
    """A port that refuses connections: bound, never listened on, for the whole test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"nats://127.0.0.1:{s.getsockname()[1]}"


def ddpbus(*argv: str, env: dict[str, str] | None = None, timeout: float = 60
           ) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith("DDPBUS_") and k != "NATS_URL"}
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=timeout,
                          env={**environ, **(env or {})}, check=False)


def one_line(err: str, prefix: str) -> str:
    """The failure line; the rest of stderr may only be log lines."""
    assert not any(n in err for n in NOISE), err
    lines = [line for line in err.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, err
    return lines[0]


READERS = ["status", "replay", "report", "sub", "delete-job"]


def reader_argv(command: str, url: str, key: Path, tmp: Path) -> list[str]:
    argv = [command, "--job", "nojob", "--nats", url]
    if command != "delete-job":
        argv += ["--key-file", str(key)]
    return argv + {"report": ["--out", str(tmp / "report")], "sub": ["--since", "1"]
                   }.get(command, [])


@pytest.mark.parametrize("command", READERS)
def test_a_job_the_broker_does_not_hold_is_one_line(broker: EmbeddedBroker, key: Path,
                                                     tmp_path: Path, command: str) -> None:
    out = ddpbus(*reader_argv(command, broker.url, key, tmp_path))
    assert out.returncode == 1, out.stderr
    line = one_line(out.stderr, f"ddpbus {command}: ")
    assert "the broker holds no job 'nojob'" in line
    assert not (tmp_path / "report").exists()  # nothing written for a job that is not there


CONNECTING = [*READERS, "init-job", "simulate"]


def connecting_argv(command: str, url: str, key: Path, tmp: Path) -> list[str]:
    if command == "init-job":
        return [command, "--job", "nojob", "--nats", url, "--world-size", "1"]
    if command == "simulate":
        return [command, "--job", "nojob", "--nats", url, "--key-file", str(key),
                "--ranks", "1"]
    if command == "coordinator":
        return [command, SPEC, "--job", "nojob", "--nats", url, "--key-file", str(key),
                "--world-size", "1", "--summary", str(tmp / "summary.json")]
    if command == "worker":
        return [command, SPEC, "--job", "nojob", "--nats", url, "--key-file", str(key),
                "--world-size", "1", "--rank", "0", "--out", str(tmp / "out")]
    return reader_argv(command, url, key, tmp)


@pytest.mark.parametrize("command", CONNECTING)
def test_an_unreachable_server_is_one_line_within_the_timeout(
        dead_url: str, key: Path, tmp_path: Path, command: str) -> None:
    began = time.monotonic()
    out = ddpbus(*connecting_argv(command, dead_url, key, tmp_path), "--timeout", "0.5")
    took = time.monotonic() - began
    assert out.returncode == 1, out.stderr
    line = one_line(out.stderr, f"ddpbus {command}: ")
    assert f"cannot reach NATS at {dead_url} within 0.5 s" in line
    # far below the default: the flag was obeyed (startup itself takes a second or two)
    assert took < 30, took


def test_the_nats_url_comes_from_the_flag_then_ddpbus_nats_url_then_nats_url(
        dead_url: str, key: Path) -> None:
    other = "nats://127.0.0.1:9"  # the discard port: nothing listens
    argv = ["status", "--job", "j", "--key-file", str(key), "--timeout", "0.3"]
    cases = [([*argv, "--nats", dead_url], {"DDPBUS_NATS_URL": other, "NATS_URL": other},
              dead_url),
             (argv, {"DDPBUS_NATS_URL": dead_url, "NATS_URL": other}, dead_url),
             (argv, {"NATS_URL": dead_url}, dead_url),
             (argv, {}, "nats://127.0.0.1:4222")]
    for args, env, used in cases:
        out = ddpbus(*args, env=env)
        assert out.returncode == 1, out.stderr
        assert f"cannot reach NATS at {used} " in one_line(out.stderr, "ddpbus status: "), env


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt(argv: list[str], ready: str) -> subprocess.CompletedProcess[str]:
    """Start ``ddpbus ARGV``, wait for ``ready`` on its stderr, then Ctrl-C it."""
    # Ctrl-C reaches a process only where SIGINT is not ignored, and a suite started in the
    # background (`make test &`, nohup, some CI runners) hands its children SIGINT ignored:
    # Python then installs no KeyboardInterrupt handler. Give the command what a terminal
    # gives it (a flake hunt under nohup saw every one of these tests hang on that).
    proc = subprocess.Popen([*CLI, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=_default_sigint)  # noqa: PLW1509
    assert proc.stderr is not None
    seen: list[str] = []
    try:
        for line in proc.stderr:  # ends at EOF: a process that exited early fails below
            seen.append(line)
            if ready in line:
                break
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    return subprocess.CompletedProcess(argv, proc.returncode, rest, "".join(seen) + err)


@pytest.mark.parametrize("command", [*CONNECTING, "coordinator", "worker"])
def test_ctrl_c_while_waiting_for_nats_exits_130_quietly(dead_url: str, key: Path,
                                                          tmp_path: Path, command: str) -> None:
    argv = connecting_argv(command, dead_url, key, tmp_path)
    if command not in ("coordinator", "worker"):
        argv += ["--timeout", "60"]
    # the bus says, at debug level, that its first attempt failed: it is waiting now
    out = _interrupt(["--log-level", "debug", *argv], "NATS not reached yet")
    assert out.returncode == 130, out.stderr[-3000:]
    assert not any(n in out.stderr for n in NOISE), out.stderr[-3000:]


def test_ctrl_c_on_a_live_sub_exits_130_quietly(broker: EmbeddedBroker, key: Path) -> None:
    # a live `sub` on a job not started yet says so, and listens
    out = _interrupt(["sub", "--job", "later", "--nats", broker.url, "--key-file", str(key)],
                     "listening for its traffic anyway")
    assert out.returncode == 130, out.stderr
    assert not any(n in out.stderr for n in NOISE), out.stderr
    assert out.stderr.strip().splitlines() == [
        "ddpbus sub: the broker holds no job 'later' (no stream DDPBUS_later): check --job, "
        "and --nats for the server; listening for its traffic anyway"]


# a setting each command refuses once its flags are parsed (ConfigError), or while its
# DDPBUS_* variables are merged
BAD = {
    "broker": (["--auth", "AUTH"], "--auth needs --job"),
    "init-job": (["--job", "j"], "init-job needs --world-size"),
    "delete-job": (["--job", "j", "--nats", "nats://x:1"], None),
    "coordinator": (["--job", "j"], "coordinator needs"),
    "worker": (["--job", "j"], "worker needs"),
    "run": (["nope.py:spec"], "does not exist"),
    "sub": (["--job", "j"], "--key-file is required"),
    "status": (["--job", "j"], "--key-file is required"),
    "replay": (["--job", "j"], "--key-file is required"),
    "report": (["--job", "j"], "--key-file is required"),
    "simulate": (["--job", "j"], "--key-file is required"),
}


@pytest.mark.parametrize("command", sorted(BAD))
def test_a_bad_setting_is_refused_under_the_subcommands_usage(tmp_path: Path,
                                                              command: str) -> None:
    argv, message = BAD[command]
    if message is None:  # delete-job's refusal comes from its variables
        out = ddpbus(command, *argv, env={"DDPBUS_TIMEOUT": "soon"})
        message = "DDPBUS_TIMEOUT='soon'"
    else:
        out = ddpbus(command, *(str(tmp_path) if a == "AUTH" else a for a in argv))
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"usage: ddpbus {command} "), out.stderr
    assert message in one_line(out.stderr, f"ddpbus {command}: error: "), out.stderr


def test_an_unknown_variable_is_refused_under_the_subcommands_usage() -> None:
    out = ddpbus("status", env={"DDPBUS_JBO": "j"})
    assert out.returncode == 2
    assert out.stderr.startswith("usage: ddpbus status ")
    assert "DDPBUS_JBO (did you mean DDPBUS_JOB?)" in one_line(out.stderr,
                                                               "ddpbus status: error: ")
