"""Shared by every benchmark: keep a dated copy of each run's result and one history line.

``record(bench, doc, figures, near)`` writes ``<dir>/<bench>-<UTC stamp>.json`` (the run's
whole JSON document with when, commit and figures) and appends one line to
``<dir>/history.jsonl``: ``{"when": ISO UTC, "bench": name, "commit": short hash or null,
"figures": {name: value, ...}}``. ``<dir>`` is ``bench/results``, or the directory of an
explicit ``--json PATH`` (``near``) when that lies elsewhere, so that smoke runs writing to a
temporary directory keep their history there, not in the repository.
"""

from __future__ import annotations

import json
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def commit() -> str | None:
    """The checkout's short commit hash, or None outside a git checkout."""
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE,  # noqa: S607
                              capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def record(bench: str, doc: dict[str, Any], figures: dict[str, Any],
           near: Path | None = None) -> Path:
    """Write the dated result and append the history line; returns the dated file."""
    folder = RESULTS if near is None else Path(near).resolve().parent
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.now(UTC)
    line = {"when": now.isoformat(timespec="seconds").replace("+00:00", "Z"), "bench": bench,
            "commit": commit(), "figures": figures}
    dated = folder / f"{bench}-{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    dated.write_text(json.dumps({**line, "result": doc}, indent=2, default=str) + "\n")
    with (folder / "history.jsonl").open("a") as history:
        history.write(json.dumps(line, default=str) + "\n")
    return dated
