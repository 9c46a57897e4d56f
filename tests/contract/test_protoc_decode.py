"""The README's `protoc --decode` recipe reads real payloads: each family's message type, with
the shipped .proto, decodes what the encoder puts on the wire (issue 37)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ddpbus.codecs import Encoder
from ddpbus.codecs import messages as m
from ddpbus.codecs import subjects as sj

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
PROTO = ["--proto_path=codecs/proto", "codecs/proto/ddpbus/v1/ddpbus.proto"]


@pytest.mark.parametrize(("spec", "sender", "message", "shown"), [
    (sj.CONTROL_RANK, "coordinator", m.Shutdown(), "shutdown {"),
    (sj.TIMING_RANK, "rank-0", m.Batch(rank=0, step_count=3, batch_ms=12.5, data_ms=1.0),
     "step_count: 3"),
    (sj.LIVE_RANK, "rank-0", m.Heartbeat(rank=0, step_count=7), "step_count: 7"),
], ids=["control", "timing", "live"])
def test_protoc_decodes_a_payload_by_its_subjects_message_type(
        spec: sj.SubjectSpec, sender: str, message: object, shown: str) -> None:
    out = Encoder(job="j", key=b"k" * 32, sender=sender, generation=1).encode(
        spec.subject("j", 0), message)  # type: ignore[arg-type]
    wire = spec.message.split(".")[0]  # "TimingMsg.Heartbeat": the TimingMsg family
    assert f"`{wire}`" in README or f"`ddpbus.v1.{wire}`" in README, wire
    # protoc itself (grpcio-tools ships it as grpc_tools.protoc), run as the README says
    decoded = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "--decode",
                              f"ddpbus.v1.{wire}", *PROTO], input=out.payload, cwd=ROOT,
                             capture_output=True, check=True)
    assert shown in decoded.stdout.decode(), decoded.stdout
    assert "protoc --decode ddpbus.v1.TimingMsg --proto_path=codecs/proto" in " ".join(
        README.split())
