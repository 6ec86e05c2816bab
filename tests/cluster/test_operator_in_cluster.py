"""The operator in-cluster, as users run it: its own image on the local cluster's real node, installed
by `helm install` of charts/sovereign, acting only through the chart's RBAC.

- The operator image built here (tests/local_images.py) is imported into the real node and the chart
  installed with values pointing at it (`IfNotPresent`), pinned to the real node by the chart's
  `nodeSelector`, watching one namespace of its own (`operator.watchNamespaces`: the session's local
  operator watches only `t<hex>-*` namespaces, so the two never reconcile the same object). Both
  namespaces enforce Pod Security `restricted`.
- `examples/tiny.yaml`, unchanged, turns Ready on the real node; the apiserver's audit log shows its
  status written by the chart's ServiceAccount and by no other operator identity; the model answers
  through `status.endpoint`.
- Security, enforced by the kubelet and checked from inside the running containers: non-root, no
  new privileges, no capabilities, seccomp on, a read-only root filesystem, and the writable paths
  are the volumes the operator rendered.
- The leading operator dies right after a rollout starts, twice: its pod deleted (the standby takes
  the Lease, the Deployment replaces the pod) and its processes SIGKILLed (the kubelet restarts the
  container; a live operator holds the Lease after). Each time the rollout converges and the children
  are the same objects (names, uids, controller ownerReferences): no orphans, no duplicates.

Skipped, with the reason, only where the machine cannot run the real node or build the images.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster_helpers import (
    BIN,
    CLUSTER_SH,
    EXAMPLES,
    REPO,
    ExternalOperator,
    Kubectl,
    audit_log_path,
    audited_writes,
    create_namespace,
    port_forward,
    wait_for,
    wait_ready,
)
from local_images import build_local_images
from openai import OpenAI
from sovereign_runtime.builtin.tasks import make_questions
from test_real_pods import (
    READY_TIMEOUT,
    SMALL,
    ask,
    assert_mostly_correct,
    endpoint_service,
    restarts,
    wait_for_server,
    worker_pods,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

CHART = REPO / "charts" / "sovereign"
HELM = BIN / "helm"
INSTANCE = "app.kubernetes.io/instance"
OPERATOR_SELECTOR = "app.kubernetes.io/component=operator"
# What the operator creates for an LLMDeployment (tests/cluster/test_operator_rbac.py's CHILDREN).
CHILD_KINDS = (
    "statefulsets,deployments,services,configmaps,serviceaccounts,poddisruptionbudgets,roles,rolebindings,"
    "networkpolicies"
)
# What Kubernetes puts in every namespace by itself.
NAMESPACE_DEFAULTS = {"ConfigMap/kube-root-ca.crt", "ServiceAccount/default"}
RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted"}
LEASE = "sovereign-operator"  # the chart's Lease (the operator's --leader-election-id default)


@dataclass
class InClusterOperator:
    """The chart's release: where it lives, what it watches, the identity it acts as."""

    handle: ExternalOperator
    release: str
    namespace: str
    watched: str
    user: str
    installed_at: float

    def pods(self) -> list[dict[str, Any]]:
        pods = self.handle.kube.items("pods", "-n", self.namespace, "-l", self.selector)
        return [p for p in pods if not p["metadata"].get("deletionTimestamp")]

    @property
    def selector(self) -> str:
        return f"{INSTANCE}={self.release},{OPERATOR_SELECTOR}"

    def leader(self) -> str:
        lease = self.handle.kube.get_or_none("lease", LEASE, "-n", self.namespace)
        return str((lease or {}).get("spec", {}).get("holderIdentity") or "")

    def logs(self) -> str:
        texts = []
        for pod in self.handle.kube.items("pods", "-n", self.namespace, "-l", self.selector):
            name = pod["metadata"]["name"]
            proc = self.handle.kube.run("logs", "-n", self.namespace, name, check=False)
            texts.append(f"--- {name}\n{proc.stdout}{proc.stderr}")
        return "\n".join(texts)


def helm(kube: Kubectl, home: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    # Helm's cache and config under the test's own directory, never the user's ~/.config/helm.
    env = {
        **os.environ,
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }
    cmd = [str(HELM), "--kubeconfig", str(kube.kubeconfig), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)


def chart_values(operator_ref: str, runtime_ref: str, watched: str) -> dict[str, Any]:
    operator_repo, operator_tag = operator_ref.rsplit(":", 1)
    runtime_repo, runtime_tag = runtime_ref.rsplit(":", 1)
    return {
        "image": {"repository": operator_repo, "tag": operator_tag, "pullPolicy": "IfNotPresent"},
        "runtimeImage": {"repository": runtime_repo, "tag": runtime_tag},
        "operator": {"watchNamespaces": [watched]},
        # The real node, never kwok's fake ones (their pods run nothing).
        "nodeSelector": {"sovereign.ai/real-node": "true"},
    }


@pytest.fixture(scope="module")
def in_cluster_operator(
    kube: Kubectl,
    real_node_name: str,
    real_node_runtime_image: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[InClusterOperator]:
    """The chart installed with the operator image built here, watching a namespace of its own."""
    if not HELM.exists():
        pytest.skip(f"needs helm at {HELM} (built with the local control plane: make tools)")
    image = build_local_images()["images"]["operator"]
    imported = subprocess.run(
        [str(CLUSTER_SH), "import-image", image["archive"]], capture_output=True, text=True, timeout=1200
    )
    assert imported.returncode == 0, imported.stdout[-2000:] + imported.stderr[-2000:]

    suffix = secrets.token_hex(3)
    # Not the session's `t<hex>-` prefix: the session's local operator must not watch these.
    release, namespace, watched = f"sov-{suffix}", f"sov-system-{suffix}", f"sov-ic-{suffix}"
    home = tmp_path_factory.mktemp("helm")
    values = home / "values.yaml"
    values.write_text(yaml.safe_dump(chart_values(str(image["ref"]), real_node_runtime_image, watched)))
    installed_at = time.time()
    try:
        for name in (namespace, watched):
            create_namespace(kube, name, fake_nodes=False)
            kube.run("label", "namespace", name, *(f"{k}={v}" for k, v in RESTRICTED.items()))
        # --skip-crds: the session applied crds/ already (the chart's copy is the same file).
        installed = helm(
            kube,
            home,
            "install",
            release,
            str(CHART),
            "--namespace",
            namespace,
            "--values",
            str(values),
            "--skip-crds",
            "--wait",
            "--timeout",
            "5m",
        )
        operator = InClusterOperator(
            handle=ExternalOperator(kube, namespace, f"{INSTANCE}={release},{OPERATOR_SELECTOR}"),
            release=release,
            namespace=namespace,
            watched=watched,
            user=f"system:serviceaccount:{namespace}:{release}-sovereign",
            installed_at=installed_at,
        )
        assert installed.returncode == 0, installed.stderr[-3000:] + "\n" + operator.logs()[-3000:]
        yield operator
    finally:
        # The LLMDeployments first, while the operator still runs, then their pods (grace periods).
        kube.run("delete", "llmd", "--all", "-n", watched, "--wait=true", check=False, timeout=120)
        wait_for(f"the pods of {watched} gone", lambda: not kube.items("pods", "-n", watched), timeout=180)
        uninstalled = helm(kube, home, "uninstall", release, "--namespace", namespace, "--wait")
        for name in (watched, namespace):
            kube.run("delete", "namespace", name, "--wait=true", "--timeout=120s", check=False, timeout=150)
        # "not found": the setup failed before `helm install` made the release; its own error stands.
        assert uninstalled.returncode == 0 or "not found" in uninstalled.stderr, uninstalled.stderr


@pytest.fixture(scope="module")
def tiny(kube: Kubectl, in_cluster_operator: InClusterOperator) -> dict[str, Any]:
    """`examples/tiny.yaml` as a user applies it, Ready through the in-cluster operator."""
    op = in_cluster_operator
    kube.run("apply", "-n", op.watched, "-f", str(EXAMPLES / "tiny.yaml"))
    return wait_ready(kube, op.handle, op.watched, "tiny", timeout=READY_TIMEOUT)


def test_the_chart_installs_the_operator_from_its_image_on_the_real_node(
    kube: Kubectl, in_cluster_operator: InClusterOperator, real_node_name: str
) -> None:
    op = in_cluster_operator
    deployment = kube.get("deployment", "-n", op.namespace, "-l", op.selector)["items"][0]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["imagePullPolicy"] == "IfNotPresent", container
    pods = op.pods()
    assert len(pods) == deployment["spec"]["replicas"] == 2, [p["metadata"]["name"] for p in pods]
    for pod in pods:
        assert pod["spec"]["nodeName"] == real_node_name, pod["spec"].get("nodeName")
        (status,) = pod["status"]["containerStatuses"]
        assert status["ready"] and status["image"] == container["image"], status
        assert status["imageID"], status  # a real runtime ran this image, not kwok
        assert pod["spec"]["serviceAccountName"] == op.user.rsplit(":", 1)[1]
    # One replica acts (holds the Lease); the other waits.
    wait_for("a leader", op.leader, timeout=60)
    assert op.leader() in {p["metadata"]["name"] for p in pods}
    # The operator's own container is confined by the kubelet as its chart asks.
    leader = op.leader()
    checks = exec_security_checks(kube, op.namespace, leader, writable=("/tmp",))
    assert not checks, checks


def test_the_in_cluster_operator_reconciles_tiny_on_the_real_node_with_the_charts_rbac(
    kube: Kubectl, in_cluster_operator: InClusterOperator, tiny: dict[str, Any], real_node_name: str
) -> None:
    op = in_cluster_operator
    pods = kube.items("pods", "-n", op.watched, "-l", f"{INSTANCE}=tiny")
    assert pods and {p["spec"]["nodeName"] for p in pods} == {real_node_name}
    (worker,) = worker_pods(kube, op.watched, "tiny")
    assert restarts(worker) == 0, worker["status"]

    # Who wrote what: the chart's ServiceAccount wrote the status and created the children; no other
    # identity running an operator (the session's local one, sovereign-system/*) wrote anything here.
    path = audit_log_path(kube)
    assert path is not None, "the local cluster keeps an audit log of writes (cluster.sh audit-log)"
    writes = [
        e
        for e in audited_writes(path, op.user, op.installed_at)
        if e.get("objectRef", {}).get("namespace") == op.watched
    ]
    status_writes = [
        e
        for e in writes
        if e["objectRef"].get("resource") == "llmdeployments"
        and e["objectRef"].get("subresource") == "status"
    ]
    # 409s are optimistic concurrency at work (a status patch raced a newer resourceVersion, retried).
    assert any(e["responseStatus"]["code"] == 200 for e in status_writes), status_writes[:3]
    # Children are server-side applied: a patch that answers 201 created the object.
    created = {e["objectRef"]["resource"] for e in writes if e["responseStatus"]["code"] == 201}
    assert {"statefulsets", "deployments", "services"} <= created, created
    # (The control plane's controllers write here too, as kwok-admin or system:node:*.)
    others = [
        (user, e["verb"], e["objectRef"].get("resource"))
        for e in audited_writes(path, None, op.installed_at)
        if e.get("objectRef", {}).get("namespace") == op.watched
        and (user := e["user"]["username"]).startswith("system:serviceaccount:")
        and user != op.user
    ]
    assert not others, others

    model = tiny["spec"]["model"]["name"]
    service, port = endpoint_service(tiny)
    with port_forward(kube, op.watched, service, port) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=60, max_retries=0)
        wait_for_server(client)
        questions = make_questions(3, seed=21)
        answers = ask(client, model, questions)
    assert_mostly_correct(questions, answers)


def exec_in(kube: Kubectl, ns: str, pod: str, *command: str) -> subprocess.CompletedProcess[str]:
    return kube.run("exec", "-n", ns, pod, "--", *command, check=False, timeout=60)


def proc_status(kube: Kubectl, ns: str, pod: str) -> dict[str, str]:
    """/proc/self/status of a process the kubelet started in the container (exec gets its settings)."""
    text = exec_in(kube, ns, pod, "cat", "/proc/self/status").stdout
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())}


def exec_security_checks(kube: Kubectl, ns: str, pod: str, writable: tuple[str, ...]) -> list[str]:
    """What is wrong with the container's confinement, seen from inside it; empty when none is."""
    wrong = []
    uid = exec_in(kube, ns, pod, "id", "-u")
    if uid.returncode != 0 or uid.stdout.strip() in {"", "0"}:
        wrong.append(f"id -u: {uid.stdout.strip()!r} {uid.stderr.strip()!r}")
    status = proc_status(kube, ns, pod)
    expected = {"NoNewPrivs": "1", "CapEff": "0" * 16, "Seccomp": "2"}  # 2: a filter (RuntimeDefault)
    for key, value in expected.items():
        if status.get(key) != value:
            wrong.append(f"/proc/self/status {key}: {status.get(key)!r}, expected {value!r}")
    root = exec_in(kube, ns, pod, "touch", "/written-by-the-test")
    if root.returncode == 0 or "Read-only file system" not in root.stderr:
        wrong.append(f"writing to / did not fail with EROFS: rc {root.returncode}, {root.stderr.strip()!r}")
    for directory in writable:
        probe = exec_in(kube, ns, pod, "touch", f"{directory}/written-by-the-test")
        if probe.returncode != 0:
            wrong.append(f"{directory} is not writable: {probe.stderr.strip()!r}")
    return wrong


def test_the_kubelet_confines_the_runtime_pods_and_they_still_serve(
    kube: Kubectl, in_cluster_operator: InClusterOperator, tiny: dict[str, Any]
) -> None:
    ns = in_cluster_operator.watched
    (worker,) = worker_pods(kube, ns, "tiny")
    routers = kube.items("pods", "-n", ns, "-l", f"{INSTANCE}=tiny,app.kubernetes.io/component=router")
    assert routers, "no router pod"
    worker_spec = worker["spec"]["containers"][0]
    # The worker's writable places are volumes, as rendered: every other path is the read-only image.
    writable = tuple(
        m["mountPath"] for m in worker_spec["volumeMounts"] if not m.get("readOnly") and m["name"] != "dshm"
    )
    assert "/tmp" in writable, writable
    wrong = {
        worker["metadata"]["name"]: exec_security_checks(kube, ns, worker["metadata"]["name"], writable),
        **{
            r["metadata"]["name"]: exec_security_checks(kube, ns, r["metadata"]["name"], writable=())
            for r in routers
        },
    }
    assert not any(wrong.values()), wrong
    # HOME is in the image (read-only); what the runtime caches there goes to a volume.
    home = exec_in(kube, ns, worker["metadata"]["name"], "sh", "-c", "echo $HOME").stdout.strip()
    assert home and any(path.startswith(home) for path in writable), (home, writable)
    # Confined as it is, it serves: Ready, never restarted, and answers (the previous test asked it).
    assert restarts(worker) == 0, worker["status"]
    model = tiny["spec"]["model"]["name"]
    service, port = endpoint_service(tiny)
    with port_forward(kube, ns, service, port) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=60, max_retries=0)
        wait_for_server(client)
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=8
        )
    assert reply.choices[0].message.content is not None


def children(kube: Kubectl, ns: str) -> dict[str, dict[str, Any]]:
    """Every object of the kinds the operator creates in the namespace, by kind/name, but those
    Kubernetes and the chart put there."""
    out = {}
    for obj in kube.items(CHILD_KINDS, "-n", ns):
        key = f"{obj['kind']}/{obj['metadata']['name']}"
        # The chart's own RoleBinding (its RBAC, bound in the watched namespace) is Helm's, not a child.
        from_chart = obj["metadata"].get("labels", {}).get("app.kubernetes.io/managed-by") == "Helm"
        if key not in NAMESPACE_DEFAULTS and not from_chart:
            out[key] = obj
    return out


def controller_uids(obj: dict[str, Any]) -> list[str]:
    return [r["uid"] for r in obj["metadata"].get("ownerReferences", []) if r.get("controller")]


# Two ways the leading operator dies mid-rollout. Deleted (an eviction, a drained node, `kubectl
# delete`): the kubelet stops it with SIGTERM, it releases the Lease, the standby takes it and the
# Deployment makes a new pod. Crashed (SIGKILL to its processes, as the OOM killer would): nothing is
# released and the kubelet restarts the container in the same pod; whichever comes first holds the
# Lease next: the standby, once the Lease has stood unrenewed for its duration, or the restarted
# process, which has the pod's name as its identity and renews it. Each starts a rollout of its own;
# the second's patch holds the first's, so either runs alone.
ROLLOUTS: dict[str, dict[str, Any]] = {
    "pod-deleted": {"decode": {"replicas": 2}, "runtime": {"resources": SMALL}},
    "process-killed": {
        "decode": {"replicas": 2},
        "runtime": {"resources": SMALL, "env": [{"name": "SOVEREIGN_TEST_ROLLOUT", "value": "2"}]},
    },
}


@pytest.mark.parametrize("death", list(ROLLOUTS))
def test_the_leading_operator_dies_mid_rollout_and_it_converges_without_orphans_or_duplicates(
    kube: Kubectl, in_cluster_operator: InClusterOperator, tiny: dict[str, Any], death: str
) -> None:
    op, ns = in_cluster_operator, in_cluster_operator.watched
    uid = tiny["metadata"]["uid"]
    wait_for("both operator pods Ready", lambda: len(ready_operator_pods(op)) == 2, timeout=180)
    before = {key: obj["metadata"]["uid"] for key, obj in children(kube, ns).items()}
    assert "StatefulSet/tiny-unified" in before, sorted(before)
    leader = wait_for("a leader", op.leader, timeout=60)
    operator_pods = {p["metadata"]["name"]: restarts(p) for p in op.pods()}

    rollout = ROLLOUTS[death]
    kube.run("patch", "llmd", "tiny", "-n", ns, "--type=merge", "-p", json.dumps({"spec": rollout}))
    # Right away: the new pods are tens of seconds from Ready.
    if death == "pod-deleted":
        kube.run("delete", "pod", "-n", op.namespace, leader, "--grace-period=0", "--force", "--wait=false")
    else:
        kill_container(kube, op.namespace, leader)
    killed = time.monotonic()
    # Mid-rollout indeed: the workers are not all of the new template and Ready yet.
    assert not rollout_done(kube, ns, rollout), kube.get("statefulset", "-n", ns, "tiny-unified")["status"]

    obj = wait_ready(kube, op.handle, ns, "tiny", timeout=READY_TIMEOUT)
    # Two pod starts one after the other (the StatefulSet's ordered rollout) and a drain.
    wait_for("the rollout to finish", lambda: rollout_done(kube, ns, rollout), timeout=2 * READY_TIMEOUT)
    converged = time.monotonic() - killed
    wait_for("both operator pods Ready again", lambda: len(ready_operator_pods(op)) == 2, timeout=180)
    holder = op.leader()
    now = {p["metadata"]["name"]: restarts(p) for p in ready_operator_pods(op)}
    assert holder in now, (holder, now)  # a live operator holds the Lease
    if holder != leader:
        assert f"{holder} acquired Lease {op.namespace}/{LEASE}" in op.logs(), op.logs()[-3000:]
    if death == "pod-deleted":
        # The standby took over (the deleted pod released the Lease); the Deployment replaced the pod.
        assert holder != leader, holder
        assert leader not in now and len(set(now) - set(operator_pods)) == 1, (leader, operator_pods, now)
    else:
        # The kubelet restarted the killed container in place.
        assert set(now) == set(operator_pods) and now[leader] > operator_pods[leader], (operator_pods, now)

    after = children(kube, ns)
    # No duplicates: the same objects (name and uid) as before the rollout, each owned by the
    # LLMDeployment as its controller; no orphans: nothing else of those kinds in the namespace.
    assert {key: o["metadata"]["uid"] for key, o in after.items()} == before, (before, sorted(after))
    unowned = [key for key, o in after.items() if controller_uids(o) != [uid]]
    assert not unowned, unowned
    pods = kube.items("pods", "-n", ns)
    names = sorted(p["metadata"]["name"] for p in pods if not p["metadata"].get("deletionTimestamp"))
    workers = [n for n in names if n.startswith("tiny-unified-")]
    assert workers == ["tiny-unified-0", "tiny-unified-1"], names
    # Every pod belongs to a child: a worker to the StatefulSet, a router to a ReplicaSet of the
    # router Deployment.
    owners = {o["metadata"]["uid"] for o in after.values()}
    owners |= {
        rs["metadata"]["uid"]
        for rs in kube.items("replicasets", "-n", ns)
        if set(controller_uids(rs)) & owners
    }
    strays = [p["metadata"]["name"] for p in pods if not set(controller_uids(p)) & owners]
    assert not strays, strays
    assert obj["status"]["observedGeneration"] == obj["metadata"]["generation"]
    print(
        f"\nin-cluster operator, {death}: {leader} died mid-rollout; the Lease is held by "
        f"{'the restarted process' if holder == leader else 'the standby ' + holder}; the rollout "
        f"converged {converged:.1f} s after the kill"
    )


def rollout_done(kube: Kubectl, ns: str, rollout: dict[str, Any]) -> bool:
    """The workers' StatefulSet has the rollout's replicas, resources and environment, and all its
    pods are of that revision and Ready."""
    sts = kube.get("statefulset", "-n", ns, "tiny-unified")
    container = sts["spec"]["template"]["spec"]["containers"][0]
    wanted = rollout["runtime"]
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    if (
        sts["spec"]["replicas"] != rollout["decode"]["replicas"]
        or container["resources"]["requests"]["cpu"] != wanted["resources"]["requests"]["cpu"]
        or any(env.get(e["name"]) != e["value"] for e in wanted.get("env", []))
        or sts["status"].get("observedGeneration") != sts["metadata"]["generation"]
    ):
        return False
    revision = sts["status"].get("updateRevision")
    pods = worker_pods(kube, ns, "tiny")
    return (
        len(pods) == sts["spec"]["replicas"]
        and all(pod_ready(p) for p in pods)
        and {p["metadata"]["labels"].get("controller-revision-hash") for p in pods} == {revision}
    )


def kill_container(kube: Kubectl, ns: str, pod_name: str) -> None:
    """SIGKILL every process of the pod's container, from this machine (the real node shares its PID
    namespace): a crash, with no chance to release anything."""
    pod = kube.get("pod", "-n", ns, pod_name)
    (status,) = pod["status"]["containerStatuses"]
    container_id = status["containerID"].split("://", 1)[1]
    pids = []
    for cgroup in Path("/proc").glob("[0-9]*/cgroup"):
        try:
            if container_id in cgroup.read_text():
                pids.append(int(cgroup.parent.name))
        except OSError:
            continue  # a process that just exited
    assert pids, f"no process of container {container_id} ({pod_name}) on this machine"
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def pod_ready(pod: dict[str, Any]) -> bool:
    return any(
        c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", [])
    )


def ready_operator_pods(op: InClusterOperator) -> list[dict[str, Any]]:
    return [p for p in op.pods() if pod_ready(p)]
