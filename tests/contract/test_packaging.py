"""The built wheel holds every subpackage of the three folders, and nothing else."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

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


def test_wheel_contains_every_subpackage(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "--disable-pip-version-check", str(ROOT),
                    "-w", str(tmp_path)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("ddpbus-*.whl")
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
