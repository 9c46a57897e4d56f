"""Helpers of the chart tests: run helm, render the chart, pick manifests apart."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[2] / "helm" / "ddpbus"


def run(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120,
                          check=False)


def render(helm: Path, sets: list[str], release: str = "train") -> list[dict[str, Any]]:
    flags = [x for s in sets for x in ("--set", s)]
    out = run(helm, "template", release, str(CHART), "--namespace", "ml", *flags)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def pod_spec(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The pod spec of a Pod, or of the pod template of a workload; None for other kinds."""
    if doc["kind"] == "Pod":
        return dict(doc["spec"])
    if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
        return dict(doc["spec"]["template"]["spec"])
    return None


def pod_specs(docs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(manifest, pod spec) for every manifest that makes pods."""
    return [(d, p) for d in docs if (p := pod_spec(d)) is not None]


def container(doc: dict[str, Any]) -> dict[str, Any]:
    spec = pod_spec(doc)
    assert spec is not None, doc["kind"]
    return dict(spec["containers"][0])


def env(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def worker_jobs(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ranks' Jobs (one each), in rank order."""
    found = [d for d in by_kind(docs, "Job")
             if d["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"]
    return sorted(found, key=lambda d: int(d["metadata"]["labels"]["ddpbus.io/rank"]))


def coordinator_job(docs: list[dict[str, Any]]) -> dict[str, Any]:
    [job] = [d for d in by_kind(docs, "Job")
             if d["metadata"]["labels"]["app.kubernetes.io/component"] == "coordinator"]
    return job


PERMISSIONS = CHART / "files" / "permissions.json"


def permissions_json() -> str:
    """What ``files/permissions.json`` must hold: :func:`auth.chart_permissions` as JSON."""
    from ddpbus.orchestrator.transport.auth import chart_permissions

    return json.dumps(chart_permissions(), indent=1) + "\n"


if __name__ == "__main__":  # regenerate: .venv/bin/python tests/helm/chart.py
    PERMISSIONS.parent.mkdir(exist_ok=True)
    PERMISSIONS.write_text(permissions_json())
