"""The run report checked as a person would: rendered in headless Chromium, every plot
decoded and drawn, the screenshot not blank."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from jobs import chaos_job, kill_and_restart
from PIL import Image

from ddpbus.orchestrator.runtime.nats_server import EmbeddedBroker

pytestmark = pytest.mark.timeout(300)
PLOTS = ("loss", "throughput", "batch_share", "anchor", "divergence")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# .ci/run installs Chromium and sets this: there its absence fails the test, never skips it
REQUIRED = os.environ.get("DDPTEST_REQUIRE_CHROMIUM") == "1"
needs_chromium = pytest.mark.skipif(
    not REQUIRED and not Path(CHROMIUM).exists(),
    reason="no Chromium: install Debian's package 'chromium' (apt-get install chromium) "
           "to render the report in a browser")


def chromium(*args: str, profile: Path) -> subprocess.CompletedProcess[str]:
    """Headless Chromium as this machine runs it (no network, a fresh profile)."""
    assert Path(CHROMIUM).exists(), "Debian's package 'chromium' is needed (.ci/run installs it)"
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                           "--disable-quic", "--no-first-run", "--disable-background-networking",
                           "--disable-component-update", "--disable-sync",
                           f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=120, check=False)


def drawn(path: Path) -> int:
    """How many distinct colours an image has (a blank or failed plot has one or two)."""
    with Image.open(path) as img:
        colours = img.convert("RGB").getcolors(maxcolors=1 << 20)
    return len(colours or [])


@needs_chromium
def test_the_report_of_a_recorded_run_renders_in_chromium(broker: EmbeddedBroker,
                                                         tmp_path: Path) -> None:
    job, ledger = chaos_job(broker.url, tmp_path, "shown", epochs=16, slowdown=6)
    try:
        kill_and_restart(job, ledger, 1, after_epochs=1)  # a death and a rejoin to draw
    finally:
        job.kill()
    out = tmp_path / "report"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPBUS_")}
    made = subprocess.run([sys.executable, "-m", "ddpbus.orchestrator.tools.cli", "report", "--job",
                           "shown", "--nats", broker.url, "--key-file",
                           str(tmp_path / "job.key"), "--out", str(out)],
                          capture_output=True, text=True, timeout=120, env=env, check=False)
    assert made.returncode == 0, made.stderr
    index = out / "index.html"
    assert made.stdout.strip() == str(index)
    for name in PLOTS:
        assert drawn(out / f"{name}.png") > 20, f"{name}.png looks empty"
    dom = chromium("--dump-dom", index.as_uri(), profile=tmp_path / "p1")
    assert dom.returncode == 0, dom.stderr[-2000:]
    loaded = dict(re.findall(r'data-plot="(\w+)"[^>]*data-loaded="(\w+)"', dom.stdout))
    assert loaded == dict.fromkeys(PLOTS, "yes"), dom.stdout[-3000:]
    for needle in ("rank 1 dead", "rank 1 rejoined", "<th>epochs</th><td>16</td>"):
        assert needle in dom.stdout
    shot = tmp_path / "shot.png"
    taken = chromium(f"--screenshot={shot}", "--window-size=1000,2600",
                     "--hide-scrollbars", index.as_uri(), profile=tmp_path / "p2")
    assert taken.returncode == 0, taken.stderr[-2000:]
    with Image.open(shot) as img:
        assert img.size == (1000, 2600)
        strip_heights = [img.crop((0, y, 1000, y + 400)) for y in range(200, 2200, 400)]
        assert all(len(s.convert("RGB").getcolors(1 << 20) or []) > 20
                   for s in strip_heights), "a part of the page is blank"
