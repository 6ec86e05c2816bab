"""Install the chart into a real control plane (the local one, or the cluster KUBECONFIG names).

- `helm install` creates every object, and the operator pod is admitted in a namespace that
  enforces the `restricted` Pod Security Standard.
- The chart's RBAC is sufficient: impersonating the chart's ServiceAccount, every child the
  operator renders for the examples passes a server-side-apply dry run, and the verbs the operator
  uses on LLMDeployments, nodes and events are allowed.
- GitOps: after the operator reconciles an LLMDeployment applied the way Argo CD applies it
  (server-side apply), the live spec equals what Git holds, with the apiserver's defaults: the
  operator owns no field of `spec` and never bumps `metadata.generation`.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging_helpers import CHART, REPO, TOOLS_DIR, find_tool, kube_version, unavailable

pytestmark = pytest.mark.cluster

LOCAL_KUBECONFIG = REPO / ".cluster" / "kubeconfig"
GIT_MANAGER = "argocd-controller"  # the field manager Argo CD's server-side apply uses


def _reachable(kubectl: str, kubeconfig: Path) -> bool:
    if not kubeconfig.is_file():
        return False
    proc = subprocess.run(
        [kubectl, "--kubeconfig", str(kubeconfig), "get", "--raw", "/readyz"],
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    return proc.returncode == 0


class Cluster:
    def __init__(self, kubectl: str, helm: str, kubeconfig: Path) -> None:
        self.kubectl_bin, self.helm_bin, self.kubeconfig = kubectl, helm, kubeconfig

    def kubectl(
        self, *args: str, stdin: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess:
        cmd = [self.kubectl_bin, "--kubeconfig", str(self.kubeconfig), *args]
        proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=180)
        if check:
            assert proc.returncode == 0, f"kubectl {' '.join(args)}: {proc.stderr.strip()}"
        return proc

    def get(self, *args: str) -> dict[str, Any]:
        return json.loads(self.kubectl("get", "-o", "json", *args).stdout)

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        cmd = [self.helm_bin, "--kubeconfig", str(self.kubeconfig), *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if check:
            assert proc.returncode == 0, f"helm {' '.join(args)}: {proc.stderr.strip()}"
        return proc


def wait_for(what: str, check, timeout: float = 90, interval: float = 1.0):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


@pytest.fixture(scope="module")
def cluster() -> Cluster:
    kubectl = find_tool("kubectl")
    helm = find_tool("helm")
    named = os.environ.get("KUBECONFIG")
    for candidate in [Path(named)] if named else []:
        if _reachable(kubectl, candidate):
            return Cluster(kubectl, helm, candidate)
    if not _reachable(kubectl, LOCAL_KUBECONFIG):
        if not (TOOLS_DIR / "kube-apiserver").is_file():
            unavailable("no cluster: KUBECONFIG unset/unreachable and the local control plane is not built")
        subprocess.run([str(REPO / "e2e/cluster/cluster.sh"), "up"], check=True, timeout=3600)
    return Cluster(kubectl, helm, LOCAL_KUBECONFIG)


@pytest.fixture(scope="module")
def release(cluster: Cluster) -> Iterator[dict[str, str]]:
    """The chart installed as a unique release in a namespace enforcing `restricted`."""
    suffix = secrets.token_hex(3)
    rel = {"name": f"chart-{suffix}", "namespace": f"t-chart-{suffix}"}
    cluster.kubectl("create", "namespace", rel["namespace"])
    cluster.kubectl(
        "label", "namespace", rel["namespace"], "pod-security.kubernetes.io/enforce=restricted", "--overwrite"
    )
    cluster.helm(
        "install",
        rel["name"],
        str(CHART),
        "--namespace",
        rel["namespace"],
        "--set",
        "grafanaDashboard.enabled=true",
        "--set",
        "argocd.healthCheck.enabled=true",
        "--set",
        "admissionPolicy.forbidHostPath=true",
        # Where pods really run (kind), this release's operator starts: keep it to its own namespace
        # so it never competes with the operator the cluster already has for the tests' objects.
        "--set",
        f"operator.watchNamespaces={{{rel['namespace']}}}",
    )
    rel["fullname"] = f"{rel['name']}-sovereign"
    rel["sa"] = f"system:serviceaccount:{rel['namespace']}:{rel['fullname']}"
    yield rel
    cluster.helm("uninstall", rel["name"], "--namespace", rel["namespace"], "--wait", check=False)
    cluster.kubectl("delete", "namespace", rel["namespace"], "--wait=false", check=False)


def test_install_creates_every_object(cluster: Cluster, release: dict[str, str]):
    ns, name = release["namespace"], release["fullname"]
    cluster.kubectl("wait", "--for=condition=Established", "crd/llmdeployments.sovereign.ai", "--timeout=60s")
    for kind, obj in [
        ("deployment", name),
        ("serviceaccount", name),
        ("service", f"{name}-metrics"),
        ("configmap", f"{name}-dashboard"),
        ("configmap", f"{name}-argocd-health"),
    ]:
        assert (
            cluster.get("-n", ns, kind, obj)["metadata"]["labels"]["app.kubernetes.io/instance"]
            == release["name"]
        )
    role = cluster.get("clusterrole", name)
    rules = yaml.safe_load((CHART / "files" / "operator-rbac-rules.yaml").read_text())
    assert len(role["rules"]) == len(rules["rules"] if isinstance(rules, dict) else rules)
    # The release watches its own namespace only: the rules are bound there, not cluster-wide.
    binding = cluster.get("-n", ns, "rolebinding", name)
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": name,
    }
    assert binding["subjects"][0] == {"kind": "ServiceAccount", "name": name, "namespace": ns}
    reads = cluster.get("clusterrolebinding", f"{name}-cluster")
    assert reads["subjects"][0] == {"kind": "ServiceAccount", "name": name, "namespace": ns}
    notes = cluster.helm("get", "notes", release["name"], "--namespace", ns).stdout
    assert f"rollout status deployment/{name}" in notes and f"{name}-argocd-health" in notes


def test_operator_pod_is_admitted_under_restricted(cluster: Cluster, release: dict[str, str]):
    ns = release["namespace"]
    selector = f"app.kubernetes.io/instance={release['name']},app.kubernetes.io/component=operator"

    def pods():
        return cluster.get("-n", ns, "pods", "-l", selector)["items"]

    def replica_set_failure() -> str:
        for rs in cluster.get("-n", ns, "replicasets", "-l", selector)["items"]:
            for condition in rs.get("status", {}).get("conditions", []):
                if condition["type"] == "ReplicaFailure":
                    return condition.get("message", "")
        return ""

    # Pod Security admission rejects a non-compliant pod at creation: the ReplicaSet then
    # reports ReplicaFailure instead of a pod appearing.
    wait_for("the operator pod to be created", lambda: pods() or replica_set_failure(), timeout=120)
    assert not replica_set_failure(), replica_set_failure()
    # Two replicas by default: one holds the leader-election Lease, the other waits.
    wait_for("both operator replicas", lambda: len(pods()) == 2, timeout=120)


def _llmd_with_source(name: str, source: dict[str, Any]) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "sovereign.ai/v1alpha1",
            "kind": "LLMDeployment",
            "metadata": {"name": name},
            "spec": {"model": {"name": "m", "source": source, "weightsGiB": 1}},
        }
    )


def test_forbid_host_path_refuses_host_paths_at_admission(cluster: Cluster, release: dict[str, str]):
    ns = release["namespace"]

    def create(name: str, source: dict[str, Any]) -> subprocess.CompletedProcess:
        stdin = _llmd_with_source(name, source)
        return cluster.kubectl("create", "--dry-run=server", "-n", ns, "-f", "-", stdin=stdin, check=False)

    # The apiserver starts enforcing a new policy within seconds (its informer syncs).
    refused = wait_for(
        "the hostPath policy to be enforced",
        lambda: (proc := create("host", {"hostPath": {"path": "/models"}})).returncode != 0 and proc,
        timeout=60,
    )
    assert "spec.model.source.hostPath is forbidden" in refused.stderr
    assert "admissionPolicy.forbidHostPath" in refused.stderr
    allowed = create("pvc", {"pvc": {"claimName": "weights"}})
    assert allowed.returncode == 0, allowed.stderr


def as_operator(cluster: Cluster, release: dict[str, str], *args: str, stdin: str | None = None):
    return cluster.kubectl("--as", release["sa"], *args, stdin=stdin, check=False)


@pytest.mark.parametrize(
    "verb,resource",
    [
        ("watch", "llmdeployments.sovereign.ai"),
        ("patch", "llmdeployments.sovereign.ai/status"),
        ("list", "nodes"),
        ("watch", "pods"),
        ("create", "events"),
        ("create", "statefulsets.apps"),
    ],
)
def test_chart_rbac_grants_the_operators_verbs(
    cluster: Cluster, release: dict[str, str], verb: str, resource: str
):
    # In the namespace it watches (tests/cluster/test_operator_rbac.py has the whole matrix).
    proc = as_operator(cluster, release, "auth", "can-i", verb, resource, "-n", release["namespace"])
    assert proc.stdout.strip() == "yes", (
        f"{release['sa']} cannot {verb} {resource}: {proc.stdout}{proc.stderr}"
    )


def test_chart_rbac_denies_what_the_operator_does_not_need(cluster: Cluster, release: dict[str, str]):
    for verb, resource in [("get", "secrets"), ("delete", "nodes"), ("create", "clusterroles")]:
        proc = as_operator(cluster, release, "auth", "can-i", verb, resource, "--all-namespaces")
        assert proc.stdout.strip() == "no", f"{release['sa']} may {verb} {resource}"


def test_chart_rbac_grants_the_lease_only_in_the_release_namespace(cluster: Cluster, release: dict[str, str]):
    ns = release["namespace"]
    for verb in ("get", "create", "update"):
        proc = as_operator(cluster, release, "auth", "can-i", verb, "leases.coordination.k8s.io", "-n", ns)
        assert proc.stdout.strip() == "yes", f"{release['sa']} cannot {verb} leases in {ns}"
    proc = as_operator(
        cluster, release, "auth", "can-i", "update", "leases.coordination.k8s.io", "-n", "default"
    )
    assert proc.stdout.strip() == "no", f"{release['sa']} may update leases outside its namespace"


@pytest.mark.parametrize(
    "example,rdma", [("tiny.yaml", "no"), ("deepseek-v3-pd.yaml", "yes"), ("deepseek-v3-h100.yaml", "yes")]
)
def test_chart_rbac_suffices_to_apply_every_child(
    cluster: Cluster, release: dict[str, str], example: str, rdma: str
):
    ns = release["namespace"]
    # Its multi-node pools render LeaderWorkerSets. The local control plane always installs the CRD
    # (there its absence is a broken setup); another cluster may not have it.
    lws_crd = "leaderworkersets.leaderworkerset.x-k8s.io"
    if (
        example == "deepseek-v3-h100.yaml"
        and (lws := cluster.kubectl("get", "crd", lws_crd, check=False)).returncode
    ):
        assert cluster.kubeconfig != LOCAL_KUBECONFIG, lws.stderr
        pytest.skip(
            "LeaderWorkerSet is not installed on this cluster (e2e/cluster/cluster.sh up installs it)"
        )
    rendered = subprocess.run(
        [
            str(Path(sys.executable).parent / "sovereign-operator"),
            "render",
            "-f",
            str(REPO / "examples" / example),
            "--namespace",
            ns,
            "--rdma-nodes",
            rdma,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert rendered.returncode == 0, rendered.stderr
    children = [d for d in yaml.safe_load_all(rendered.stdout) if d]
    assert {c["kind"] for c in children} >= {"Service"} and {c["kind"] for c in children} & {
        "StatefulSet",
        "LeaderWorkerSet",
    }
    for child in children:
        child["metadata"].pop("ownerReferences", None)  # the owner is not created here
        if child["kind"] in ("StatefulSet", "Deployment", "LeaderWorkerSet"):
            child["spec"]["replicas"] = 0  # objects only: leave the fake GPU nodes to other tests
    # Applied for real, in order: a RoleBinding is authorised against its Role, which a dry run
    # would not have created. The release namespace is deleted afterwards.
    proc = as_operator(
        cluster,
        release,
        "apply",
        "--server-side",
        "--field-manager=sovereign-operator",
        "-n",
        ns,
        "-f",
        "-",
        stdin=yaml.safe_dump_all(children),
    )
    assert proc.returncode == 0, proc.stderr


def test_live_spec_equals_git(cluster: Cluster, release: dict[str, str], tmp_path: Path):
    ns = release["namespace"]
    manifest = (REPO / "examples" / "tiny.yaml").read_text()
    name = yaml.safe_load(manifest)["metadata"]["name"]
    # What Argo CD's server-side diff compares against: Git's manifest with the apiserver's defaults.
    expected = json.loads(
        cluster.kubectl(
            "apply",
            "--server-side",
            "--dry-run=server",
            f"--field-manager={GIT_MANAGER}",
            "-n",
            ns,
            "-o",
            "json",
            "-f",
            "-",
            stdin=manifest,
        ).stdout
    )["spec"]
    cluster.kubectl(
        "apply", "--server-side", f"--field-manager={GIT_MANAGER}", "-n", ns, "-f", "-", stdin=manifest
    )

    operator = None
    try:
        if not _observed(cluster, ns, name, timeout=20):
            # No operator watches this namespace (tests/cluster's session operator is not running):
            # run one scoped to it, as the chart's ServiceAccount.
            operator = _start_operator(cluster, release, tmp_path)
            assert _observed(cluster, ns, name, timeout=120), _tail(tmp_path)
        time.sleep(5)  # a few more reconcile passes: nothing may creep into spec meanwhile
        live = cluster.get("-n", ns, "llmdeployment", name, "--show-managed-fields")
    finally:
        if operator is not None:
            operator.terminate()
            operator.wait(timeout=30)
        cluster.kubectl("delete", "-n", ns, "llmdeployment", name, "--wait=false", check=False)

    assert live["spec"] == expected
    assert live["metadata"]["generation"] == 1, "something rewrote spec after Git applied it"
    spec_owners = {
        entry["manager"]
        for entry in live["metadata"].get("managedFields", [])
        if entry.get("subresource") != "status" and "f:spec" in entry.get("fieldsV1", {})
    }
    assert spec_owners == {GIT_MANAGER}


def _observed(cluster: Cluster, ns: str, name: str, timeout: float) -> bool:
    def check():
        obj = cluster.get("-n", ns, "llmdeployment", name)
        status = obj.get("status") or {}
        return status.get("observedGeneration") == obj["metadata"]["generation"] and status.get("conditions")

    try:
        wait_for(f"llmdeployment/{name} to be reconciled", check, timeout=timeout)
        return True
    except AssertionError:
        return False


def _start_operator(cluster: Cluster, release: dict[str, str], tmp_path: Path) -> subprocess.Popen:
    config = json.loads(cluster.kubectl("config", "view", "--raw", "--minify", "-o", "json").stdout)
    config["users"][0]["user"]["as"] = release["sa"]  # impersonate the chart's ServiceAccount
    kubeconfig = tmp_path / "operator.kubeconfig"
    kubeconfig.write_text(json.dumps(config))
    log = (tmp_path / "operator.log").open("w")
    return subprocess.Popen(
        [
            str(Path(sys.executable).parent / "sovereign-operator"),
            "run",
            "--namespace",
            release["namespace"],
            "--health-port",
            "0",
        ],
        env={**os.environ, "KUBECONFIG": str(kubeconfig)},
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _tail(tmp_path: Path) -> str:
    path = tmp_path / "operator.log"
    return path.read_text()[-3000:] if path.is_file() else ""


def test_kube_version_pin_matches_the_chart():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    floor = chart["kubeVersion"].lstrip(">=").split("-")[0]
    assert tuple(map(int, kube_version().lstrip("v").split(".")[:2])) >= tuple(map(int, floor.split(".")[:2]))
