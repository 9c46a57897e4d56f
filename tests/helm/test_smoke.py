"""Rendered-manifest smoke run: the chart's coordinator and worker containers, started as
local processes with exactly their rendered command, args and env against a local
nats-server (the Service name mapped to it, the mounted paths to local ones). The job
trains to completion: the chart's wiring matches the CLI."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from chart import by_kind, container, render

from ddpbus.orchestrator.broker import BrokerConfig, EmbeddedBroker

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def local(value: str, mapping: dict[str, str]) -> str:
    for far, near in mapping.items():
        value = value.replace(far, near)
    return value


def process(c: dict[str, Any], ordinal: int, mapping: dict[str, str],
            secrets: dict[tuple[str, str], str]) -> tuple[list[str], dict[str, str]]:
    """The container as a local command line and environment."""
    env: dict[str, str] = {}
    for e in c.get("env", []):
        source = e.get("valueFrom", {})
        if "value" in e:
            env[e["name"]] = local(str(e["value"]), mapping)
        elif source == {"fieldRef": {
                "fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}:
            env[e["name"]] = str(ordinal)  # what Kubernetes puts there
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[e["name"]] = secrets[(ref["name"], ref["key"])]
        else:
            raise AssertionError(f"unmapped env source {e}")
    command = [str(BIN / c["command"][0]), *c["command"][1:]]
    return [*command, *(local(a, mapping) for a in c["args"])], env


AUTH = "authorization {\n  user: trainer\n  password: pa55-word\n}\n"


@pytest.mark.parametrize("nats", ["bundled", "existing-with-url-secret"])
def test_the_rendered_containers_train_a_job(helm: Path, tmp_path: Path, nats: str) -> None:
    sets = ["worker.gpu.enabled=false", "training.backend=gloo", "training.workers=2",
            "training.epochs=3", f"coordinator.metrics.port={free_port()}", "job=smoke"]
    config = None
    if nats != "bundled":  # a server that wants a password, the URL from a Secret
        sets += ["nats.bundled=false", "nats.urlSecret.name=nats-url",
                 "training.wireJson=true"]  # and proto3 JSON on the wire
        config = tmp_path / "auth.conf"
        config.write_text(AUTH)
    with EmbeddedBroker(BrokerConfig(store_dir=tmp_path / "store", config_file=config)) as b:
        url = b.url if config is None else b.url.replace("nats://", "nats://trainer:pa55-word@")
        run_rendered(render(helm, sets), url, tmp_path)


def run_rendered(docs: list[dict[str, Any]], url: str, tmp_path: Path) -> None:
    [coord] = [d for d in by_kind(docs, "Deployment") if "coordinator" in d["metadata"]["name"]]
    [workers] = [d for d in by_kind(docs, "StatefulSet") if "worker" in d["metadata"]["name"]]
    key_dir = tmp_path / "key"
    key_dir.mkdir()
    (key_dir / "job.key").write_bytes(os.urandom(24).hex().encode())  # the Secret's content
    host = url.removeprefix("nats://")
    secrets = {("nats-url", "url"): url}
    base = {"train-ddpbus-nats:4222": host, "/etc/ddpbus/key": str(key_dir),
            "/opt/ddpbus/examples": str(ROOT / "examples")}
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DDPBUS_")}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        def start(name: str, argv: list[str], env: dict[str, str]) -> None:
            with (tmp_path / f"{name}.log").open("wb") as log:
                procs[name] = subprocess.Popen(argv, env=clean | env, stdout=log,
                                               stderr=subprocess.STDOUT)

        start("coordinator", *process(container(coord), 0, base, secrets))
        for ordinal in range(workers["spec"]["replicas"]):
            mapping = base | {"/var/lib/ddpbus": str(tmp_path / f"out-{ordinal}")}
            start(f"worker-{ordinal}", *process(container(workers), ordinal, mapping, secrets))
        codes = {name: p.wait(240) for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    logs = "\n".join(f"--- {n}\n{(tmp_path / f'{n}.log').read_text()[-3000:]}" for n in procs)
    assert codes == dict.fromkeys(procs, 0), logs
    status = subprocess.run([str(BIN / "ddpbus"), "status", "--json"],
                            env=clean | {"DDPBUS_JOB": "smoke", "DDPBUS_NATS_URL": url,
                                         "DDPBUS_KEY_FILE": str(key_dir / "job.key")},
                            capture_output=True, text=True, timeout=60, check=False)
    assert status.returncode == 0, status.stderr
    doc = json.loads(status.stdout)
    assert doc["phase"] == "done"
    assert doc["outcome"]["ok"], doc
    assert doc["epochs"] == 3
    assert [m["state"] for m in doc["members"]] == ["exited", "exited"]
    # the elected checkpoint rank saved the consensus into its --out volume
    assert any((tmp_path / f"out-{r}" / "consensus.safetensors").exists() for r in (0, 1))
    assert "pa55-word" not in logs  # credentials never reach a log
