"""``DDPBUS_*`` variables arrive as the types their flags have; bad NATS login flags are
refused with a clear message before anything connects."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ddpbus.orchestrator import auth
from ddpbus.orchestrator.cli import build_parser, merge_env


def test_path_variables_become_paths() -> None:
    parser = build_parser()
    args = parser.parse_args(["worker"])
    env = {"DDPBUS_BUNDLE_DIR": "/vol/bundles", "DDPBUS_OUT": "/vol/out",
           "DDPBUS_RANK": "3", "DDPBUS_RESUME": "x"}
    args = merge_env(parser, args, {k: v for k, v in env.items() if k != "DDPBUS_RESUME"})
    assert args.bundle_dir == Path("/vol/bundles")
    assert args.out == Path("/vol/out")
    assert args.rank == 3
    coord = merge_env(parser, parser.parse_args(["coordinator"]), {"DDPBUS_RESUME": "old-job"})
    assert coord.resume == "old-job"


@pytest.mark.parametrize(("flags", "message"), [
    (["--nats-nkey", "MISSING"], "nkey file MISSING does not exist"),
    (["--nats-nkey", "NOTSEED"], "does not hold an nkey seed"),
    (["--nats-nkey", "SEED", "--nats-creds", "SEED"], "not nkey and creds"),
    (["--nats-user", "u"], "needs a password file"),
    (["--nats-password-file", "SEED"], "needs a password file and a password file a user"),
    (["--nats-tls-cert", "SEED"], "needs its key"),
    (["--nats-tls-ca", "NOTSEED"], "TLS files do not load"),
], ids=["missing-nkey", "not-a-seed", "two-ways", "user-alone", "password-alone",
        "cert-alone", "ca-not-a-cert"])
def test_bad_nats_login_flags_are_refused_before_anything_connects(
        tmp_path: Path, flags: list[str], message: str) -> None:
    key = tmp_path / "job.key"
    key.write_bytes(bytes(32))
    (tmp_path / "not-a-seed").write_text("hello\n")
    seed = auth.seed_path(tmp_path, "observer")
    auth.write_credentials(tmp_path, "j", 1)
    files = {"MISSING": str(tmp_path / "missing"), "NOTSEED": str(tmp_path / "not-a-seed"),
             "SEED": str(seed)}
    argv = ["status", "--job", "j", "--key-file", str(key), "--nats", "nats://127.0.0.1:1",
            *(files.get(f, f) for f in flags)]
    out = subprocess.run([sys.executable, "-m", "ddpbus.orchestrator.cli", *argv],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2, out.stderr
    assert message.replace("MISSING", files["MISSING"]) in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(("flag", "text", "message"), [
    ("--compact-every", "-1", "must be a number of seconds >= 0"),
    ("--compact-every", "soon", "is not a number of seconds"),
    ("--keep-history", "inf", "must be a number of seconds >= 0"),
    ("--stream-max-bytes", "0", "or -1 for unlimited"),
])
def test_bad_retention_flags_say_why(capsys: pytest.CaptureFixture[str], flag: str,
                                     text: str, message: str) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["coordinator", flag, text])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_retention_flags_parse() -> None:
    args = build_parser().parse_args(["coordinator", "--compact-every", "0",
                                      "--keep-history", "90", "--stream-max-bytes", "-1"])
    assert (args.compact_every, args.keep_history, args.stream_max_bytes) == (0.0, 90.0, -1)
