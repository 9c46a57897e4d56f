"""`ddpbus run` as a user runs it: the demo, the summary, --slowdown, Ctrl-C, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from jobs import children, running, wait_for

from ddpbus.orchestrator.tools import cli

ROOT = Path(__file__).resolve().parents[2]
RUN = [sys.executable, "-m", "ddpbus.orchestrator.tools.cli", "run"]
DIGITS = str(ROOT / "examples" / "digits.py") + ":spec"

pytestmark = pytest.mark.timeout(240)


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("DDPBUS_")}


def _run(args: list[str], tmp: Path, timeout: float = 200) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*RUN, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=tmp, env=_env(), check=False)


def _endless_run(tmp: Path, out_dir: Path, **streams: Any) -> subprocess.Popen[str]:
    """A digits run of 5,000 epochs (stopped by the test), once it has averaged."""
    proc = subprocess.Popen([*RUN, DIGITS, "--workers", "2", "--epochs", "5000", "--out",
                             str(out_dir), "--no-progress"], cwd=tmp, env=_env(), text=True,
                            **streams)
    events = out_dir / "events.jsonl"
    try:
        wait_for("the run's first average", lambda: events.exists()
                 and '"average"' in events.read_text(), 120)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc


def test_demo_trains_digits_to_95_percent_and_writes_the_summary(tmp_path: Path) -> None:
    """Test accuracy over seeds 0-19 (tests/accuracy_spread.py --only run-demo,
    bench/results/accuracy-spread-20261207T125805Z.json): 0.9666 / 0.9777 / 0.9805 (min /
    median / max); the bound, 0.95, is six test digits below the worst."""
    summary_file = tmp_path / "summary.json"
    out = _run([DIGITS, "--workers", "2", "--summary", str(summary_file)], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(summary_file.read_text())
    assert summary["test_accuracy"] >= 0.95
    assert summary["epochs"] == 20
    assert summary["rounds"] > 0
    assert summary["wall_s"] > 0
    assert set(summary["batch_share"]) == {"0", "1"}
    assert abs(sum(summary["batch_share"].values()) - 1.0) < 1e-9
    for needle in ("eval metric (epoch 19)", "averaging rounds", "rank 1 batch share"):
        assert needle in out.stdout
    run_dir = Path(summary["out_dir"])
    if not run_dir.is_absolute():
        run_dir = tmp_path / run_dir
    assert (run_dir / "consensus.safetensors").exists()
    assert (run_dir / "report" / "index.html").exists()  # the run report, every run
    assert (tmp_path / summary["report"]).resolve() == (run_dir / "report" / "index.html").resolve()
    assert "run report" in out.stdout
    # every average is split (bench/control_latency.py reads these): decision -> SyncNow
    # held by the last rank includes its write-ahead record; the collective call is part
    # of the average
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    averaged = [e for e in events if e["event"] == "averaged" and not e.get("failed")]
    assert averaged
    for e in averaged:
        assert 0 < e["write_ahead_ms"] <= e["deliver_ms"] <= e["publish_to_acks_ms"] + \
            e["write_ahead_ms"], e
        assert 0 < e["collective_ms"] <= e["average_ms"], e
    assert not (run_dir / ".job.key").exists()  # the job key does not outlive the run
    assert not (run_dir / ".credentials").exists()  # nor do the NATS logins
    # every process logged in as its own identity and the server refused nothing it did
    logs = {p.name: p.read_text(errors="replace") for p in (run_dir / "logs").glob("*.log")}
    assert {"coordinator.log", "rank-0.log", "rank-1.log"} <= set(logs), sorted(logs)
    for name, text in logs.items():
        assert "refused by the NATS server" not in text, (name, text[-2000:])
        assert "Permissions Violation" not in text, (name, text[-2000:])


def test_slowdown_flag_shifts_batches_to_the_fast_rank(tmp_path: Path) -> None:
    summary_file = tmp_path / "s.json"
    out = _run([DIGITS, "--workers", "2", "--epochs", "4", "--slowdown", "1=3",
                "--summary", str(summary_file), "--no-progress"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    share = json.loads(summary_file.read_text())["batch_share"]
    assert share["0"] > 0.6 > share["1"]


def test_ctrl_c_stops_every_process_and_ranks_save(tmp_path: Path) -> None:
    out_dir = tmp_path / "run"
    events = out_dir / "events.jsonl"
    proc = _endless_run(tmp_path, out_dir, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 130, err[-3000:]
    for rank in (0, 1):
        assert (out_dir / f"rank{rank}.safetensors").exists()
        assert (out_dir / f"rank{rank}.optim.safetensors").exists()
    lines = [json.loads(x) for x in events.read_text().splitlines()]
    assert any(e["event"] == "run-aborted" and e["reason"] == "GRACEFUL_SHUTDOWN"
               for e in lines)
    for e in lines:
        if e["event"] == "rank-admitted":
            with pytest.raises(ProcessLookupError):
                os.kill(e["pid"], 0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_launcher_takes_every_process_along(tmp_path: Path) -> None:
    """SIGKILL (or the OOM killer) runs no cleanup: the coordinator and the workers (each
    in a session of its own) and the broker must still not outlive the launcher."""
    proc = _endless_run(tmp_path, tmp_path / "run", stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL)
    try:
        spawned = children(proc.pid)
        assert len(spawned) == 4  # nats-server, the coordinator, two workers
        proc.kill()
        proc.wait(timeout=20)
        wait_for("every process of the killed run to exit",
                 lambda: not any(running(p) for p in spawned), 30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.mark.parametrize(("args", "message"), [
    (["--knob", "anchr=3"], "unknown knob 'anchr' (did you mean 'anchor'?)"),
    (["--knob", "gamma=lots"], "knob gamma='lots'"),
    (["--knob", "overhead_target=0.9"], "overhead_target must be in [0.01, 0.5]"),
    (["--slowdown", "5=2"], "--slowdown '5=2'"),
    (["--policy", "fastest"], "invalid choice"),
    (["--workers", "0"], "must be >= 1"),
    (["--resume", "nowhere"], "--resume nowhere: no such directory"),
    (["--resume", "."], "holds no bundle"),
])
def test_bad_flags_are_refused_before_anything_starts(tmp_path: Path, args: list[str],
                                                      message: str,
                                                      capfd: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # the CLI's own main() in this process: each refusal is the same code path as in a
    # `ddpbus run` process (test_a_missing_spec_is_refused runs one), without a Python and
    # torch start per case (~2 s each)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        cli.main(["run", DIGITS, "--out", str(tmp_path / "never"), *args], environ=_env())
    assert stopped.value.code == 2
    assert message in capfd.readouterr().err
    assert not (tmp_path / "never").exists()


def test_a_run_resumed_from_an_earlier_run_directory_continues_it(tmp_path: Path) -> None:
    """Accuracy of the resumed run (3 epochs, then to 6) over seeds 0-19 (run-resumed,
    bench/results/accuracy-spread-20261207T125805Z.json): 0.9164 / 0.9359 / 0.9499; the
    bound, 0.90, is six test digits below the worst."""
    first, second = tmp_path / "first", tmp_path / "second"
    out = _run([DIGITS, "--workers", "2", "--epochs", "3", "--out", str(first),
                "--no-progress"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((first / "bundles" / "latest.json").read_text())["version"] == 3
    # a bundle at epoch 3 cannot continue a 3-epoch run: refused before anything starts
    out = _run([DIGITS, "--epochs", "3", "--resume", str(first), "--out", str(second)],
               tmp_path, timeout=60)
    assert out.returncode == 2
    assert "raise --epochs" in out.stderr
    assert not second.exists()
    out = _run([DIGITS, "--workers", "2", "--epochs", "6", "--resume", str(first),
                "--out", str(second), "--no-progress"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((second / "summary.json").read_text())
    assert summary["resumed_from"]["epoch"] == 3
    assert summary["coverage"]["exact"]
    assert summary["coverage"]["resumed_epochs"] == 3
    assert summary["epochs"] == 3  # trained here: epochs 3, 4, 5
    assert summary["test_accuracy"] >= 0.9
    assert [e["epoch"] for e in summary["eval"]][-3:] == [3, 4, 5]
    # a new run into the same --out starts from fresh weights, not the model left there,
    # and its bundles take the directory over from the earlier job's
    earlier = json.loads((second / "bundles" / "latest.json").read_text())
    assert earlier["version"] == 6
    out = _run([DIGITS, "--workers", "2", "--epochs", "1", "--out", str(second),
                "--no-progress"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    for rank in (0, 1):
        log = (second / "logs" / f"rank-{rank}.log").read_text(errors="replace")
        assert f"ignoring {second / 'consensus.safetensors'}" in log, log[-2000:]
    latest = json.loads((second / "bundles" / "latest.json").read_text())
    assert latest["version"] == 1
    assert latest["job"] != earlier["job"]


def test_a_missing_spec_is_refused(tmp_path: Path) -> None:
    out = _run([str(tmp_path / "nope.py:spec")], tmp_path, timeout=60)
    assert out.returncode == 2
    assert "does not exist" in out.stderr
