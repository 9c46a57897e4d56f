"""The environment the kubelet gives a pod: the service-link variables of every Service in
its namespace (kubernetes/pkg/kubelet/envvars: FromServices), unless the pod sets
``enableServiceLinks: false``."""

from __future__ import annotations

from typing import Any


def service_links(name: str, cluster_ip: str, ports: list[dict[str, Any]]) -> dict[str, str]:
    """The variables one Service named ``name`` (with these ``ports``: name, port,
    protocol) puts in every pod of its namespace."""
    prefix = name.upper().replace("-", "_")
    env: dict[str, str] = {}
    if not ports:
        return env
    first = ports[0]
    env[f"{prefix}_SERVICE_HOST"] = cluster_ip
    env[f"{prefix}_SERVICE_PORT"] = str(first["port"])
    for p in ports:
        if p.get("name"):
            env[f"{prefix}_SERVICE_PORT_{p['name'].upper().replace('-', '_')}"] = str(p["port"])
    proto = first.get("protocol", "TCP")
    env[f"{prefix}_PORT"] = f"{proto.lower()}://{cluster_ip}:{first['port']}"
    for p in ports:
        proto = p.get("protocol", "TCP")
        base = f"{prefix}_PORT_{p['port']}_{proto.upper()}"
        env[base] = f"{proto.lower()}://{cluster_ip}:{p['port']}"
        env[f"{base}_PROTO"] = proto.lower()
        env[f"{base}_PORT"] = str(p["port"])
        env[f"{base}_ADDR"] = cluster_ip
    return env


def namespace_links(services: list[dict[str, Any]]) -> dict[str, str]:
    """Every rendered Service's variables (kind Service manifests; headless ones too: the
    kubelet skips only those without a cluster IP, which a rendered manifest cannot say,
    so they are all counted, the stricter case)."""
    env: dict[str, str] = {}
    for i, svc in enumerate(services):
        env |= service_links(svc["metadata"]["name"], f"10.96.0.{10 + i}",
                             svc["spec"].get("ports", []))
    return env
