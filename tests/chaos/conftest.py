"""Prints how many faults of each kind the chaos suite injected in this session."""

from __future__ import annotations

import pytest
from faults import FAULTS


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if FAULTS:
        runs = ", ".join(f"{what}: {n}" for what, n in sorted(FAULTS.items()))
        terminalreporter.write_line(f"chaos faults injected: {runs}")
