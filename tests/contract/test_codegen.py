"""The checked-in generated code is exactly what codecs/_codegen.py produces now."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "codecs" / "_codegen.py"), str(tmp_path)],
                   check=True, capture_output=True)
    for name in ("ddpbus_pb2.py", "ddpbus_pb2.pyi"):
        fresh = (tmp_path / name).read_text()
        committed = (ROOT / "codecs" / "_pb" / name).read_text()
        assert fresh == committed, f"codecs/_pb/{name} is stale: run `make codegen`"
