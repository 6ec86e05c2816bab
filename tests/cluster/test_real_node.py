"""The local cluster's real node: a kubelet with containerd, runc, CNI, kube-proxy and CoreDNS beside
kwok's fake GPU nodes (e2e/cluster/node/node.py).

The pods run the one-layer image of e2e/cluster/node/testserver (an HTTP server whose binary is also
the client the tests exec inside pods), imported with `cluster.sh import-image` and never pulled.
Skipped, with the reason, where this machine cannot run the node (not root, no cgroups/overlayfs/
namespaces); everything else on the local cluster runs them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from cluster_helpers import BIN, CLUSTER_SH, KUBECTL, REPO, Kubectl, wait_for

pytestmark = pytest.mark.cluster

VERSIONS = dict(
    line.split("=", 1)
    for line in (REPO / "e2e" / "cluster" / "versions.env").read_text().splitlines()
    if "=" in line and not line.startswith("#")
)
IMAGE = VERSIONS["TESTSERVER_IMAGE"]
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def node_py() -> ModuleType:
    """e2e/cluster/node/node.py (a script, not a package)."""
    spec = importlib.util.spec_from_file_location("node", REPO / "e2e" / "cluster" / "node" / "node.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def pod(name: str, args: list[str], **container: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {"name": "main", "image": IMAGE, "imagePullPolicy": "IfNotPresent", "args": args, **container}
            ],
        },
    }


def server(name: str) -> dict[str, Any]:
    """The test server, Ready only once a real HTTP readiness probe passes (not before 2 s)."""
    return pod(
        name,
        ["serve", "-port", "8080", "-ready-after", "2s"],
        ports=[{"containerPort": 8080}],
        readinessProbe={"httpGet": {"path": "/healthz", "port": 8080}, "periodSeconds": 1},
    )


def ready_pod(kube: Kubectl, ns: str, name: str, timeout: float = 90) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        obj = kube.get("pod", "-n", ns, name)
        conditions = {c["type"]: c["status"] for c in obj["status"].get("conditions", [])}
        return obj if conditions.get("Ready") == "True" else None

    return wait_for(f"pod {ns}/{name} to be Ready", ready, timeout=timeout)


def exec_in(
    kube: Kubectl, ns: str, name: str, *argv: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    return kube.run("exec", "-n", ns, name, "--", "/testserver", *argv, check=check, timeout=60)


@pytest.fixture(scope="module")
def images(kube: Kubectl, real_node_name: str) -> None:
    # Idempotent: a second session (or a rerun) finds the image and imports nothing.
    subprocess.run(
        [str(CLUSTER_SH), "import-image", str(BIN / "images" / "testserver.tar")], check=True, timeout=300
    )


@pytest.fixture(scope="module")
def web(kube: Kubectl, real_node_namespace: str, images: None) -> Iterator[dict[str, Any]]:
    """A server pod behind a Service, and a client pod to reach it from, both on the real node."""
    ns = real_node_namespace
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web-0"}, "ports": [{"port": 80, "targetPort": 8080}]},
    }
    kube.apply(
        {"apiVersion": "v1", "kind": "List", "items": [server("web-0"), server("client"), service]}, ns
    )
    yield {"server": ready_pod(kube, ns, "web-0"), "client": ready_pod(kube, ns, "client"), "ns": ns}


def test_pod_runs_on_the_real_node_and_turns_ready_through_its_http_probe(
    kube: Kubectl, web: dict[str, Any], real_node_name: str
) -> None:
    obj = web["server"]
    assert obj["spec"]["nodeName"] == real_node_name
    status = obj["status"]["containerStatuses"][0]
    assert status["ready"] and status["restartCount"] == 0
    assert status["containerID"].startswith("containerd://")
    # The probe really ran: /healthz answers 503 for the first 2 s, so Ready comes later than that.
    started = _epoch(status["state"]["running"]["startedAt"])
    ready = next(c for c in obj["status"]["conditions"] if c["type"] == "Ready")
    assert _epoch(ready["lastTransitionTime"]) - started >= 2
    # A pod IP from the node's bridge, reachable from this host (the operator's health reads need it).
    with urllib.request.urlopen(f"http://{obj['status']['podIP']}:8080/", timeout=10) as resp:
        assert resp.read().decode().startswith("hello from web-0")


def test_a_service_answers_from_another_pod_by_cluster_ip_and_dns_name(
    kube: Kubectl, web: dict[str, Any]
) -> None:
    ns = web["ns"]
    cluster_ip = kube.get("service", "-n", ns, "web")["spec"]["clusterIP"]
    for url in (f"http://{cluster_ip}/", f"http://web.{ns}.svc.cluster.local/", "http://web/"):
        out = exec_in(kube, ns, "client", "get", url).stdout
        assert out.startswith("hello from web-0"), (url, out)
    looked_up = exec_in(kube, ns, "client", "lookup", f"web.{ns}.svc.cluster.local").stdout.split()
    assert looked_up == [cluster_ip]
    # kube-proxy's rules live in the node's network namespace, not in this machine's.
    host_nat = subprocess.run(
        ["iptables", "-t", "nat", "-S"], capture_output=True, text=True, check=True
    ).stdout
    assert "KUBE-SERVICES" not in host_nat
    # Names outside the cluster get an answer at once, and never from the machine's resolver.
    outside = exec_in(kube, ns, "client", "lookup", "pypi.org", check=False)
    assert outside.returncode != 0 and "10.0.0.10" in outside.stderr


def test_in_cluster_clients_verify_the_apiservers_certificate(kube: Kubectl, web: dict[str, Any]) -> None:
    """What client-go does in a pod: https://$KUBERNETES_SERVICE_HOST (10.0.0.1) and
    kubernetes.default.svc, verified against the ServiceAccount's CA, with its token."""
    ns = web["ns"]
    auth = ["-ca", f"{SA_DIR}/ca.crt", "-token-file", f"{SA_DIR}/token"]
    for host in ("10.0.0.1", "kubernetes.default.svc"):
        version = json.loads(exec_in(kube, ns, "client", "get", *auth, f"https://{host}/version").stdout)
        assert version["gitVersion"] == VERSIONS["KUBE_VERSION"]
    # Verification is really on: without the cluster's CA the same request is refused.
    unverified = exec_in(kube, ns, "client", "get", "https://kubernetes.default.svc/version", check=False)
    assert unverified.returncode != 0 and "certificate" in unverified.stderr


def test_logs_exec_and_port_forward_work_from_the_host(kube: Kubectl, web: dict[str, Any]) -> None:
    ns = web["ns"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    forward = subprocess.Popen(
        [
            KUBECTL,
            "--kubeconfig",
            str(kube.kubeconfig),
            "port-forward",
            "-n",
            ns,
            "pod/web-0",
            f"{port}:8080",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert forward.stdout is not None
        line = forward.stdout.readline()
        assert "Forwarding from" in line, line
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/port-forwarded", timeout=10) as resp:
            assert resp.read().decode().startswith("hello from web-0")
    finally:
        forward.terminate()
        forward.wait(timeout=10)
    logs = kube.run("logs", "-n", ns, "web-0").stdout
    assert "serving on" in logs and "GET /port-forwarded" in logs
    # exec runs a second process in the running container (the other tests exec the client).
    assert exec_in(kube, ns, "web-0", "get", "http://127.0.0.1:8080/healthz").stdout.strip() == "ok"


def test_the_node_reports_this_machines_capacity_and_its_own_identity(
    kube: Kubectl, real_node_name: str
) -> None:
    node = kube.get("node", real_node_name)
    labels, status = node["metadata"]["labels"], node["status"]
    assert labels["sovereign.ai/real-node"] == "true" and "type" not in labels
    assert int(status["capacity"]["cpu"]) == os.cpu_count()
    mem_total_kib = int(
        next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemTotal")).split()[1]
    )
    assert status["capacity"]["memory"] == f"{mem_total_kib}Ki"
    info = status["nodeInfo"]
    assert info["kubeletVersion"] == VERSIONS["KUBE_VERSION"]
    assert info["containerRuntimeVersion"] == f"containerd://{VERSIONS['CONTAINERD_VERSION'].lstrip('v')}"
    described = kube.run("describe", "node", real_node_name).stdout
    assert "KubeletReady" in described and "Non-terminated Pods" in described
    # The kubelet's identity is system:node:<name> under Node authorization and NodeRestriction: it
    # may change its own Node, not another one.
    as_node = ["--as", f"system:node:{real_node_name}", "--as-group", "system:nodes"]
    own = kube.run(
        "label", "node", real_node_name, "sovereign.ai/probe=1", "--dry-run=server", *as_node, check=False
    )
    assert own.returncode == 0, own.stderr
    other = kube.run(
        "label", "node", "gpu-node-0", "sovereign.ai/probe=1", "--dry-run=server", *as_node, check=False
    )
    assert other.returncode != 0 and "forbidden" in other.stderr.lower()


def test_gpu_pods_never_land_on_the_real_node(
    kube: Kubectl, real_node_namespace: str, real_node_name: str
) -> None:
    """In a namespace as a user makes one, GPU pods go to the (fake) GPU nodes, everything else to
    the real node; the kwok CPU node is tainted away while the real node is there."""
    ns = real_node_namespace
    gpu = pod("gpu", ["serve"], resources={"limits": {"nvidia.com/gpu": "1"}})
    cpu = pod("cpu", ["serve"], resources={"requests": {"cpu": "10m"}})
    kube.apply({"apiVersion": "v1", "kind": "List", "items": [gpu, cpu]}, ns)

    def placed(name: str) -> str | None:
        return kube.get("pod", "-n", ns, name)["spec"].get("nodeName")

    gpu_node = wait_for("the GPU pod to be scheduled", lambda: placed("gpu"), timeout=60)
    # Any fake GPU node will do (gpu-node-* or the multi-node h100-node-*): the scheduler's choice
    # among them is its own.
    gpu_labels = kube.get("node", gpu_node)["metadata"]["labels"]
    assert gpu_node != real_node_name and gpu_labels.get("type") == "kwok", gpu_node
    assert gpu_labels.get("nvidia.com/gpu.present") == "true", gpu_node
    # ExtendedResourceToleration gave it the toleration for the GPU nodes' taint.
    tolerations = kube.get("pod", "-n", ns, "gpu")["spec"]["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
    assert wait_for("the CPU pod to be scheduled", lambda: placed("cpu"), timeout=60) == real_node_name
    kube.run("delete", "pod", "-n", ns, "gpu", "cpu", "--wait=false")


def test_a_pod_over_its_memory_limit_is_oom_killed(
    kube: Kubectl, real_node_namespace: str, images: None
) -> None:
    ns = real_node_namespace
    hog = pod("hog", ["hog", "-mib", "256"], resources={"limits": {"memory": "64Mi"}})
    hog["spec"]["restartPolicy"] = "Never"
    kube.apply(hog, ns)

    def terminated() -> dict[str, Any] | None:
        statuses = kube.get("pod", "-n", ns, "hog")["status"].get("containerStatuses") or [{}]
        return statuses[0].get("state", {}).get("terminated")

    state = wait_for("the memory hog to be killed", terminated, timeout=90)
    assert state["reason"] == "OOMKilled" and state["exitCode"] == 137, state


def test_down_leaves_nothing_behind_and_spares_other_clusters(
    kube: Kubectl, web: dict[str, Any], tmp_path: Path
) -> None:
    """A second cluster with its own real node on this machine: both run at once (their own
    addresses, namespaces and cgroups). Its processes killed and its state dir removed without `down`
    (a CI checkout deleted and cloned again at the same path), `up` brings its node up again; then its
    `down` removes every trace of it and nothing of ours."""
    name = f"t{secrets.token_hex(3)}"
    env = {**os.environ, "SOVEREIGN_CLUSTER": name, "SOVEREIGN_CLUSTER_DIR": str(tmp_path)}
    cluster = [str(CLUSTER_SH)]
    node_id = node_py().node_id(tmp_path, name)

    def up_and_ready() -> None:
        up = subprocess.run([*cluster, "up"], env=env, capture_output=True, text=True, timeout=600)
        assert up.returncode == 0, up.stdout + up.stderr
        second = subprocess.run([*cluster, "status"], env=env, capture_output=True, text=True, timeout=60)
        assert "real node real-node-0: Ready" in second.stdout, up.stderr + second.stdout + second.stderr

    try:
        up_and_ready()
        assert Path(f"/run/netns/sovereign-{node_id}").exists()
        # What a CI runner does to a checkout it is done with: kill its processes, delete the tree.
        # The node's namespaces, cgroups and run dir stay behind, its mount namespace bound to a
        # /var/lib that no longer exists.
        for _ in range(3):
            cgroup_pids = [
                int(pid)
                for procs in Path("/sys/fs/cgroup").glob(f"*/sovereign-{node_id}/**/cgroup.procs")
                for pid in procs.read_text().split()
            ]
            ours = [p for p in _pids() if str(tmp_path) in _cmdline(p) or node_id in _cmdline(p)]
            for pid in {*cgroup_pids, *ours}:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(1)
        shutil.rmtree(tmp_path)
        tmp_path.mkdir()
        assert Path(f"/run/sovereign/{node_id}/mnt").exists()
        up_and_ready()
    finally:
        subprocess.run([*cluster, "down"], env=env, check=True, timeout=300, capture_output=True)

    assert not Path(f"/run/netns/sovereign-{node_id}").exists()
    assert not Path(f"/sys/class/net/sov{node_id}").exists()
    assert not Path(f"/run/sovereign/{node_id}").exists()
    assert not list(tmp_path.glob(f"node-{name}*"))
    assert not [p for p in Path("/sys/fs/cgroup").glob(f"*/sovereign-{node_id}")]
    mounts = Path("/proc/self/mountinfo").read_text()
    assert node_id not in mounts and str(tmp_path) not in mounts
    assert not [pid for pid in _pids() if node_id in _cmdline(pid) or str(tmp_path) in _cmdline(pid)], (
        "processes of the deleted cluster are still running"
    )
    routes = subprocess.run(["ip", "route"], capture_output=True, text=True, check=True).stdout
    assert f"sov{node_id}" not in routes
    # Our node still serves.
    ns = web["ns"]
    assert exec_in(kube, ns, "client", "get", f"http://web.{ns}.svc.cluster.local/").stdout.startswith(
        "hello"
    )


def test_a_deleted_clusters_node_is_removed_by_the_next_cluster_brought_up(
    kube: Kubectl, web: dict[str, Any], tmp_path: Path
) -> None:
    """A worktree deleted while its cluster runs (``rm -rf`` gets as far as the node's mounts let it):
    nothing can stop that cluster any more, since cluster.sh finds it through the deleted state dir. The
    next cluster brought up on the machine removes it, control plane and node, and says so; ours is
    untouched."""
    gone_dir, next_dir = tmp_path / "gone", tmp_path / "next"
    gone_name, next_name = f"g{secrets.token_hex(3)}", f"n{secrets.token_hex(3)}"
    gone_id = node_py().node_id(gone_dir, gone_name)

    def cluster(name: str, state: Path, *args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "SOVEREIGN_CLUSTER": name, "SOVEREIGN_CLUSTER_DIR": str(state)}
        return subprocess.run([str(CLUSTER_SH), *args], env=env, capture_output=True, text=True, timeout=600)

    try:
        up = cluster(gone_name, gone_dir, "up")
        assert up.returncode == 0, up.stdout + up.stderr
        assert [pid for pid in _pids() if str(gone_dir) in _cmdline(pid)]
        shutil.rmtree(gone_dir, ignore_errors=True)  # what a user's `rm -rf` of the checkout does
        up = cluster(next_name, next_dir, "up")
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"removed orphaned node {gone_id}: its cluster's state dir {gone_dir}" in up.stderr
    finally:
        cluster(next_name, next_dir, "down")

    assert not [pid for pid in _pids() if str(gone_dir) in _cmdline(pid) or gone_id in _cmdline(pid)]
    assert not Path(f"/run/netns/sovereign-{gone_id}").exists()
    assert not Path(f"/sys/class/net/sov{gone_id}").exists()
    assert not Path(f"/run/sovereign/{gone_id}").exists()
    assert not [p for p in Path("/sys/fs/cgroup").glob(f"*/sovereign-{gone_id}")]
    assert gone_id not in Path("/proc/self/mountinfo").read_text()
    slots = Path("/run/sovereign/slots")
    claims = {f.read_text().strip() for f in slots.iterdir()} if slots.is_dir() else set()
    assert gone_id not in claims
    shutil.rmtree(gone_dir)  # nothing holds it now
    ns = web["ns"]
    assert exec_in(kube, ns, "client", "get", f"http://web.{ns}.svc.cluster.local/").stdout.startswith(
        "hello"
    )


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _epoch(stamp: str) -> float:
    return time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ"))
