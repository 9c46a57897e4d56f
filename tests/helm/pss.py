"""The Pod Security Standards' "restricted" profile (kubernetes.io/docs/concepts/security/
pod-security-standards, as enforced by the PodSecurity admission at v1.33+), checked on a
pod spec: every rule of the baseline profile and the restricted one. Returns the
violations, empty when the pod would be admitted to a namespace labelled
``pod-security.kubernetes.io/enforce: restricted``."""

from __future__ import annotations

from typing import Any

RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
                "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
                "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
                "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {None, "", "container_t", "container_init_t", "container_kvm_t",
                 "container_engine_t"}


def violations(pod: dict[str, Any]) -> list[str]:
    psc = pod.get("securityContext") or {}
    containers = [*pod.get("initContainers", []), *pod["containers"],
                  *pod.get("ephemeralContainers", [])]
    out = _pod_level(pod, psc)
    out += [v for c in containers for v in _selinux(c.get("securityContext") or {})]
    for c in containers:
        out += [f"{c['name']}: {v}" for v in _container(c, psc)]
    return out


def _pod_level(pod: dict[str, Any], psc: dict[str, Any]) -> list[str]:
    out = [f"{host} is set" for host in ("hostNetwork", "hostPID", "hostIPC") if pod.get(host)]
    out += [f"sysctl {x['name']}" for x in psc.get("sysctls") or []
            if x["name"] not in SAFE_SYSCTLS]
    out += _selinux(psc)
    for v in pod.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:  # hostPath among them: baseline too
            out.append(f"volume {v['name']} is {sorted(kinds)}")
    if psc.get("runAsUser") == 0:
        out.append("pod runAsUser 0")
    return out


def _selinux(sc: dict[str, Any]) -> list[str]:
    opts = sc.get("seLinuxOptions") or {}
    bad = opts.get("type") not in SELINUX_TYPES or opts.get("user") or opts.get("role")
    return [f"seLinuxOptions {opts}"] if bad else []


def _container(c: dict[str, Any], psc: dict[str, Any]) -> list[str]:
    sc = c.get("securityContext") or {}
    caps = sc.get("capabilities") or {}
    apparmor = (sc.get("appArmorProfile") or {}).get("type")
    seccomp = (sc.get("seccompProfile") or {}).get(
        "type", (psc.get("seccompProfile") or {}).get("type"))
    checks = [  # baseline, then restricted
        (bool(sc.get("privileged")), "privileged"),
        (any(p.get("hostPort") for p in c.get("ports", [])), "hostPort"),
        (sc.get("procMount", "Default") != "Default", f"procMount {sc.get('procMount')}"),
        (apparmor not in (None, "RuntimeDefault", "Localhost"), f"appArmorProfile {apparmor}"),
        (sc.get("allowPrivilegeEscalation") is not False,
         "allowPrivilegeEscalation is not false"),
        ("ALL" not in (caps.get("drop") or []), "capabilities do not drop ALL"),
        (bool(set(caps.get("add") or []) - {"NET_BIND_SERVICE"}),
         f"capabilities add {caps.get('add')}"),
        (sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True,
         "runAsNonRoot is not true"),
        (sc.get("runAsUser") == 0, "runAsUser 0"),
        (seccomp not in ("RuntimeDefault", "Localhost"), f"seccompProfile is {seccomp}"),
    ]
    return [what for failed, what in checks if failed]
