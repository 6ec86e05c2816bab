"""Helpers for the cluster tests: kubectl with JSON, polling, the operator as a subprocess."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import yaml

REPO = Path(__file__).resolve().parents[2]
BIN = REPO / "e2e" / "cluster" / "bin"
CLUSTER_SH = REPO / "e2e" / "cluster" / "cluster.sh"
CRD_DIR = REPO / "crds"
EXAMPLES = REPO / "examples"
RBAC_RULES = REPO / "charts" / "sovereign" / "files" / "operator-rbac-rules.yaml"
OPERATOR_CLI = REPO / ".venv" / "bin" / "sovereign-operator"
# The kubectl built with the local control plane, else the user's (kind needs no Go build).
KUBECTL = (
    str(BIN / "kubectl") if (BIN / "kubectl").exists() else (shutil.which("kubectl") or str(BIN / "kubectl"))
)

# Annotations that send every pod of a namespace to kwok's fake nodes (PodNodeSelector and
# PodTolerationRestriction; `cluster.sh fake-namespace` applies the same file).
FAKE_NODES_ANNOTATIONS: dict[str, str] = json.loads(
    (REPO / "e2e" / "cluster" / "kwok" / "fake-namespace-annotations.json").read_text()
)
REAL_NODE_UNSUPPORTED = 3  # `cluster.sh real-node`'s exit status where the machine cannot run it

OPERATOR_NAMESPACE = "sovereign-system"
OPERATOR_SA = "sovereign-operator"
OPERATOR_ROLE = "sovereign-operator-test"


@dataclass
class Kubectl:
    """kubectl against one cluster, with JSON in and out."""

    kubeconfig: Path
    # The project's local control plane (as opposed to a cluster KUBECONFIG names, e.g. kind).
    local: bool = False

    def run(
        self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        cmd = [KUBECTL, "--kubeconfig", str(self.kubeconfig), *args]
        proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}"
            )
        return proc

    def get(self, *args: str) -> dict[str, Any]:
        return json.loads(self.run("get", "-o", "json", *args).stdout)

    def get_or_none(self, *args: str) -> dict[str, Any] | None:
        proc = self.run("get", "-o", "json", *args, check=False)
        if proc.returncode != 0:
            if "NotFound" in proc.stderr or "not found" in proc.stderr:
                return None
            raise AssertionError(f"kubectl get {' '.join(args)}: {proc.stderr.strip()}")
        return json.loads(proc.stdout)

    def items(self, *args: str) -> list[dict[str, Any]]:
        return list(self.get(*args)["items"])

    def apply(self, manifest: dict[str, Any] | str, namespace: str | None = None) -> None:
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        ns = ["-n", namespace] if namespace else []
        self.run("apply", *ns, "-f", "-", stdin=text)

    def try_create(self, manifest: dict[str, Any], namespace: str) -> subprocess.CompletedProcess[str]:
        """Create without raising: the caller inspects the apiserver's answer."""
        return self.run("create", "-n", namespace, "-f", "-", stdin=json.dumps(manifest), check=False)


def wait_for(what: str, predicate: Callable[[], Any], timeout: float = 60, interval: float = 0.5) -> Any:
    """Poll until predicate returns something truthy; fail naming `what` and the last value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last value: {last!r}")


def reachable(kubeconfig: Path) -> bool:
    if not Path(KUBECTL).exists() or not kubeconfig.exists():
        return False
    return Kubectl(kubeconfig).run("get", "--raw", "/readyz", check=False, timeout=10).returncode == 0


@dataclass
class OperatorProcess:
    """`sovereign-operator run` as a subprocess; logs go to a file the failure message points at."""

    kubeconfig: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    extra_env: dict[str, str] = field(default_factory=dict)
    # Namespace patterns to watch (kopf globs); empty watches the whole cluster.
    namespaces: tuple[str, ...] = ()
    extra_args: tuple[str, ...] = ()

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "operator already running"
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), **self.extra_env}
        env.pop("KUBERNETES_SERVICE_HOST", None)  # never pick up an in-cluster identity
        self.starts += 1
        log = self.log_path.open("ab")
        log.write(f"\n===== start #{self.starts} =====\n".encode())
        log.flush()
        self.proc = subprocess.Popen(
            # No health port: several operators (sessions, engineers) share one machine.
            [
                str(OPERATOR_CLI),
                "run",
                "--health-port",
                "0",
                *(f"--namespace={ns}" for ns in self.namespaces),
                *self.extra_args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
            start_new_session=True,
        )
        log.close()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def kill(self) -> None:
        """Stop abruptly, as a crash or an evicted pod would."""
        self.stop(signal.SIGKILL)

    def assert_alive(self) -> None:
        assert self.proc is not None and self.proc.poll() is None, (
            f"operator exited with {self.proc.returncode if self.proc else None}; log: {self.log_path}\n"
            + self.tail()
        )

    def tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


class OperatorHandle(Protocol):
    """What the tests need of the operator, wherever it runs."""

    def start(self) -> None: ...
    def kill(self) -> None: ...
    def assert_alive(self) -> None: ...
    def tail(self, lines: int = 40) -> str: ...


@dataclass
class ExternalOperator:
    """An operator the test session did not start: normally the chart's Deployment on a cluster whose
    pods really run (kind, a staging cluster), selected with SOVEREIGN_TEST_OPERATOR=external.

    `kill` deletes its pods at once, as a crash or an eviction would; `start` waits until its
    Deployment is available again (the Deployment controller brings the pod back).
    """

    kube: Kubectl
    namespace: str
    selector: str

    def deployment(self) -> dict[str, Any] | None:
        items = self.kube.items("deployments", "-n", self.namespace, "-l", self.selector)
        return items[0] if items else None

    def start(self) -> None:
        wait_for(f"the operator Deployment in {self.namespace} available", self._available, timeout=300)

    def kill(self) -> None:
        self.kube.run(
            "delete",
            "pods",
            "-n",
            self.namespace,
            "-l",
            self.selector,
            "--grace-period=0",
            "--force",
            "--wait=false",
        )

    def _available(self) -> bool:
        dep = self.deployment()
        return bool(dep and int(dep.get("status", {}).get("availableReplicas") or 0) >= 1)

    def assert_alive(self) -> None:
        # Between kill and start the pod is legitimately gone; only a missing Deployment is fatal.
        assert self.deployment() is not None, (
            f"no operator Deployment matches -l {self.selector} in namespace {self.namespace} "
            "(set SOVEREIGN_OPERATOR_NAMESPACE / SOVEREIGN_OPERATOR_SELECTOR)"
        )

    def tail(self, lines: int = 40) -> str:
        dep = self.deployment()
        if dep is None:
            return ""
        proc = self.kube.run(
            "logs",
            "-n",
            self.namespace,
            f"deployment/{dep['metadata']['name']}",
            f"--tail={lines}",
            check=False,
        )
        return proc.stdout or proc.stderr


def is_kwok_node(node: dict[str, Any]) -> bool:
    """A node kwok fakes (no kubelet: its pods never run)."""
    return node["metadata"].get("annotations", {}).get("kwok.x-k8s.io/node") == "fake"


def has_fake_gpu_nodes(kube: Kubectl) -> bool:
    """Whether the cluster has kwok's fake GPU nodes (the local control plane), whose capacity the
    tests may rewrite (RDMA on/off) and whose pods start without images or weights."""
    return any(is_kwok_node(node) for node in kube.items("nodes", "-l", GPU_NODE_SELECTOR))


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    """The status condition of type `kind`, if present."""
    if not obj:
        return None
    for cond in obj.get("status", {}).get("conditions", []) or []:
        if cond.get("type") == kind:
            return dict(cond)
    return None


def get_llmd(kube: Kubectl, ns: str, name: str) -> dict[str, Any]:
    return kube.get("llmd", name, "-n", ns)


def is_ready(kube: Kubectl, ns: str, name: str) -> dict[str, Any] | None:
    obj = get_llmd(kube, ns, name)
    cond = condition(obj, "Ready")
    if (
        cond
        and cond["status"] == "True"
        and obj["status"].get("observedGeneration") == obj["metadata"]["generation"]
    ):
        return obj
    return None


def wait_ready(kube: Kubectl, op: OperatorHandle, ns: str, name: str, timeout: float = 120) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        op.assert_alive()
        return is_ready(kube, ns, name)

    try:
        return wait_for(f"{ns}/{name} Ready=True", ready, timeout=timeout)
    except AssertionError as err:
        raise AssertionError(
            f"{err}\nstatus: {json.dumps(get_llmd(kube, ns, name).get('status'))}\n{op.tail()}"
        ) from None


RUNTIME_IMAGE = "ghcr.io/sovereign-ai/sovereign-runtime:0.1.0"
# DeepSeek-V3 in FP8 on one fake 8x H200 node: the model and runtime parts of the GPU tests' specs.
DEEPSEEK_V3_FP8: dict[str, Any] = {
    "model": {
        "name": "deepseek-v3",
        "source": {"hostPath": {"path": "/models/deepseek-v3"}},
        "precision": "fp8",
        "weightsGiB": 642,
    },
    "runtime": {"image": RUNTIME_IMAGE, "tensorParallelSize": 8},
}


def llmd(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """An LLMDeployment manifest."""
    return {
        "apiVersion": "sovereign.ai/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": name},
        "spec": spec,
    }


RDMA_RESOURCE = "rdma/rdma_shared_device_a"
GPU_NODE_SELECTOR = "nvidia.com/gpu.present=true"


def set_rdma(kube: Kubectl, on: bool) -> None:
    """Give the GPU nodes the RDMA device-plugin resource, or take it away (as cluster.sh rdma)."""
    value = "1k" if on else None
    patch = json.dumps(
        {"status": {"capacity": {RDMA_RESOURCE: value}, "allocatable": {RDMA_RESOURCE: value}}}
    )
    for node in kube.items("nodes", "-l", GPU_NODE_SELECTOR):
        name = node["metadata"]["name"]
        label = "feature.node.kubernetes.io/rdma.available" + ("=true" if on else "-")
        kube.run("label", "node", name, label, "--overwrite")
        kube.run("patch", "node", name, "--subresource=status", "--type=merge", "-p", patch)


def create_namespace(kube: Kubectl, name: str, *, fake_nodes: bool) -> None:
    """Create namespace ``name``; with ``fake_nodes`` on the local cluster, every pod in it goes to
    kwok's fake nodes (instant fake pods, as the operator-behaviour tests expect) instead of the real
    node. Elsewhere (kind) the annotations would pin pods to nodes that do not exist: left off."""
    annotations = FAKE_NODES_ANNOTATIONS if fake_nodes and kube.local else {}
    kube.run(
        "create",
        "-f",
        "-",
        stdin=json.dumps(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "annotations": annotations}}
        ),
    )


def real_node() -> tuple[int, str]:
    """(exit status, output) of `cluster.sh real-node`: 0 and the node's name when it is up,
    REAL_NODE_UNSUPPORTED and the reason where this machine cannot run it, 1 and what is wrong else."""
    proc = subprocess.run([str(CLUSTER_SH), "real-node"], capture_output=True, text=True, timeout=60)
    return proc.returncode, (proc.stdout.strip() or proc.stderr.strip())


def local_kubeconfig() -> Path:
    """The kubeconfig cluster.sh writes for SOVEREIGN_CLUSTER (default: the cluster "sovereign")."""
    name = os.environ.get("SOVEREIGN_CLUSTER", "sovereign")
    return REPO / ".cluster" / ("kubeconfig" if name == "sovereign" else f"kubeconfig-{name}")


def audit_log_path(kube: Kubectl) -> Path | None:
    """The local cluster's audit log of writes, when the tests run on the local cluster."""
    if kube.kubeconfig.resolve() != local_kubeconfig().resolve():
        return None
    path = Path(subprocess.run([str(CLUSTER_SH), "audit-log"], capture_output=True, text=True).stdout.strip())
    return path if path.exists() else None


WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}


def audited_writes(path: Path, user: str | None, since: float) -> list[dict[str, Any]]:
    """Write requests `user` (None: anyone) made since the wall-clock time `since` (seconds since the
    epoch)."""
    return [e for e in audited_requests(path, user, since) if e.get("verb") in WRITE_VERBS]


def audited_requests(path: Path, user: str | None, since: float) -> list[dict[str, Any]]:
    """Requests `user` (None: anyone) made since `since` as the audit log has them: every write, and
    the reads of the operator's ServiceAccounts (e2e/cluster/kwok/audit-policy.yaml). A watch appears
    once when it starts and once when it ends (the same auditID)."""
    out: list[dict[str, Any]] = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written right now
        if user is not None and event.get("user", {}).get("username") != user:
            continue
        stamp = event.get("requestReceivedTimestamp", "")
        if _epoch(stamp) >= since:
            out.append(event)
    return out


def _epoch(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() if stamp else 0.0


def make_operator_kubeconfig(kube: Kubectl, directory: Path, service_account: str = OPERATOR_SA) -> Path:
    """A kubeconfig for an operator ServiceAccount, bound to exactly the chart's RBAC rules (a
    second account gives a second replica an identity of its own in the audit log)."""
    rules = yaml.safe_load(RBAC_RULES.read_text())
    rules = rules["rules"] if isinstance(rules, dict) else rules
    manifests: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OPERATOR_NAMESPACE}},
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": service_account, "namespace": OPERATOR_NAMESPACE},
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": OPERATOR_ROLE},
            "rules": rules,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": OPERATOR_ROLE if service_account == OPERATOR_SA else service_account},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": OPERATOR_ROLE,
            },
            "subjects": [
                {"kind": "ServiceAccount", "name": service_account, "namespace": OPERATOR_NAMESPACE}
            ],
        },
    ]
    kube.apply({"apiVersion": "v1", "kind": "List", "items": manifests})
    token = kube.run(
        "create", "token", service_account, "-n", OPERATOR_NAMESPACE, "--duration=24h"
    ).stdout.strip()

    raw = json.loads(kube.run("config", "view", "--raw", "--minify", "-o", "json").stdout)
    cluster = raw["clusters"][0]["cluster"]
    if "certificate-authority" in cluster and "certificate-authority-data" not in cluster:
        ca = Path(cluster.pop("certificate-authority")).read_bytes()
        cluster["certificate-authority-data"] = base64.b64encode(ca).decode()
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "local", "cluster": cluster}],
        "users": [{"name": service_account, "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {"cluster": "local", "user": service_account}}],
        "current-context": "operator",
    }
    path = directory / f"{service_account}-kubeconfig"
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


@contextmanager
def port_forward(kube: Kubectl, ns: str, name: str, port: int, kind: str = "service") -> Iterator[str]:
    """`kubectl port-forward <kind>/<name>` to a free local port; yields its base URL. Through the
    kubelet into the pod, so it works where the host cannot route to pod IPs (kind) and where a
    NetworkPolicy admits only the router and the operator."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        local = s.getsockname()[1]
    cmd = [KUBECTL, "--kubeconfig", str(kube.kubeconfig), "port-forward", "-n", ns]
    proc = subprocess.Popen(
        [*cmd, f"{kind}/{name}", f"{local}:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert proc.poll() is None, (
                f"port-forward exited: {proc.stderr.read().decode() if proc.stderr else ''}"
            )
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", local)) == 0:
                    break
            time.sleep(0.5)
        yield f"http://127.0.0.1:{local}"
    finally:
        proc.terminate()
        proc.wait(10)
