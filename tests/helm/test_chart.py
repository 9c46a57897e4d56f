"""The Helm chart: lint, render for several value sets, validate every manifest against
Kubernetes schemas offline, refuse bad values, and keep the chart README complete."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pss
import pytest
import yaml
from chart import (
    CHART,
    by_kind,
    container,
    coordinator_job,
    env,
    pod_spec,
    pod_specs,
    render,
    run,
    worker_jobs,
)

ROOT = Path(__file__).resolve().parents[2]
K8S_VERSIONS = ("1.33", "1.35", "1.37")

VALUE_SETS: dict[str, list[str]] = {
    "default": [],
    # GitOps: every Secret made outside the chart, so every render is the same
    "gitops": ["jobKey.existingSecret=train-key", "auth.existing.secretPrefix=train-login"],
    "existing-nats": ["nats.bundled=false", "nats.url=nats://nats.infra:4222",
                      "auth.existing.secretPrefix=train-login"],
    "existing-nats-secret": ["nats.bundled=false", "nats.urlSecret.name=nats-url",
                             "auth.enabled=false"],
    "existing-nats-creds": ["nats.bundled=false", "nats.url=tls://nats.infra:4222",
                            "auth.existing.secretPrefix=train-login", "auth.existing.kind=creds",
                            "nats.tls.enabled=true", "nats.tls.secretName=nats-ca"],
    "existing-nats-nkey": ["nats.bundled=false", "nats.url=nats://nats.infra:4222",
                           "auth.existing.secretPrefix=train-login", "auth.existing.kind=nkey",
                           "nats.tls.enabled=true", "nats.tls.secretName=nats-ca",
                           "nats.tls.verifyClients=true",
                           "nats.tls.clientSecretName=ddpbus-client-tls"],
    "auth-off": ["auth.enabled=false"],
    "tls": ["nats.tls.enabled=true", "nats.tls.secretName=nats-tls"],
    "tls-verify-clients": ["nats.tls.enabled=true", "nats.tls.secretName=nats-tls",
                           "nats.tls.verifyClients=true"],
    "tls-client-cert": ["nats.tls.enabled=true", "nats.tls.secretName=nats-tls",
                        "nats.tls.verifyClients=true", "nats.tls.clientSecretName=client-tls"],
    "tls-auth-off": ["auth.enabled=false", "nats.tls.enabled=true",
                     "nats.tls.secretName=nats-tls"],
    "bundled-nats": ["nats.bundled=true", "nats.storage.size=50Gi"],
    "standby": ["coordinator.replicas=2"],
    # what a platform team sets on a GPU cluster (the chart README's example)
    "gpu-cluster": ["job=resnet-1", "workload.labels.kueue\\.x-k8s\\.io/queue-name=team-a",
                    "workload.ttlSecondsAfterFinished=86400", "priorityClassName=training",
                    "worker.priorityClassName=training-high", "schedulerName=volcano",
                    "worker.runtimeClassName=nvidia", "podLabels.team=vision",
                    "worker.podAnnotations.note=gpu", "worker.gpu.resourceName=amd.com/gpu",
                    "worker.tolerations[0].key=nvidia.com/gpu",
                    "worker.tolerations[0].operator=Exists",
                    "nats.nodeSelector.pool=system", "nats.tolerations[0].key=system",
                    "nats.tolerations[0].operator=Exists",
                    "coordinator.topologySpreadConstraints[0].maxSkew=1",
                    "coordinator.topologySpreadConstraints[0].topologyKey=zone",
                    "coordinator.topologySpreadConstraints[0].whenUnsatisfiable=ScheduleAnyway",
                    "worker.extraVolumes[0].name=data",
                    "worker.extraVolumes[0].persistentVolumeClaim.claimName=imagenet",
                    "worker.extraVolumeMounts[0].name=data",
                    "worker.extraVolumeMounts[0].mountPath=/data",
                    "image.pullSecrets[0].name=registry",
                    "jobKey.existingSecret=resnet-key", "nats.image.digest=sha256:" + "a" * 64,
                    "nats.storage.whenDeleted=Delete"],
    "one-worker": ["training.workers=1"],
    "four-workers": ["training.workers=4", "worker.ncclEnv.NCCL_SOCKET_IFNAME=eth0"],
    "eight-workers": ["training.workers=8", "worker.gpu.count=1",
                      "worker.nodeSelector.gpu=h100"],
    "cpu-only": ["worker.gpu.enabled=false", "training.backend=gloo",
                 "image.tag=0.1.0-cpu"],
    "inline-spec": ["spec.inline=from x import spec"],
    "configmap-spec": ["spec.configMap.name=my-spec", "spec.configMap.key=train.py"],
    "existing-key": ["jobKey.existingSecret=my-job-key"],
    "service-monitor": ["coordinator.metrics.serviceMonitor.enabled=true",
                        "coordinator.metrics.dashboard.enabled=true"],
    "bundle-volume": ["worker.bundleClaim=bundles-rwx", "training.resume=old-job"],
    "wire-json": ["training.wireJson=true"],
    "broker-backend": ["training.backend=broker", "worker.gpu.enabled=false"],
    "network-policy": ["networkPolicy.enabled=true", "coordinator.replicas=2",
                       "networkPolicy.natsMonitorFrom[0].namespaceSelector.matchLabels"
                       ".kubernetes\\.io/metadata\\.name=monitoring"],
    "network-policy-existing-nats": ["networkPolicy.enabled=true", "nats.bundled=false",
                                     "nats.url=nats://nats.infra:4222",
                                     "auth.existing.secretPrefix=train-login"],
    "retention": ["coordinator.retention.compactEvery=30",
                  "coordinator.retention.keepHistory=0",
                  "coordinator.retention.streamMaxBytes=68719476736"],
}


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_lint_render_and_validate(helm: Path, name: str) -> None:
    sets = VALUE_SETS[name]
    lint = run(helm, "lint", "--strict", str(CHART), *[x for s in sets for x in ("--set", s)])
    assert lint.returncode == 0, lint.stdout + lint.stderr
    docs = render(helm, sets)
    for doc in docs:
        if doc["apiVersion"].startswith(("monitoring.coreos.com/", "jobset.x-k8s.io/")):
            continue  # a CRD: no upstream schema to check it against
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
    want = int(next((s.split("=")[1] for s in sets if s.startswith("training.workers=")),
                    "2"))
    workers = worker_jobs(docs)
    assert [d["metadata"]["name"] for d in workers] == [f"train-ddpbus-worker-{r}"
                                                         for r in range(want)]
    gpu = "worker.gpu.enabled=false" not in sets
    for rank, job in enumerate(workers):  # one Job per rank (its own login)
        assert (job["spec"]["completions"], job["spec"]["parallelism"]) == (1, 1)
        assert job["metadata"]["labels"]["ddpbus.io/rank"] == str(rank)
        finite(job, "worker")
        w = container(job)
        assert env(w)["DDPBUS_WORLD_SIZE"] == str(want)
        assert env(w)["DDPBUS_RANK"] == str(rank)
        gpu_name = next((x.split("=", 1)[1] for x in sets
                         if x.startswith("worker.gpu.resourceName=")), "nvidia.com/gpu")
        assert (gpu_name in w["resources"]["limits"]) is gpu
        assert env(w)["DDPBUS_DEVICE"] == ("cuda" if gpu else "cpu")
    [pdb] = by_kind(docs, "PodDisruptionBudget")
    assert pdb["spec"] == {"maxUnavailable": 1, "unhealthyPodEvictionPolicy": "AlwaysAllow",
                           "selector": {"matchLabels": {
                               "app.kubernetes.io/name": "ddpbus",
                               "app.kubernetes.io/instance": "train",
                               "app.kubernetes.io/component": "worker"}}}
    w = container(workers[0])
    coord = coordinator_job(docs)
    finite(coord, "coordinator")
    assert "completions" not in coord["spec"]  # done once one succeeded and all ended
    c = container(coord)
    assert c["command"] == ["ddpbus"]
    assert c["args"][:2] == ["coordinator", "--standby"]
    retention = "coordinator.retention.keepHistory=0" in sets
    assert ("--keep-history=0" if retention else "--keep-history=1800") in c["args"]
    assert ("--compact-every=30" if retention else "--compact-every=60") in c["args"]
    assert ("--stream-max-bytes=68719476736" in c["args"]) is retention
    json_wire = "training.wireJson=true" in sets
    assert ("--wire-json" in c["args"]) is json_wire
    assert ("--wire-json" in w["args"]) is json_wire
    assert coord["spec"]["parallelism"] == (2 if "coordinator.replicas=2" in sets else 1)
    bundled = "nats.bundled=false" not in sets
    url = env(c)["DDPBUS_NATS_URL"]
    if "nats.urlSecret.name=nats-url" in sets:
        assert url == {"secretKeyRef": {"name": "nats-url", "key": "url"}}
    elif bundled:
        assert url == "nats://train-ddpbus-nats:4222"
    else:
        assert url == next(s.split("=", 1)[1] for s in sets if s.startswith("nats.url="))
    assert bool([d for d in by_kind(docs, "StatefulSet") if "nats" in d["metadata"]["name"]]) \
        is bundled
    _every_pod_is_safe(docs, sets)


def _every_pod_is_safe(docs: list[dict[str, Any]], sets: list[str]) -> None:
    """Restricted, no service links, no API token, the pull secrets, requests, and never
    a secret in clear."""
    pulls = [{"name": "registry"}] if "image.pullSecrets[0].name=registry" in sets else None
    for d, pod in pod_specs(docs):
        assert pss.violations(pod) == [], d["metadata"]["name"]
        assert pod["enableServiceLinks"] is False
        assert pod["automountServiceAccountToken"] is False
        assert pod.get("imagePullSecrets") == pulls, d["metadata"]["name"]
    for d in docs:
        for pod in _pods(d):
            for k in pod["containers"]:
                assert k["resources"]["requests"], f"{d['kind']} {k['name']} has no requests"
                for e in k.get("env", []):
                    if any(w in e["name"] for w in SECRET_WORDS) and "value" in e:
                        assert e["value"].startswith("/etc/ddpbus/"), e  # a mounted file


SECRET_WORDS = ("KEY", "PASSWORD", "CREDS", "NKEY", "TOKEN", "SEED")


def test_a_jobset_holds_the_same_jobs(helm: Path) -> None:
    """workload.kind=JobSet: one JobSet (what Kueue admits whole) whose Jobs are exactly the
    ones workload.kind=Job renders, its labels on the JobSet only."""
    sets = ["training.workers=3", "coordinator.replicas=2",
            "workload.labels.kueue\\.x-k8s\\.io/queue-name=team-a",
            "workload.ttlSecondsAfterFinished=600"]
    jobs = {d["metadata"]["name"]: d for d in by_kind(render(helm, sets), "Job")}
    docs = render(helm, [*sets, "workload.kind=JobSet"])
    assert not by_kind(docs, "Job")
    [jobset] = by_kind(docs, "JobSet")
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    assert jobset["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    spec = jobset["spec"]
    assert spec["ttlSecondsAfterFinished"] == 600
    assert spec["successPolicy"] == {"operator": "All"}
    assert spec["failurePolicy"] == {"maxRestarts": 0}
    replicated = {r["name"]: r for r in spec["replicatedJobs"]}
    assert list(replicated) == ["coordinator", "rank-0", "rank-1", "rank-2"]
    for name, job in jobs.items():
        r = replicated["coordinator" if name.endswith("coordinator") else
                       "rank-" + name.rsplit("-", 1)[1]]
        assert r["replicas"] == 1
        # the same Job: pods, failure policy (the logins' checksums aside: each render
        # makes new random passwords, lookup finding nothing here)
        for spec_ in (r["template"]["spec"], job["spec"]):
            spec_["template"]["metadata"].get("annotations", {}).pop("ddpbus.io/nats-login")
        assert r["template"]["spec"] == job["spec"]
        assert "kueue.x-k8s.io/queue-name" not in r["template"]["metadata"]["labels"]
        assert pss.violations(r["template"]["spec"]["template"]["spec"]) == []


def test_with_existing_secrets_every_render_is_the_same(helm: Path) -> None:
    """Argo CD and Flux render with `helm template` (no lookup): with the job key and the
    logins in existing Secrets nothing random is left, so a sync changes nothing."""
    sets = VALUE_SETS["gitops"]
    first, second = render(helm, sets), render(helm, sets)
    assert first == second
    assert by_kind(first, "Secret") == [d for d in by_kind(first, "Secret")
                                        if d["metadata"]["name"].endswith("nats-config")]
    # while the chart's own Secrets are random on each such render (lookup finds nothing)
    assert render(helm, []) != render(helm, [])


def test_a_gpu_clusters_settings_reach_their_pods(helm: Path) -> None:
    docs = render(helm, VALUE_SETS["gpu-cluster"])
    jobs = {d["metadata"]["labels"]["app.kubernetes.io/component"]: d
            for d in by_kind(docs, "Job")}
    for job in by_kind(docs, "Job"):  # Kueue reads the Job's label
        assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        assert job["spec"]["ttlSecondsAfterFinished"] == 86400
    [nats] = by_kind(docs, "StatefulSet")
    pods = {"coordinator": pod_spec(jobs["coordinator"]), "worker": pod_spec(jobs["worker"]),
            "nats": pod_spec(nats), "test": pod_spec(by_kind(docs, "Pod")[0])}
    assert {k: p["priorityClassName"] for k, p in pods.items()} == {  # type: ignore[index]
        "coordinator": "training", "worker": "training-high", "nats": "training",
        "test": "training"}
    assert {p["schedulerName"] for p in pods.values()} == {"volcano"}  # type: ignore[index]
    assert pods["worker"]["runtimeClassName"] == "nvidia"  # type: ignore[index]
    assert "runtimeClassName" not in pods["coordinator"]  # type: ignore[operator]
    w = worker_jobs(docs)[0]["spec"]["template"]
    assert w["metadata"]["labels"]["team"] == "vision"
    assert w["metadata"]["annotations"]["note"] == "gpu"
    assert w["spec"]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists"}]
    c = w["spec"]["containers"][0]
    assert c["resources"]["limits"]["amd.com/gpu"] == 1
    assert "nvidia.com/gpu" not in c["resources"]["limits"]
    assert {"name": "data", "persistentVolumeClaim": {"claimName": "imagenet"}} in \
        w["spec"]["volumes"]
    assert {"name": "data", "mountPath": "/data"} in c["volumeMounts"]
    assert pods["nats"]["nodeSelector"] == {"pool": "system"}  # type: ignore[index]
    assert pods["coordinator"]["topologySpreadConstraints"][0]["topologyKey"] == "zone"  # type: ignore[index]
    assert nats["spec"]["template"]["spec"]["containers"][0]["image"] == "nats@sha256:" + "a" * 64
    assert nats["spec"]["persistentVolumeClaimRetentionPolicy"] == {
        "whenDeleted": "Delete", "whenScaled": "Retain"}
    assert env(c)["DDPBUS_JOB"] == "resnet-1"
    assert not [d for d in by_kind(docs, "Secret") if d["metadata"]["name"].endswith("job-key")]


def test_the_bundled_nats_is_hardened_like_the_official_chart(helm: Path) -> None:
    [nats] = by_kind(render(helm, ["nats.resources.limits.memory=4Gi"]), "StatefulSet")
    spec = nats["spec"]["template"]["spec"]
    c = spec["containers"][0]
    assert c["image"] == "nats:2.15.1-alpine"  # the server the code is tested against
    assert env(c)["GOMEMLIMIT"] == str(4 * 2**30 * 9 // 10)
    assert c["lifecycle"]["preStop"]["exec"]["command"] == [
        "nats-server", "-sl=ldm=/var/run/nats/nats.pid"]
    assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert c["startupProbe"]["failureThreshold"] == 90
    assert c["readinessProbe"]["httpGet"]["path"] == "/healthz?js-server-only=true"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz?js-enabled-only=true"
    assert spec["terminationGracePeriodSeconds"] == 60
    assert nats["spec"]["persistentVolumeClaimRetentionPolicy"]["whenDeleted"] == "Retain"


def test_the_restricted_check_catches_what_it_must() -> None:
    good = {"securityContext": {"runAsNonRoot": True, "seccompProfile": {
        "type": "RuntimeDefault"}}, "containers": [{"name": "c", "securityContext": {
            "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}],
        "volumes": [{"name": "v", "emptyDir": {}}]}
    assert pss.violations(good) == []
    for path, value, found in [
            (("securityContext", "seccompProfile"), None, "seccompProfile is None"),
            (("securityContext", "runAsNonRoot"), False, "runAsNonRoot is not true"),
            (("hostNetwork",), True, "hostNetwork is set"),
            (("volumes",), [{"name": "h", "hostPath": {"path": "/"}}], "volume h"),
            (("containers",), [{"name": "c", "securityContext": {
                "allowPrivilegeEscalation": False}}], "do not drop ALL")]:
        bad = yaml.safe_load(yaml.safe_dump(good))
        node = bad
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        assert any(found in v for v in pss.violations(bad)), (path, pss.violations(bad))


def _pods(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod_spec(doc)
    return [] if spec is None else [spec]


def finite(job: dict[str, Any], container_name: str) -> None:
    """A Job whose pods are never restarted in place: a failed one is replaced (up to the
    backoff limit), a drain costs no retry, and a bad setting (2) or an ended job (4)
    fails it at once."""
    spec = job["spec"]
    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    assert spec["backoffLimit"] == 6
    assert spec["podFailurePolicy"]["rules"] == [
        {"action": "FailJob", "onExitCodes": {"containerName": container_name,
                                              "operator": "In", "values": [2, 4]}},
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget",
                                                    "status": "True"}]}]


@pytest.mark.parametrize(("sets", "message"), [
    (["surprise=1"], "'surprise' not allowed"),
    (["worker.gpu.count=2"], "at '/worker/gpu/count'"),
    (["workload.kind=Deployment"], "at '/workload/kind'"),
    (["workload.backoffLimit=-1"], "at '/workload/backoffLimit'"),
    (["priorityClassName=Not_A_Name"], "at '/priorityClassName'"),
    (["nats.image.digest=latest"], "at '/nats/image/digest'"),
    (["nats.storage.whenDeleted=Keep"], "at '/nats/storage/whenDeleted'"),
    (["worker.extraVolumeMounts[0].name=x"], "at '/worker/extraVolumeMounts/0'"),
    (["nats.resources.limits.memory=2.5Gi"], "use a whole number"),
    (["training.workers=two"], "at '/training/workers': got string, want integer"),
    (["training.workers=0"], "at '/training/workers'"),
    (["coordinator.replicas=3"], "at '/coordinator/replicas'"),
    (["training.policy=fastest"], "at '/training/policy'"),
    (["nats.url=http://x"], "at '/nats/url'"),
    (["job=bad name"], "at '/job'"),
    (["worker.gpu.enabled=maybe"], "at '/worker/gpu/enabled'"),
    (["worker.resources.requests.cpu=4", "worker.extra=1"], "'extra' not allowed"),
    (["nats.bundled=false"], "nats.url or nats.urlSecret.name is required"),
    (["nats.bundled=false", "nats.url=nats://n:4222"], "auth.existing.secretPrefix is required"),
    (["auth.existing.secretPrefix=x", "auth.existing.kind=nkey"],
     "the bundled server takes existing logins of kind password"),
    (["nats.bundled=false", "nats.url=nats://n:4222", "auth.existing.secretPrefix=x",
      "auth.existing.kind=token"], "at '/auth/existing/kind'"),
    (["auth.enabled=yes"], "at '/auth/enabled'"),
    (["auth.users=1"], "'users' not allowed"),
    (["nats.tls.enabled=true"], "nats.tls.secretName is required"),
    (["nats.tls.verifyClients=true"], "nats.tls.verifyClients needs nats.tls.enabled"),
    (["nats.tls.enabled=true", "nats.tls.secretName=t", "nats.tls.clientSecretName=c"],
     "nats.tls.clientSecretName is for mutual TLS"),
    (["nats.tls.ca=x"], "'ca' not allowed"),
    (["coordinator.retention.compactEvery=-1"], "at '/coordinator/retention/compactEvery'"),
    (["coordinator.retention.streamMaxBytes=lots"],
     "at '/coordinator/retention/streamMaxBytes'"),
    # 0 would be dropped like null (the stream keeping its limit), not refused by the flag
    (["coordinator.retention.streamMaxBytes=0"],
     "at '/coordinator/retention/streamMaxBytes'"),
])
def test_bad_values_are_refused(helm: Path, sets: list[str], message: str) -> None:
    out = run(helm, "template", "train", str(CHART), *[x for s in sets for x in ("--set", s)])
    assert out.returncode != 0
    assert message in out.stderr, out.stderr


@pytest.mark.parametrize(("sets", "flag"), [
    ([], None),  # null: no flag, so an existing stream keeps its limit
    (["coordinator.retention.streamMaxBytes=-1"], "--stream-max-bytes=-1"),
])
def test_stream_max_bytes_null_sets_nothing_and_minus_one_unlimited(
        helm: Path, sets: list[str], flag: str | None) -> None:
    coord = coordinator_job(render(helm, sets))
    given = [a for a in container(coord)["args"] if a.startswith("--stream-max-bytes")]
    assert given == ([flag] if flag else [])


def test_the_chart_readme_names_every_value() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    readme = (CHART / "README.md").read_text()

    def leaves(node: Any, prefix: str = "") -> list[str]:
        if isinstance(node, dict) and node and prefix.count(".") < 3:
            return [x for k, v in node.items() for x in leaves(v, f"{prefix}{k}.")]
        return [prefix.rstrip(".")]

    missing = [k for k in leaves(values) if f"`{k}`" not in readme]
    assert not missing, f"chart README lacks {missing}"


def test_the_dockerfile_is_what_a_reviewer_expects() -> None:
    text = (ROOT / "Dockerfile").read_text()
    stages = {s.split()[2]: s for s in re.split(r"(?m)^FROM ", text)[1:]}
    assert list(stages) == ["src", "base-cpu", "base-gpu", "image"]
    assert stages["src"].split()[0] == "scratch"  # the sources, gathered once
    assert re.search(r"(?m)^ARG FLAVOR=cpu$", text)
    assert stages["image"].split()[0] == "base-${FLAVOR}"
    for name in ("base-cpu", "base-gpu"):
        image = stages[name].split()[0]
        assert ":" in image, f"{image} is not pinned to a tag"
        assert not image.endswith(":latest")
    assert stages["base-cpu"].split()[0].startswith("python:3.11")
    assert "download.pytorch.org/whl/cpu" in stages["base-cpu"]
    assert stages["base-gpu"].split()[0].startswith("nvidia/cuda:")
    final = stages["image"]
    assert "-c requirements/constraints.txt" in final, "install without the lock's pins"
    assert '".[train,report,server,examples]"' in final, "an image that cannot train"
    lines = [x.strip() for x in final.splitlines()]
    user = max(i for i, x in enumerate(lines) if x.startswith("USER "))
    entry = max(i for i, x in enumerate(lines) if x.startswith("ENTRYPOINT "))
    assert user < entry, "the entrypoint must run as the non-root user"
    assert lines[user] == "USER 10001:10001"
    assert lines[entry] == 'ENTRYPOINT ["ddpbus"]'
    assert "COPY --from=src /src/examples/ /opt/ddpbus/examples/" in final  # default spec
    assert not re.search(r"(?m)^ADD\s+https?://", text), "ADD of a URL"


def test_the_grafana_dashboard_configmap_carries_the_shipped_json(helm: Path) -> None:
    def boards(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [d for d in by_kind(docs, "ConfigMap")
                if d["metadata"]["name"] == "train-ddpbus-dashboard"]

    assert not boards(render(helm, []))
    [board] = boards(render(helm, ["coordinator.metrics.dashboard.enabled=true",
                                   "coordinator.metrics.dashboard.labels.team=ml"]))
    # the label Grafana's dashboard sidecar looks for, and the platform team's own
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert board["metadata"]["labels"]["team"] == "ml"
    shipped = (CHART / "dashboards" / "ddpbus.json").read_text()
    assert json.loads(board["data"]["ddpbus.json"]) == json.loads(shipped)


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _ports(spec: dict[str, Any]) -> set[str]:
    return {p["name"] for c in spec["containers"] for p in c.get("ports", []) if "name" in p}


@pytest.mark.parametrize("release", ["train", "ddpbus-exp1"])
def test_network_policies_cover_every_pod_and_admit_only_what_it_talks_to(
        helm: Path, release: str) -> None:
    docs = render(helm, VALUE_SETS["network-policy"], release=release)
    policies = {d["metadata"]["labels"]["app.kubernetes.io/component"]: d["spec"]
                for d in by_kind(docs, "NetworkPolicy")}
    assert set(policies) == {"nats", "worker", "coordinator"}
    pods = [(d["spec"]["template"]["metadata"]["labels"] if d["kind"] != "Pod"
             else d["metadata"]["labels"], p) for d, p in pod_specs(docs)]
    for labels, spec in pods:  # every pod but the test pod is under exactly one policy
        under = [c for c, pol in policies.items() if _selects(pol["podSelector"], labels)]
        expected = [] if labels["app.kubernetes.io/component"] == "test" else [
            labels["app.kubernetes.io/component"]]
        assert under == expected, (labels, under)
        for c in under:  # the ports the policy admits are the pod's own, by name
            admitted = {p["port"] for rule in policies[c]["ingress"]
                        for p in rule.get("ports", [])}
            assert admitted <= _ports(spec), (c, admitted, _ports(spec))
        # every pod of the release may reach NATS's client port
        client = policies["nats"]["ingress"][0]
        assert client["ports"] == [{"port": "client", "protocol": "TCP"}]
        assert _selects(client["from"][0]["podSelector"], labels)
    # NATS's monitor port: only the peers named; a pod of another release: not a client
    assert policies["nats"]["ingress"][1]["from"][0]["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    other = {"app.kubernetes.io/name": "ddpbus", "app.kubernetes.io/instance": "other"}
    assert not _selects(policies["nats"]["ingress"][0]["from"][0]["podSelector"], other)
    # the ranks: each other only, any port; the coordinator: its metrics port only
    [ranks] = policies["worker"]["ingress"]
    assert "ports" not in ranks
    assert ranks["from"] == [{"podSelector": policies["worker"]["podSelector"]}]
    [scrape] = policies["coordinator"]["ingress"]
    assert scrape == {"from": [{"namespaceSelector": {}}],
                      "ports": [{"port": "metrics", "protocol": "TCP"}]}


def test_network_policies_follow_the_values(helm: Path) -> None:
    assert not by_kind(render(helm, []), "NetworkPolicy")  # off by default
    existing = by_kind(render(helm, VALUE_SETS["network-policy-existing-nats"]),
                       "NetworkPolicy")
    assert {d["metadata"]["labels"]["app.kubernetes.io/component"] for d in existing} == {
        "worker", "coordinator"}  # no bundled server: no policy for it
    closed = by_kind(render(helm, ["networkPolicy.enabled=true",
                                   "networkPolicy.metricsFrom=null"]), "NetworkPolicy")
    [coordinator] = [d for d in closed
                     if d["metadata"]["labels"]["app.kubernetes.io/component"] == "coordinator"]
    assert coordinator["spec"]["ingress"] == []  # nothing may reach it
    bad = run(helm, "template", "t", str(CHART), "--set", "networkPolicy.enabled=true",
              "--set", "networkPolicy.metricsFrom[0].cidr=10.0.0.0/8")
    assert bad.returncode != 0
    assert "metricsFrom" in bad.stderr, bad.stderr
