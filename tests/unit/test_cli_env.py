"""``DDPBUS_*`` variables arrive as the types their flags have; bad NATS login flags are
refused with a clear message before anything connects."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest
from kube_env import service_links

from ddpbus.orchestrator.tools.cli import ENV_VARS, GLOBAL_ENV, build_parser, edits, merge_env
from ddpbus.orchestrator.transport import auth


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
    out = subprocess.run([sys.executable, "-m", "ddpbus.orchestrator.tools.cli", *argv],
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


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize(("argv", "env", "dest", "value"), [
    (["coordinator"], {"DDPBUS_LEASE_TTL": "7"}, "lease_ttl", 7.0),
    (["coordinator"], {"DDPBUS_WORLD_SIZE": "4"}, "world_size", 4),
    (["coordinator"], {"DDPBUS_POLICY": "cadence"}, "policy", "cadence"),
    (["simulate"], {"DDPBUS_WORLD_SIZE": "8"}, "ranks", 8),
    (["run", "spec.py:spec"], {"DDPBUS_POLICY": "async"}, "policy", "async"),
    (["run", "spec.py:spec"], {"DDPBUS_BACKEND": "gloo"}, "backend", "gloo"),
    (["run", "spec.py:spec"], {"DDPBUS_WORKERS": "3"}, "workers", 3),
    (["worker"], {"DDPBUS_TORCH_THREADS": "2"}, "torch_threads", 2),
])
def test_variables_arrive_as_their_flags_would(argv: list[str], env: dict[str, str],
                                               dest: str, value: object) -> None:
    parser = build_parser()
    args = merge_env(parser, parser.parse_args(argv), env)
    got = getattr(args, dest)
    assert got == value
    assert type(got) is type(value)
    # the flag gives the same value
    flag = "--" + dest.replace("_", "-")
    assert getattr(parser.parse_args([*argv, flag, *env.values()]), dest) == got


@pytest.mark.parametrize(("argv", "env"), [
    (["coordinator"], {"DDPBUS_LEASE_TTL": "0"}),
    (["coordinator"], {"DDPBUS_LEASE_TTL": "soon"}),
    (["coordinator"], {"DDPBUS_WORLD_SIZE": "0"}),
    (["coordinator"], {"DDPBUS_POLICY": "fastest"}),
    (["simulate"], {"DDPBUS_WORLD_SIZE": "0"}),
    (["simulate"], {"DDPBUS_WORLD_SIZE": "many"}),
    (["run", "spec.py:spec"], {"DDPBUS_POLICY": "fastest"}),
    (["run", "spec.py:spec"], {"DDPBUS_BACKEND": "mpi"}),
    (["worker"], {"DDPBUS_TORCH_THREADS": "0"}),
    (["status"], {"DDPBUS_LOG_LEVEL": "chatty"}),
    (["run", "spec.py:spec"], {"DDPBUS_NO_SUCH": "1"}),
])
def test_bad_or_unknown_variables_are_refused(capsys: pytest.CaptureFixture[str],
                                              argv: list[str], env: dict[str, str]) -> None:
    parser = build_parser()
    with pytest.raises(SystemExit) as exc:
        merge_env(parser, parser.parse_args(argv), env)
    assert exc.value.code == 2
    assert next(iter(env)) in capsys.readouterr().err


def test_every_variable_a_help_names_is_read_by_that_command() -> None:
    for command, sub in _subcommands().items():
        for action in sub._actions:
            for var in re.findall(r"env (DDPBUS_[A-Z_]+)", action.help or ""):
                if action.dest == "log_level":  # every command's, before or after it
                    assert var in GLOBAL_ENV
                    continue
                assert ENV_VARS.get(command, {}).get(action.dest) == var, (command, action.dest)


def test_every_variable_belongs_to_a_flag_of_its_command() -> None:
    subcommands = _subcommands()
    for command, table in ENV_VARS.items():
        dests = {a.dest for a in subcommands[command]._actions}
        assert set(table) <= dests, (command, set(table) - dests)


# the Services a namespace may hold: ddpbus's own under the release names people use, and
# other teams' named after a setting of ours
SERVICES = [(f"{release}-{part}", [{"name": "client", "port": 4222},
                                   {"name": "monitor", "port": 8222}])
            for release in ("ddpbus", "ddpbus-exp1", "t", "ddpbus-ddpbus")
            for part in ("nats", "coordinator", "worker")] + [
    ("ddpbus", [{"name": "http", "port": 80}]),
    ("ddpbus-metrics", [{"name": "metrics", "port": 9090}]),
    ("ddpbus-broker", [{"port": 4222, "protocol": "TCP"}])]


@pytest.mark.parametrize("command", [["coordinator"], ["worker"], ["status"],
                                     ["run", "spec.py:spec"], ["broker"]])
def test_kubernetes_service_links_are_ignored(capsys: pytest.CaptureFixture[str],
                                              command: list[str]) -> None:
    env: dict[str, str] = {}
    for i, (name, ports) in enumerate(SERVICES):
        env |= service_links(name, f"10.96.0.{i + 1}", ports)
    assert "DDPBUS_METRICS_PORT" in env  # a setting's own name, from another team's Service
    assert "DDPBUS_BROKER_PORT" in env
    parser = build_parser()
    args = merge_env(parser, parser.parse_args(command), env | {"DDPBUS_JOB": "j"})
    for dest in ("metrics_port", "port"):  # a link's tcp://IP:PORT is no setting's value
        assert getattr(args, dest, None) is None
    if command[0] in ("coordinator", "worker", "status"):
        assert args.job == "j"  # the settings themselves still arrive
    err = capsys.readouterr().err
    assert "ignoring DDPBUS_BROKER_PORT, DDPBUS_METRICS_PORT: Kubernetes service links" in err


@pytest.mark.parametrize(("typo", "meant"), [
    ("DDPBUS_METRIC_PORT", "DDPBUS_METRICS_PORT"),  # shaped like a link, one edit away
    ("DDPBUS_BROKER_MONITR_PORT", "DDPBUS_BROKER_MONITOR_PORT"),
    ("DDPBUS_JBO", "DDPBUS_JOB"),  # not shaped like one
    ("DDPBUS_WORLDSIZE", "DDPBUS_WORLD_SIZE"),
])
def test_a_typo_of_a_setting_is_refused_with_the_closest_name(
        capsys: pytest.CaptureFixture[str], typo: str, meant: str) -> None:
    parser = build_parser()
    with pytest.raises(SystemExit) as exc:
        merge_env(parser, parser.parse_args(["coordinator"]), {typo: "9464"})
    assert exc.value.code == 2
    assert f"{typo} (did you mean {meant}?)" in capsys.readouterr().err


def test_edit_distance() -> None:
    assert edits("DDPBUS_JOB", "DDPBUS_JOB") == 0
    assert edits("DDPBUS_JBO", "DDPBUS_JOB") == 1  # a swap is one edit
    assert edits("kitten", "sitting") == 3
    assert edits("", "abc") == 3


def test_version_and_the_log_level_anywhere_in_any_case(
        capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--version"])
    assert exc.value.code == 0
    assert re.fullmatch(r"ddpbus \S+ \(wire schema v\d+, Python [\d.]+\)\n",
                        capsys.readouterr().out)
    for argv, level in [(["--log-level", "debug", "status"], "DEBUG"),
                        (["status", "--log-level", "Warning"], "WARNING"),
                        (["--log-level", "error", "status", "--log-level", "info"], "INFO"),
                        (["run", "x.py:spec"], "WARNING"), (["status"], "INFO")]:
        assert merge_env(parser, parser.parse_args(argv), {}).log_level == level, argv
    args = merge_env(parser, parser.parse_args(["status"]), {"DDPBUS_LOG_LEVEL": "error"})
    assert args.log_level == "ERROR"
    with pytest.raises(SystemExit):
        parser.parse_args(["status", "--log-level", "loud"])
    assert "invalid choice: 'LOUD'" in capsys.readouterr().err


def test_every_subcommands_help_ends_with_examples_of_it() -> None:
    for command, sub in _subcommands().items():
        text = sub.format_help()
        assert "\nexamples:\n" in text, command
        examples = text.split("\nexamples:\n", 1)[1].splitlines()
        assert examples, command
        assert all(line.startswith("  ") for line in examples), (command, examples)
        assert any(f"ddpbus {command}" in line for line in examples), (command, examples)
