"""Rendered-manifest smoke run: the chart's coordinator and worker containers, started as
local processes with exactly their rendered command, args and env against a local
nats-server (the Service name mapped to it, each pod's Secret volumes written out where its
mounts point). The job trains to completion: the chart's wiring matches the CLI.

Two servers: the bundled one, run from the chart's own rendered config (its logins and
permissions, mutual TLS with certificates made here), and an existing one that
`ddpbus broker --auth` would run, its nkey seeds in the per-identity Secrets the chart names.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from chart import by_kind, container, coordinator_job, env, render, worker_jobs
from kube_env import namespace_links

from ddpbus.orchestrator.runtime.nats_server import BrokerConfig, EmbeddedBroker
from ddpbus.orchestrator.transport import auth

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
Secrets = dict[str, dict[str, bytes]]  # name -> key -> content, as the cluster holds them


READS_ADVISORIES = "reading the broker's client advisories"  # the coordinator's log


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def local(value: str, mapping: dict[str, str]) -> str:
    # the longest path first: /etc/ddpbus/nats-system is not /etc/ddpbus/nats + "-system"
    for far, near in sorted(mapping.items(), key=lambda kv: -len(kv[0])):
        value = value.replace(far, near)
    return value


def process(c: dict[str, Any], mapping: dict[str, str],
            secrets: Secrets) -> tuple[list[str], dict[str, str]]:
    """The container as a local command line and environment."""
    env: dict[str, str] = {}
    for e in c.get("env", []):
        source = e.get("valueFrom", {})
        if "value" in e:
            env[e["name"]] = local(str(e["value"]), mapping)
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[e["name"]] = secrets[ref["name"]][ref["key"]].decode()
        else:
            raise AssertionError(f"unmapped env source {e}")
    command = [str(BIN / c["command"][0]), *c["command"][1:]]
    return [*command, *(local(a, mapping) for a in c["args"])], env


def mounts(pod: dict[str, Any], secrets: Secrets, where: Path) -> dict[str, str]:
    """Write the pod's Secret volumes (plain and projected) under ``where`` as the kubelet
    would; the container's mount paths mapped to those folders, and its out dir."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    mapping: dict[str, str] = {}
    for m in pod["containers"][0]["volumeMounts"]:
        v = volumes[m["name"]]
        sources = ([{"name": v["secret"]["secretName"], **v["secret"]}] if "secret" in v
                   else [s["secret"] for s in v.get("projected", {}).get("sources", [])])
        if not sources and m["mountPath"] != "/var/lib/ddpbus":
            continue  # /tmp, /dev/shm: the local ones do
        folder = where / m["name"]
        folder.mkdir(parents=True)
        for s in sources:
            data = secrets[s["name"]]
            for item in s.get("items") or [{"key": k, "path": k} for k in data]:
                (folder / item["path"]).write_bytes(data[item["key"]])
        mapping[m["mountPath"]] = str(folder)
    return mapping


def rendered_secrets(docs: list[dict[str, Any]]) -> Secrets:
    return {d["metadata"]["name"]: {k: base64.b64decode(v) for k, v in d["data"].items()}
            for d in by_kind(docs, "Secret")}


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def certificates(pki: Path) -> Secrets:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as the two
    kubernetes.io/tls Secrets cert-manager would make."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl makes the test certificates")
    pki.mkdir()
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *key, "-keyout", str(pki / "ca.key"), "-out", str(pki / "ca.crt"),
            "-days", "1", "-subj", "/CN=ddpbus test CA",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    out: Secrets = {}
    for name, usage in (("server", "serverAuth"), ("client", "clientAuth")):
        ext = pki / f"{name}.ext"
        ext.write_text("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
                       f"extendedKeyUsage={usage}\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n"
                       "authorityKeyIdentifier=keyid\nsubjectKeyIdentifier=hash\n")
        openssl("req", *key, "-keyout", str(pki / f"{name}.key"), "-out",
                str(pki / f"{name}.csr"), "-subj", f"/CN={name}")
        openssl("x509", "-req", "-in", str(pki / f"{name}.csr"), "-CA", str(pki / "ca.crt"),
                "-CAkey", str(pki / "ca.key"), "-CAcreateserial", "-days", "1",
                "-extfile", str(ext), "-out", str(pki / f"{name}.crt"))
        out[f"{name}-tls"] = {"tls.crt": (pki / f"{name}.crt").read_bytes(),
                              "tls.key": (pki / f"{name}.key").read_bytes(),
                              "ca.crt": (pki / "ca.crt").read_bytes()}
    return out


def server_config(secrets: Secrets, folder: Path, release: str = "train") -> Path:
    """The bundled server's rendered config (nats.conf with its auth.conf and TLS files),
    less the fixed ports and store dir (the embedded broker picks free ones)."""
    folder.mkdir()
    conf = secrets[f"{release}-ddpbus-nats-config"]
    text = conf["nats.conf"].decode()
    for fixed in ("port: 4222\n", "http_port: 8222\n",
                  "jetstream {\n  store_dir: /data/jetstream\n}\n"):
        assert fixed in text, f"the rendered nats.conf changed: {text}"
        text = text.replace(fixed, "")
    assert "pid_file: /var/run/nats/nats.pid\n" in text  # the preStop's lame duck signal
    text = text.replace("/var/run/nats/", f"{folder}/")
    for key, data in secrets.get("server-tls", {}).items():  # with nats.tls on
        (folder / key).write_bytes(data)
    (folder / "nats.conf").write_text(text.replace("/etc/nats-tls", str(folder)))
    (folder / "auth.conf").write_bytes(conf["auth.conf"])
    return folder / "nats.conf"


BASE = ["worker.gpu.enabled=false", "training.backend=gloo", "training.workers=2",
        "training.epochs=3", "job=smoke"]


def test_the_bundled_server_config_logins_and_mutual_tls(helm: Path, tmp_path: Path) -> None:
    provided = certificates(tmp_path / "pki")
    sets = [*BASE, f"coordinator.metrics.port={free_port()}", "nats.tls.enabled=true",
            "nats.tls.secretName=server-tls", "nats.tls.verifyClients=true",
            "nats.tls.clientSecretName=client-tls"]
    docs = render(helm, sets)
    secrets = rendered_secrets(docs) | provided
    config = server_config(secrets, tmp_path / "nats")
    with EmbeddedBroker(BrokerConfig(store_dir=tmp_path / "store", config_file=config)) as b:
        run_rendered(docs, b.url, secrets, tmp_path)
    assert READS_ADVISORIES in (tmp_path / "coordinator.log").read_text()


def test_the_bundled_server_with_existing_logins(helm: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """GitOps: the job key and every login in Secrets made outside the chart (External
    Secrets, Sealed Secrets); the bundled server reads each login from its environment."""
    sets = [*BASE, f"coordinator.metrics.port={free_port()}",
            "auth.existing.secretPrefix=login", "jobKey.existingSecret=key"]
    docs = render(helm, sets)
    # the job's identities and the coordinator's system-account login (coordinator.presence)
    logins = [*auth.identities(2), "system"]
    secrets: Secrets = {f"login-{i}": {"user": i.encode(), "password": os.urandom(12).hex()
                                       .encode()} for i in logins}
    secrets["key"] = {"job.key": os.urandom(32).hex().encode()}
    secrets |= rendered_secrets(docs)
    [server] = by_kind(docs, "StatefulSet")
    _, server_env = process({**server["spec"]["template"]["spec"]["containers"][0],
                             "command": ["nats-server"], "args": []}, {}, secrets)
    assert {k for k in server_env if k.startswith("LOGIN_")} == {
        f"LOGIN_{i.upper().replace('-', '_')}_{k}" for i in logins for k in ("USER", "PASSWORD")}
    for k, v in server_env.items():
        monkeypatch.setenv(k, v)  # the server's environment, as its pod has it
    config = server_config(secrets, tmp_path / "nats")
    with EmbeddedBroker(BrokerConfig(store_dir=tmp_path / "store", config_file=config)) as b:
        run_rendered(docs, b.url, secrets, tmp_path)
    assert READS_ADVISORIES in (tmp_path / "coordinator.log").read_text()


def test_an_existing_server_with_nkey_secrets(helm: Path, tmp_path: Path) -> None:
    """The server `ddpbus broker --auth` runs; the URL from a Secret, proto3 JSON wire, and
    its system-account user's seed in coordinator.presence.existingSecret."""
    creds = auth.write_credentials(tmp_path / "auth", "smoke", 2)
    secrets: Secrets = {f"login-{i}": {"seed": creds.seed(i).read_bytes()}
                        for i in creds.identities}
    system = tmp_path / "auth" / "system.nk"
    sets = [*BASE, f"coordinator.metrics.port={free_port()}", "nats.bundled=false",
            "nats.urlSecret.name=nats-url", "auth.existing.secretPrefix=login",
            "auth.existing.kind=nkey", "training.wireJson=true",
            "coordinator.presence.existingSecret=system-login"]
    with EmbeddedBroker(BrokerConfig(store_dir=tmp_path / "store", auth_file=creds.config,
                                     system_seed=system)) as b:
        secrets["nats-url"] = {"url": b.url.encode()}
        secrets["system-login"] = {"seed": system.read_bytes()}
        docs = render(helm, sets)
        run_rendered(docs, b.url, rendered_secrets(docs) | secrets, tmp_path)
    assert READS_ADVISORIES in (tmp_path / "coordinator.log").read_text()


def kubelet_env(docs: list[dict[str, Any]], pod: dict[str, Any], name: str) -> dict[str, str]:
    """What the kubelet adds to a container's env: HOSTNAME, the API server's variables
    (always), and the service links of every Service in the namespace. The chart turns
    links off (``enableServiceLinks: false``); they are added anyway, the stricter case,
    as a namespace whose admission turned them back on would give them."""
    assert pod["enableServiceLinks"] is False
    services = [{"metadata": {"name": "kubernetes"},
                 "spec": {"ports": [{"name": "https", "port": 443}]}}, *by_kind(docs, "Service")]
    return {"HOSTNAME": name} | namespace_links(services)


def start_pod(docs: list[dict[str, Any]], name: str, pod: dict[str, Any], base: dict[str, str],
              secrets: Secrets, tmp_path: Path) -> subprocess.Popen[bytes]:
    """A pod's container as a local process: its command, args and env as rendered, its
    Secret volumes written out (a fresh folder per pod: a replacement starts empty), and
    the env the kubelet adds."""
    mapping = base | mounts(pod, secrets, tmp_path / name)
    argv, env = process(pod["containers"][0], mapping, secrets)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DDPBUS_")}
    with (tmp_path / f"{name}.log").open("wb") as log:
        return subprocess.Popen(argv, env=clean | kubelet_env(docs, pod, name) | env,
                                stdout=log, stderr=subprocess.STDOUT)


def observe(docs: list[dict[str, Any]], base: dict[str, str], secrets: Secrets,
            tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The helm-test pod's command (`ddpbus status`, as the observer), with ``args``."""
    [check] = by_kind(docs, "Pod")
    mapping = base | mounts(check["spec"], secrets, tmp_path / f"status-{time.monotonic_ns()}")
    argv, env = process(check["spec"]["containers"][0], mapping, secrets)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DDPBUS_")}
    return subprocess.run([*argv, *args], env=clean | kubelet_env(docs, check["spec"], "test")
                          | env, capture_output=True, text=True, timeout=60, check=False)


def run_rendered(docs: list[dict[str, Any]], url: str, secrets: Secrets,
                 tmp_path: Path, release: str = "train", epochs: int = 3,
                 kill: int | None = None) -> dict[str, Any]:
    """Every rendered pod of the job, run to its end. ``kill``: SIGKILL that rank's process
    once the run has averaged, and start the replacement its Job would (a new pod: its own
    empty volumes); the run must still complete and every other process exit 0."""
    coord = coordinator_job(docs)
    base = {f"{release}-ddpbus-nats:4222": url.split("://", 1)[1],
            "/opt/ddpbus/examples": str(ROOT / "examples")}
    pods = {"coordinator": coord["spec"]["template"]["spec"]}
    pods |= {f"worker-{r}": job["spec"]["template"]["spec"]
             for r, job in enumerate(worker_jobs(docs))}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name, pod in pods.items():
            procs[name] = start_pod(docs, name, pod, base, secrets, tmp_path)
        if kill is not None:
            deadline = time.monotonic() + 120
            while True:  # until the run has averaged: the rank has work to lose
                out = observe(docs, base, secrets, tmp_path, "--json")
                if out.returncode == 0 and json.loads(out.stdout).get("rounds", 0) > 0:
                    break
                assert time.monotonic() < deadline, out.stdout + out.stderr
                time.sleep(0.2)  # poll interval of a deadline-bound wait
            victim = procs.pop(f"worker-{kill}")
            victim.kill()
            assert victim.wait(30) == -signal.SIGKILL
            procs[f"worker-{kill}-replacement"] = start_pod(
                docs, f"worker-{kill}-replacement", pods[f"worker-{kill}"], base, secrets,
                tmp_path)
        codes = {name: p.wait(240) for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    logs = "\n".join(f"--- {n}\n{(tmp_path / f'{n}.log').read_text()[-3000:]}" for n in procs)
    assert codes == dict.fromkeys(procs, 0), logs
    status = observe(docs, base, secrets, tmp_path, "--json")
    assert status.returncode == 0, status.stderr
    doc = json.loads(status.stdout)
    assert doc["phase"] == "done"
    assert doc["outcome"]["ok"], doc
    assert doc["epochs"] == epochs
    return {"base": base, "pods": pods, "logs": logs}


def test_the_observer_needs_its_login(helm: Path, tmp_path: Path) -> None:
    docs = render(helm, [*BASE, "training.workers=1"])
    secrets = rendered_secrets(docs)
    config = server_config(secrets, tmp_path / "nats")
    with EmbeddedBroker(BrokerConfig(store_dir=tmp_path / "store", config_file=config)) as b:
        base = {"train-ddpbus-nats:4222": b.url.split("://", 1)[1]}
        [check] = by_kind(docs, "Pod")
        mapping = base | mounts(check["spec"], secrets, tmp_path / "status")
        argv, env = process(check["spec"]["containers"][0], mapping, secrets)
        clean = {k: v for k, v in os.environ.items() if not k.startswith("DDPBUS_")}
        login = {k: v for k, v in env.items() if k in ("DDPBUS_NATS_USER", "DDPBUS_NATS_NKEY")}
        assert login  # the observer logs in; without its login the server refuses:
        anonymous = subprocess.run(argv, env={k: v for k, v in (clean | env).items()
                                              if k not in login and "PASSWORD" not in k},
                                   capture_output=True, text=True, timeout=60, check=False)
        assert anonymous.returncode != 0
        assert "uthorization" in anonymous.stderr, anonymous.stderr


@pytest.mark.parametrize("release", [
    "ddpbus", pytest.param("ddpbus-exp1", marks=pytest.mark.slow),
    pytest.param("t", marks=pytest.mark.slow)])
def test_a_release_trains_with_the_env_kubernetes_gives(helm: Path, tmp_path: Path,
                                                        release: str) -> None:
    """Under the release names people use (``ddpbus`` names Services ``ddpbus-ddpbus-*``,
    whose links are ``DDPBUS_DDPBUS_*``): a killed rank's replacement rejoins and the run
    completes; a reinstall on the retained store (the same job name) fails loudly."""
    sets = ["worker.gpu.enabled=false", "training.backend=gloo", "training.workers=2",
            "training.epochs=30", f"coordinator.metrics.port={free_port()}"]
    docs = render(helm, sets, release=release)
    assert env(container(coordinator_job(docs)))["DDPBUS_JOB"] == release
    secrets = rendered_secrets(docs)
    config = server_config(secrets, tmp_path / "nats", release)
    with EmbeddedBroker(BrokerConfig(store_dir=tmp_path / "store", config_file=config)) as b:
        ran = run_rendered(docs, b.url, secrets, tmp_path, release, epochs=30, kill=1)
        # the bundled server's system account: the kill is the broker's word, not silence
        coordinator = (tmp_path / "coordinator.log").read_text()
        assert READS_ADVISORIES in coordinator
        assert f"the broker closed ddpbus-{release}-rank-1's connection" in coordinator, \
            coordinator[-3000:]
        # it rejoined (or, on a machine slow to start it, found the run already over)
        replaced = (tmp_path / "worker-1-replacement.log").read_text()
        assert "rejoin sent" in replaced or "nothing to join" in replaced, replaced
        # helm uninstall + install: the same job name, the store retained (whenDeleted)
        again = start_pod(docs, "coordinator-reinstalled", ran["pods"]["coordinator"],
                          ran["base"], secrets, tmp_path)
        assert again.wait(120) == 4  # its Job fails at once (podFailurePolicy: exit 4)
        log = (tmp_path / "coordinator-reinstalled.log").read_text()
        assert f"job {release} already ran to its end" in log, log
        assert "--set job=NAME" in log
        assert f"ddpbus delete-job --job {release}" in log
