"""The suite's own knobs stay out of the CLI's ``DDPBUS_*`` namespace.

The CLI refuses any ``DDPBUS_*`` variable it does not know (a typo must not be ignored), so a
test knob named ``DDPBUS_…`` that CI exports breaks every ``ddpbus`` process the suite starts:
CI once failed 16 tests that way (``DDPBUS_REQUIRE_CHROMIUM``). Test and benchmark knobs are
named ``DDPTEST_*``; this test fails on any ``DDPBUS_*`` name that the suite, the benchmarks,
the Makefile or CI read or export and that the CLI does not accept.
"""

from __future__ import annotations

import re
from pathlib import Path

from ddpbus.orchestrator.tools import cli

ROOT = Path(__file__).resolve().parents[2]
# a name read from the environment, or assigned in a shell line / Makefile recipe
READ = re.compile(r"""(?:environ(?:\.get)?\s*[\[(]\s*|getenv\(\s*)["'](DDPBUS_[A-Z0-9_]+)["']""")
EXPORTED = re.compile(r"(?:^|[\s;])(?:export\s+)?(DDPBUS_[A-Z0-9_]+)=", re.MULTILINE)


def _sources() -> list[Path]:
    files = [*ROOT.glob("tests/**/*.py"), *ROOT.glob("bench/**/*.py"), ROOT / "Makefile",
             ROOT / ".ci" / "run"]
    return [f for f in files if f.is_file() and f != Path(__file__).resolve()]


def test_every_ddpbus_variable_the_suite_reads_or_sets_is_one_the_cli_accepts() -> None:
    known = cli.GLOBAL_ENV | {v for table in cli.ENV_VARS.values() for v in table.values()}
    found = {(m, f.relative_to(ROOT).as_posix()) for f in _sources()
             for pattern in (READ, EXPORTED) for m in pattern.findall(f.read_text())}
    strays = sorted((name, where) for name, where in found if name not in known)
    assert not strays, f"name suite knobs DDPTEST_*, not DDPBUS_*: {strays}"


def test_the_patterns_see_the_forms_the_suite_uses() -> None:
    sample = ('os.environ.get("DDPBUS_A")\nenviron["DDPBUS_B"]\nexport DDPBUS_C=1\n'
              "\tDDPBUS_D=$(X) python\nos.getenv('DDPBUS_E')\n")
    assert READ.findall(sample) == ["DDPBUS_A", "DDPBUS_B", "DDPBUS_E"]
    assert EXPORTED.findall(sample) == ["DDPBUS_C", "DDPBUS_D"]
