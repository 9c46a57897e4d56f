"""The fuzz campaign's session plumbing: its helper modules importable, its report at the end.

The helpers (``fuzz_corpus``, ``fuzz_mutate``, ``fuzz_states``) sit beside the tests and
beside the atheris harness, which imports them as a script; pyproject's ``pythonpath``
lists the other layers' helper folders, this one puts its own folder first the same way.
At the end of the session the outcomes per family are printed and, with
``DDPTEST_FUZZ_REPORT``, written there as JSON.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fuzz_corpus import BUDGET, TALLY


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    report = TALLY.report()
    if not report:
        return
    terminalreporter.section("fuzz campaign")
    terminalreporter.write_line(f"budget: {BUDGET.payloads} mutated payloads per test "
                                f"({'random' if BUDGET.full else 'derandomized CI run'})")
    for family, row in report.items():
        total = row["total"]
        terminalreporter.write_line(
            f"{family:>16}: {total['payloads']:>9} payloads, {total['accepted']:>8} accepted, "
            f"rejections {total['rejections']}")
    path = os.environ.get("DDPTEST_FUZZ_REPORT")
    if path:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        failed = [r.nodeid for r in terminalreporter.stats.get("failed", [])]
        doc = {"budget": {"payloads_per_test": BUDGET.payloads, "random": BUDGET.full},
               "failed_tests": failed, "families": report}
        out.write_text(json.dumps(doc, indent=2) + "\n")
        terminalreporter.write_line(f"fuzz report: {out}")
