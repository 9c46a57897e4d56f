"""Regenerate ``codecs/_pb`` from ``codecs/proto`` (checked in; CI fails on a diff).

Usage: ``python codecs/_codegen.py [OUT_DIR]`` (default: ``codecs/_pb`` beside this file).
Needs the dev extras (grpcio-tools' bundled protoc, mypy-protobuf's stub plugin).
"""

from __future__ import annotations

import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO_ROOT = HERE / "proto"
PROTO_FILE = "ddpbus/v1/ddpbus.proto"
GENERATED = ("ddpbus_pb2.py", "ddpbus_pb2.pyi")


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on the schema and write the generated module and stub into ``out_dir``."""
    from grpc_tools import protoc  # dev dependency, imported only here

    plugin = Path(sysconfig.get_path("scripts")) / "protoc-gen-mypy"
    if not plugin.exists():
        found = shutil.which("protoc-gen-mypy")
        if found is None:
            raise SystemExit("protoc-gen-mypy not found: install the dev extras (mypy-protobuf)")
        plugin = Path(found)
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"--plugin=protoc-gen-mypy={plugin}",
            f"--python_out={tmp}",
            f"--mypy_out={tmp}",
            PROTO_FILE,
        ]
        rc = protoc.main(args)
        if rc != 0:
            raise SystemExit(f"protoc failed with exit status {rc}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in GENERATED:
            target = out_dir / name
            shutil.copyfile(Path(tmp) / "ddpbus" / "v1" / name, target)
            written.append(target)
    return written


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "_pb"
    for path in generate(out):
        sys.stdout.write(f"wrote {path}\n")
