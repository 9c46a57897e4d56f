"""The chart's NATS logins and TLS: the permissions come from ddpbus.orchestrator.transport.auth (no
second copy to drift), every pod mounts only its own identity's login, TLS reaches both
ends."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from chart import (
    PERMISSIONS,
    by_kind,
    container,
    coordinator_job,
    env,
    permissions_json,
    pod_spec,
    render,
    worker_jobs,
)
from test_chart import VALUE_SETS

from ddpbus.orchestrator.transport import auth

MOUNT = "/etc/ddpbus/nats"  # where a client's login and TLS files are mounted


def decoded(doc: dict[str, Any]) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in doc.get("data", {}).items()}


def secret(docs: list[dict[str, Any]], name: str) -> dict[str, str]:
    [doc] = [d for d in by_kind(docs, "Secret") if d["metadata"]["name"] == name]
    return decoded(doc)


def nats_users(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The bundled server's users, read from its config Secret."""
    conf = secret(docs, "train-ddpbus-nats-config")
    assert "include auth.conf" in conf["nats.conf"].splitlines()
    [block] = [x for x in conf["auth.conf"].splitlines() if x.startswith("authorization ")]
    users = json.loads(block.removeprefix("authorization "))["users"]
    return {u["user"]: u for u in users}


def test_the_committed_permissions_file_is_what_auth_says_now() -> None:
    assert PERMISSIONS.read_text() == permissions_json(), (
        "helm/ddpbus/files/permissions.json is stale: run `.venv/bin/python "
        "tests/helm/chart.py` and commit it")


@pytest.mark.parametrize(("resume", "earlier"), [
    ("", []), ("old-job", ["old-job"]), ("perm-job", ["perm-job"]),  # itself: no repeats
    ("/data/bundles/run1", []),  # a bundle directory: no job to read
])
def test_the_rendered_permissions_are_the_python_ones(helm: Path, resume: str,
                                                      earlier: list[str]) -> None:
    sets = ["job=perm-job", "training.workers=3", f"training.resume={resume}"]
    docs = render(helm, sets)
    users = nats_users(docs)
    assert list(users) == auth.identities(3)  # and nobody else: no anonymous login
    for identity, user in users.items():
        want = auth.permissions("perm-job", identity, resume_from=earlier,
                                world_size=3).as_config()
        assert user["permissions"] == want, identity
        assert set(user) == {"user", "password", "permissions"}


def test_each_login_is_in_its_own_secret_and_the_server_holds_its_hash(helm: Path) -> None:
    docs = render(helm, ["training.workers=3"])
    users = nats_users(docs)
    hashes = set()
    for identity in auth.identities(3):
        s = secret(docs, f"train-ddpbus-nats-{identity}")
        assert set(s) == {"password", "bcrypt", "password.sha256"}
        assert len(s["password"]) == 40
        assert s["password.sha256"] == hashlib.sha256(s["password"].encode()).hexdigest()
        assert s["bcrypt"].startswith("$2a$10$")
        assert users[identity]["password"] == s["bcrypt"]  # one render, one random draw
        hashes.add(s["bcrypt"])
    assert len(hashes) == len(users)
    [doc] = [d for d in by_kind(docs, "Secret") if d["metadata"]["name"].endswith("-rank-0")]
    assert doc["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}


def identity_of(doc: dict[str, Any]) -> str | None:
    """Whose login a workload's pods should hold (None: no login at all)."""
    component = doc["metadata"]["labels"].get("app.kubernetes.io/component")
    if doc["kind"] == "Pod":
        return auth.OBSERVER  # the helm test pod runs `ddpbus status`
    if component == "worker":
        return f"rank-{doc['metadata']['labels']['ddpbus.io/rank']}"
    return {"coordinator": auth.COORDINATOR}.get(component)


def secrets_used(pod: dict[str, Any]) -> set[str]:
    names = set()
    for v in pod.get("volumes", []):
        if "secret" in v:
            names.add(v["secret"]["secretName"])
        for source in v.get("projected", {}).get("sources", []):
            if "secret" in source:
                names.add(source["secret"]["name"])
    for c in pod["containers"]:
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                names.add(ref["name"])
    return names


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_each_pod_holds_only_its_own_login(helm: Path, name: str) -> None:
    sets = VALUE_SETS[name]
    docs = render(helm, sets)
    workers = len(worker_jobs(docs))
    enabled = "auth.enabled=false" not in sets
    prefix = next((s.split("=", 1)[1] for s in sets
                   if s.startswith("auth.existing.secretPrefix=")), "train-ddpbus-nats")
    logins = {f"{prefix}-{i}": i for i in auth.identities(workers)}
    seen = set()
    for doc in docs:
        pod = pod_spec(doc)
        if pod is None:
            continue
        own = identity_of(doc)
        held = {logins[s] for s in secrets_used(pod) if s in logins}
        if doc["kind"] == "StatefulSet":  # the bundled server: with existing logins it
            # reads every one of them (its config names them by environment variable)
            external = enabled and prefix != "train-ddpbus-nats"
            assert held == (set(logins.values()) if external else set())
            continue
        assert held == ({own} if enabled and own else set()), doc["metadata"]["name"]
        seen |= held
        if own and enabled:
            e = env(container(doc) if doc["kind"] != "Pod" else {"env": pod["containers"][0]
                                                                  ["env"]})
            if "auth.existing.kind=creds" in sets:
                assert e["DDPBUS_NATS_CREDS"] == "/etc/ddpbus/nats/creds"
            elif "auth.existing.kind=nkey" in sets:
                assert e["DDPBUS_NATS_NKEY"] == "/etc/ddpbus/nats/seed"
            elif prefix == "train-ddpbus-nats":
                assert e["DDPBUS_NATS_USER"] == own
                assert e["DDPBUS_NATS_PASSWORD_FILE"] == f"{MOUNT}/password"
            else:
                assert e["DDPBUS_NATS_USER"] == {"secretKeyRef": {
                    "name": f"{prefix}-{own}", "key": "user"}}
    assert seen == (set(logins.values()) if enabled else set())
    made = {d["metadata"]["name"] for d in by_kind(docs, "Secret")}
    assert (set(logins) <= made) is (enabled and prefix == "train-ddpbus-nats")
    assert not (set(logins) & made) or prefix == "train-ddpbus-nats"


def test_auth_off_renders_no_logins(helm: Path) -> None:
    docs = render(helm, ["auth.enabled=false"])
    conf = secret(docs, "train-ddpbus-nats-config")
    assert set(conf) == {"nats.conf"}
    assert "authorization" not in conf["nats.conf"]
    assert "include" not in conf["nats.conf"]
    assert not [d for d in by_kind(docs, "Secret") if "ddpbus.io/identity" in
                d["metadata"]["labels"]]
    for sts in worker_jobs(docs):
        assert not {k for k in env(container(sts)) if k.startswith("DDPBUS_NATS_")} - {
            "DDPBUS_NATS_URL"}
        assert "annotations" not in sts["spec"]["template"]["metadata"]


def nats_server(docs: list[dict[str, Any]]) -> dict[str, Any]:
    [sts] = [d for d in by_kind(docs, "StatefulSet") if d["metadata"]["name"] ==
             "train-ddpbus-nats"]
    return sts


def tls_block(docs: list[dict[str, Any]]) -> dict[str, Any] | None:
    lines = secret(docs, "train-ddpbus-nats-config")["nats.conf"].splitlines()
    found = [x for x in lines if x.startswith("tls ")]
    return json.loads(found[0].removeprefix("tls ")) if found else None


def client_tls(pod: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A client container's TLS variables and the secret sources of its nats-auth volume."""
    e = {k: v for k, v in env({"env": pod["containers"][0]["env"]}).items()
         if k.startswith("DDPBUS_NATS_TLS_")}
    [volume] = [v for v in pod["volumes"] if v["name"] == "nats-auth"] or [{"projected": {
        "sources": []}}]
    return e, [s["secret"] for s in volume["projected"]["sources"]]


TLS = ["nats.tls.enabled=true", "nats.tls.secretName=nats-tls"]


@pytest.mark.parametrize(("extra", "verify", "client"), [
    ([], False, None),
    (["nats.tls.verifyClients=true"], True, "nats-tls"),
    (["nats.tls.verifyClients=true", "nats.tls.clientSecretName=client-tls"], True,
     "client-tls"),
    (["auth.enabled=false", "nats.tls.verifyClients=true"], True, "nats-tls"),
])
def test_tls_reaches_the_server_and_every_client(helm: Path, extra: list[str], verify: bool,
                                                 client: str | None) -> None:
    docs = render(helm, TLS + extra)
    want = {"cert_file": "/etc/nats-tls/tls.crt", "key_file": "/etc/nats-tls/tls.key"}
    if verify:
        want |= {"ca_file": "/etc/nats-tls/ca.crt", "verify": True}
    assert tls_block(docs) == want
    server = nats_server(docs)
    spec = server["spec"]["template"]["spec"]
    assert {"name": "tls", "secret": {"secretName": "nats-tls", "defaultMode": 0o400}} in \
        spec["volumes"]
    c = spec["containers"][0]
    assert {"name": "tls", "mountPath": "/etc/nats-tls", "readOnly": True} in c["volumeMounts"]
    for probe in ("readinessProbe", "livenessProbe"):  # plain HTTP on the monitor port
        assert c[probe]["httpGet"]["port"] == "monitor"
    auth_on = "auth.enabled=false" not in extra
    clients = [*worker_jobs(docs), coordinator_job(docs),
               *by_kind(docs, "Pod")]
    for doc in clients:
        pod = doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]
        e, sources = client_tls(pod)
        files = {"DDPBUS_NATS_TLS_CA": "/etc/ddpbus/nats/ca.crt"}
        if verify:
            files |= {"DDPBUS_NATS_TLS_CERT": "/etc/ddpbus/nats/tls.crt",
                      "DDPBUS_NATS_TLS_KEY": "/etc/ddpbus/nats/tls.key"}
        assert e == files
        tls_sources = sources[1:] if auth_on else sources
        # the server's Secret lends the clients its CA only, never its key
        assert tls_sources[0] == {"name": "nats-tls", "items": [{"key": "ca.crt",
                                                                "path": "ca.crt"}]}
        assert tls_sources[1:] == ([{"name": client, "items": [
            {"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"}]}]
            if verify else [])


def test_an_existing_server_gets_only_the_client_side(helm: Path) -> None:
    docs = render(helm, ["nats.bundled=false", "nats.url=nats://nats.infra:4222",
                         "auth.existing.secretPrefix=login", *TLS])
    assert not [d for d in docs if d["metadata"]["name"].startswith("train-ddpbus-nats")]
    coord = coordinator_job(docs)
    e, sources = client_tls(coord["spec"]["template"]["spec"])
    assert e == {"DDPBUS_NATS_TLS_CA": "/etc/ddpbus/nats/ca.crt"}
    assert sources == [{"name": "login-coordinator", "items": [{"key": "password",
                                                                "path": "password"}]},
                       {"name": "nats-tls", "items": [{"key": "ca.crt", "path": "ca.crt"}]}]


def test_a_login_change_rolls_its_own_pods_and_the_server(helm: Path) -> None:
    """Each pod carries a digest of its own login's hash (a rotated password restarts it)
    and the server one of its config (new logins restart NATS; JetStream is on the PVC);
    without randomness the digests are stable."""
    docs = render(helm, ["training.workers=2"])
    pods = [*worker_jobs(docs), coordinator_job(docs)]
    for doc in pods:
        identity = identity_of(doc)
        digest = hashlib.sha256(secret(docs, f"train-ddpbus-nats-{identity}")["bcrypt"]
                                .encode()).hexdigest()[:16]
        assert doc["spec"]["template"]["metadata"]["annotations"] == {
            "ddpbus.io/nats-login": digest}
    conf = secret(docs, "train-ddpbus-nats-config")
    annotations = nats_server(docs)["spec"]["template"]["metadata"]["annotations"]
    assert annotations["checksum/config"] == hashlib.sha256(
        (conf["nats.conf"] + conf["auth.conf"]).encode()).hexdigest()
    stable = {nats_server(render(helm, ["auth.enabled=false"]))["spec"]["template"]["metadata"]
              ["annotations"]["checksum/config"] for _ in range(2)}
    assert len(stable) == 1


SYSTEM_SECRET = "train-ddpbus-nats-system"  # noqa: S105 (a Secret's name)


def test_the_system_login_is_the_coordinators_alone_in_the_servers_system_account(
        helm: Path) -> None:
    """coordinator.presence (on by default): the bundled server gets a system account with
    one user, whose login only the coordinator's pods hold (fast death detection)."""
    docs = render(helm, ["training.workers=2", "coordinator.replicas=2"])
    conf = secret(docs, "train-ddpbus-nats-config")["auth.conf"].splitlines()
    assert "system_account: SYS" in conf
    [block] = [x for x in conf if x.startswith("accounts ")]
    login = secret(docs, SYSTEM_SECRET)
    assert json.loads(block.removeprefix("accounts ")) == {
        "SYS": {"users": [{"user": "system", "password": login["bcrypt"]}]}}
    assert "system" not in nats_users(docs)  # not a user of the job's account
    holders = {doc["metadata"]["name"] for doc in docs
               if (pod := pod_spec(doc)) is not None and SYSTEM_SECRET in secrets_used(pod)}
    assert holders == {coordinator_job(docs)["metadata"]["name"]}
    e = env(container(coordinator_job(docs)))
    assert e["DDPBUS_NATS_SYSTEM_USER"] == "system"
    assert e["DDPBUS_NATS_SYSTEM_PASSWORD_FILE"] == "/etc/ddpbus/nats-system/password"  # noqa: S105


@pytest.mark.parametrize("sets", [
    ["coordinator.presence.enabled=false"],
    ["auth.enabled=false"],
    ["nats.bundled=false", "nats.url=nats://n:4222", "auth.existing.secretPrefix=login"],
], ids=["off", "no-auth", "existing-server-without-its-secret"])
def test_without_a_system_login_heartbeats_alone_judge(helm: Path, sets: list[str]) -> None:
    docs = render(helm, sets)
    assert not {k for k in env(container(coordinator_job(docs)))
                if k.startswith("DDPBUS_NATS_SYSTEM_")}
    assert SYSTEM_SECRET not in {d["metadata"]["name"] for d in by_kind(docs, "Secret")}
    for d in by_kind(docs, "Secret"):
        assert "system_account" not in "".join(decoded(d).values())


@pytest.mark.parametrize(("kind", "variable", "key"), [
    ("password", "DDPBUS_NATS_SYSTEM_PASSWORD_FILE", "password"),
    ("creds", "DDPBUS_NATS_SYSTEM_CREDS", "creds"), ("nkey", "DDPBUS_NATS_SYSTEM_NKEY", "seed")])
def test_an_existing_servers_system_login_comes_from_its_secret(
        helm: Path, kind: str, variable: str, key: str) -> None:
    docs = render(helm, ["nats.bundled=false", "nats.url=nats://n:4222",
                         "auth.existing.secretPrefix=login", f"auth.existing.kind={kind}",
                         "coordinator.presence.existingSecret=sys-login"])
    coordinator = coordinator_job(docs)
    e = env(container(coordinator))
    assert e[variable] == f"/etc/ddpbus/nats-system/{key}"
    if kind == "password":
        assert e["DDPBUS_NATS_SYSTEM_USER"] == {"secretKeyRef": {"name": "sys-login",
                                                                 "key": "user"}}
    pod = coordinator["spec"]["template"]["spec"]
    [volume] = [v for v in pod["volumes"] if v["name"] == "nats-system"]
    assert volume["projected"]["sources"] == [
        {"secret": {"name": "sys-login", "items": [{"key": key, "path": key}]}}]
    assert {"name": "nats-system", "mountPath": "/etc/ddpbus/nats-system",
            "readOnly": True} in pod["containers"][0]["volumeMounts"]
