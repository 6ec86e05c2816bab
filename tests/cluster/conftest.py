"""Fixtures for the tests that run against a real Kubernetes control plane.

The session brings up the local cluster (`e2e/cluster/cluster.sh up`: real etcd, kube-apiserver,
kube-controller-manager and kube-scheduler, kwok for fake GPU nodes) or reuses the cluster that
`KUBECONFIG` names, applies `crds/`, and runs the operator for real as a subprocess under the
least-privilege identity the Helm chart grants (a ServiceAccount bound to
`charts/sovereign/files/operator-rbac-rules.yaml`, authenticated with its token). Each test gets
its own namespace. Everything talks to the cluster through the kubectl built next to it.

Namespaces made by `namespace`, `module_namespace` and `fresh_namespace` send their pods to kwok's
fake nodes (`FAKE_NODES_ANNOTATIONS`), so the operator-behaviour tests get instant fake pods whether
or not the local cluster has its real node; `real_node_namespace` gives one whose non-GPU pods run on
the real node (kubelet, containerd), skipped with the reason where this machine cannot run one;
`real_node_runtime_image` builds the runtime image here (cached) and imports it into that node, so the
operator's own pods run there (tests/cluster/test_real_pods.py).

On a cluster whose pods really run (kind: `e2e/kind/up.sh test`), SOVEREIGN_TEST_OPERATOR=external
uses the operator already installed there (the chart's Deployment, found by
SOVEREIGN_OPERATOR_NAMESPACE and SOVEREIGN_OPERATOR_SELECTOR) instead of starting one. Tests that
need what only the local control plane has say so with a marker, and are skipped, with the reason,
on other clusters; on the local control plane they always run:
- `fake_gpu_nodes`: kwok's fake 8x H200 nodes, whose RDMA capacity the tests switch on and off and
  whose pods become Ready without images or weights;
- `local_operator`: the operator as a process on this machine (it must reach a server on 127.0.0.1).
The operator's real pods (`real_pods_namespace`) run on the local cluster's real node there, and on a
kind cluster on its workers (`real_nodes`); tests that need this machine's node itself (its cgroups,
a hostPath here, the images imported into it) take `real_node_name` and are skipped elsewhere.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest
from cluster_helpers import (
    CLUSTER_SH,
    CRD_DIR,
    REAL_NODE_UNSUPPORTED,
    REPO,
    ExternalOperator,
    Kubectl,
    OperatorHandle,
    OperatorProcess,
    condition,
    create_namespace,
    has_fake_gpu_nodes,
    is_kwok_node,
    local_kubeconfig,
    make_operator_kubeconfig,
    reachable,
    real_node,
    wait_for,
)
from local_images import build_local_images
from sovereign_operator.api.spec import DEFAULT_RUNTIME_IMAGE

# Every namespace of this session starts with this prefix and the session's operator watches only
# those, so two sessions on one cluster (CI retries, engineers sharing .cluster) never fight.
SESSION_PREFIX = f"t{secrets.token_hex(2)}-"

OPERATOR_MODES = ("process", "external")


def operator_mode() -> str:
    mode = os.environ.get("SOVEREIGN_TEST_OPERATOR", "process")
    if mode not in OPERATOR_MODES:
        raise pytest.UsageError(
            f"SOVEREIGN_TEST_OPERATOR={mode!r}: expected one of {', '.join(OPERATOR_MODES)}"
        )
    return mode


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fake_gpu_nodes: needs kwok's fake GPU nodes (local control plane)")
    config.addinivalue_line("markers", "local_operator: needs the operator as a process on this machine")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Everything under tests/cluster needs the control plane, whether or not a module says so.
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.cluster)


@pytest.fixture(scope="session")
def kube() -> Kubectl:
    """The cluster: the one KUBECONFIG names if it answers, else the local one (started if needed).

    SOVEREIGN_CLUSTER=name selects a separate local cluster (e.g. one per engineer on a shared box).
    """
    named = os.environ.get("KUBECONFIG")
    if named and reachable(Path(named)):
        kubectl = Kubectl(Path(named))
    elif operator_mode() == "external":
        # An external operator lives on the user's cluster: never fall back to a local one.
        pytest.fail(
            f"SOVEREIGN_TEST_OPERATOR=external needs KUBECONFIG to name a reachable cluster (got {named!r})"
        )
    else:
        subprocess.run([str(CLUSTER_SH), "up"], check=True, timeout=3600)
        kubectl = Kubectl(local_kubeconfig())
    kubectl.local = kubectl.kubeconfig.resolve() == local_kubeconfig().resolve()
    # Large CRDs exceed the client-side apply annotation limit: apply server-side.
    kubectl.run("apply", "--server-side", "--force-conflicts", "-f", str(CRD_DIR))
    # Right after a create the CRD may have no status.conditions at all, which `kubectl wait` reports as
    # an error rather than waiting: retry until the apiserver has written them.
    deadline = time.monotonic() + 60
    while True:
        waited = kubectl.run(
            "wait", "--for=condition=Established", "crd", "--all", "--timeout=60s", check=False
        )
        if waited.returncode == 0:
            return kubectl
        assert time.monotonic() < deadline, f"CRDs not Established: {waited.stderr.strip()}"
        time.sleep(0.5)


@contextmanager
def fresh_namespace(kube: Kubectl, label: str, *, fake_nodes: bool = True) -> Iterator[str]:
    """Create a namespace named after `label`; delete it afterwards and wait until it is gone.
    Its pods go to kwok's fake nodes unless `fake_nodes` is False (then: the real node, GPU pods
    excepted).

    Waiting matters: the fake GPU nodes are few, and the next test needs their GPUs free.
    """
    base = re.sub(r"[^a-z0-9-]+", "-", label.lower()).strip("-")[:40].strip("-")
    name = f"{SESSION_PREFIX}{base}-{secrets.token_hex(3)}"
    create_namespace(kube, name, fake_nodes=fake_nodes)
    try:
        yield name
    finally:
        # No finalizers anywhere (the operator sets none): deleting the namespace takes everything,
        # under the namespace-restricted operator too (test_deleting_the_namespace_completes_...).
        kube.run("delete", "namespace", name, "--wait=true", "--timeout=90s", check=False, timeout=120)


@pytest.fixture
def namespace(kube: Kubectl, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace per test."""
    with fresh_namespace(kube, request.node.name) as name:
        yield name


@pytest.fixture
def more_namespaces(kube: Kubectl) -> Callable[[str], AbstractContextManager[str]]:
    """`fresh_namespace` for a test that needs a second namespace (tests import fixtures, never
    this module: `up.sh test` collects tests/cluster beside tests/packaging, whose conftest would
    shadow it)."""
    return lambda label: fresh_namespace(kube, label)


@pytest.fixture(scope="module")
def module_namespace(kube: Kubectl, request: pytest.FixtureRequest) -> Iterator[str]:
    """One namespace for a module whose tests leave nothing behind (e.g. rejected creates)."""
    with fresh_namespace(kube, request.module.__name__.rsplit(".", 1)[-1]) as name:
        yield name


@pytest.fixture(scope="session")
def real_node_name(kube: Kubectl) -> str:
    """The local cluster's real node (kubelet + containerd). Skipped, with the reason, where this
    machine cannot run one (not root, no cgroups/overlayfs/namespaces); a node that should be there
    and is not fails the test instead."""
    if not kube.local:
        pytest.skip("needs the local cluster's real node (this is another cluster)")
    status, out = real_node()
    if status == REAL_NODE_UNSUPPORTED:
        pytest.skip(f"this machine cannot run the local cluster's real node: {out}")
    assert status == 0, f"the local cluster's real node is down: {out}"
    return out


@pytest.fixture(scope="module")
def real_node_namespace(kube: Kubectl, real_node_name: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """A namespace as a user makes one (no annotations): its non-GPU pods run on the real node."""
    with fresh_namespace(kube, request.module.__name__.rsplit(".", 1)[-1], fake_nodes=False) as name:
        yield name


@pytest.fixture(scope="session")
def real_node_runtime_image(real_node_name: str) -> str:
    """The runtime image built on this machine (e2e/images/build.sh: cached, a warm build is a no-op)
    imported into the real node (`cluster.sh import-image`: a no-op when the node holds it), under the
    reference the operator renders by default, so the pods of a plain `LLMDeployment` find it."""
    if os.geteuid() != 0:  # the real node needs root too; this says what else needs it
        pytest.skip("building the local images needs root (debootstrap, chroot)")
    image = build_local_images()["images"]["runtime"]
    assert image["ref"] == DEFAULT_RUNTIME_IMAGE, (image["ref"], DEFAULT_RUNTIME_IMAGE)
    imported = subprocess.run(
        [str(CLUSTER_SH), "import-image", image["archive"]], capture_output=True, text=True, timeout=1200
    )
    assert imported.returncode == 0, imported.stdout[-2000:] + imported.stderr[-2000:]
    return str(image["ref"])


@pytest.fixture(scope="session")
def real_nodes(kube: Kubectl, request: pytest.FixtureRequest) -> frozenset[str]:
    """The nodes whose kubelets run the operator's pods for real: the local cluster's real node, or on
    another cluster whose chart-installed operator these tests use (kind: `e2e/kind/up.sh test`) its
    Ready worker nodes that are not kwok's. There the runtime image is the one the chart names, which
    up.sh loaded into the nodes."""
    if kube.local:
        return frozenset({request.getfixturevalue("real_node_name")})
    if operator_mode() != "external":
        pytest.skip(
            "real pods on another cluster need its installed operator (SOVEREIGN_TEST_OPERATOR=external)"
        )
    nodes = frozenset(
        node["metadata"]["name"]
        for node in kube.items("nodes")
        if not is_kwok_node(node)
        and "node-role.kubernetes.io/control-plane" not in node["metadata"].get("labels", {})
        and (condition(node, "Ready") or {}).get("status") == "True"
    )
    if not nodes:
        pytest.skip("this cluster has no Ready worker node whose kubelet runs pods for real")
    return nodes


@pytest.fixture
def real_pods_namespace(
    kube: Kubectl, real_nodes: frozenset[str], request: pytest.FixtureRequest
) -> Iterator[str]:
    """A namespace as a user makes one, per test, for the operator's pods on the real nodes (on the
    local cluster with the runtime image imported into its node): pods of one test never hold the
    node's two CPUs while the next one starts."""
    if kube.local:
        request.getfixturevalue("real_node_runtime_image")
    with fresh_namespace(kube, request.node.name, fake_nodes=False) as name:
        yield name
        # The deployments first, then the namespace once their pods are gone: deleted together, the
        # namespace controller waits out the pods' grace periods before it looks again (80 s here).
        kube.run("delete", "llmd", "--all", "-n", name, "--wait=true", timeout=120)
        wait_for(f"the pods of {name} to be gone", lambda: not kube.items("pods", "-n", name), timeout=180)


@pytest.fixture(scope="session")
def fake_gpu_nodes_present(kube: Kubectl) -> bool:
    """Looked up once: nodes do not come and go during a session."""
    return has_fake_gpu_nodes(kube)


@pytest.fixture(autouse=True)
def _cluster_capabilities(request: pytest.FixtureRequest) -> None:
    """Skip, naming what is missing, a test that needs what only the local control plane has."""
    needs_fake_nodes = request.node.get_closest_marker("fake_gpu_nodes") is not None
    needs_local_operator = request.node.get_closest_marker("local_operator") is not None
    if not (needs_fake_nodes or needs_local_operator):
        return
    kube: Kubectl = request.getfixturevalue("kube")
    missing = []
    if needs_fake_nodes and not request.getfixturevalue("fake_gpu_nodes_present"):
        # The local control plane always has them: there, their absence is a broken setup, not a skip.
        assert not kube.local, "the local control plane has no fake GPU nodes (e2e/cluster/kwok/nodes.yaml)"
        missing.append("kwok's fake GPU nodes (the local control plane's)")
    if needs_local_operator and operator_mode() != "process":
        missing.append("the operator as a local process (SOVEREIGN_TEST_OPERATOR=external is set)")
    if missing:
        pytest.skip(f"needs {' and '.join(missing)}")


@pytest.fixture(scope="session")
def operator_kubeconfig(kube: Kubectl, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A kubeconfig for the operator's ServiceAccount, bound to exactly the chart's RBAC rules."""
    return make_operator_kubeconfig(kube, tmp_path_factory.mktemp("operator"))


@pytest.fixture(scope="session")
def operator(kube: Kubectl, request: pytest.FixtureRequest) -> Iterator[OperatorHandle]:
    """The operator, running for the whole session under its least-privilege identity: a process
    this session starts (default), or the one already installed (SOVEREIGN_TEST_OPERATOR=external)."""
    if operator_mode() == "external":
        external = ExternalOperator(
            kube,
            namespace=os.environ.get("SOVEREIGN_OPERATOR_NAMESPACE", "sovereign-system"),
            selector=os.environ.get("SOVEREIGN_OPERATOR_SELECTOR", "app.kubernetes.io/name=sovereign"),
        )
        external.assert_alive()
        external.start()
        yield external
        return
    yield from _operator_process(kube, request.getfixturevalue("operator_kubeconfig"))


def _operator_process(kube: Kubectl, operator_kubeconfig: Path) -> Iterator[OperatorProcess]:
    # Logs live in .cluster/test-logs (git-ignored), not in pytest's rotating temp dirs.
    log_dir = REPO / ".cluster" / "test-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"operator-{SESSION_PREFIX.rstrip('-')}.log"
    op = OperatorProcess(
        kubeconfig=operator_kubeconfig, log_path=log_path, namespaces=(f"{SESSION_PREFIX}*",)
    )
    op.start()
    time.sleep(1.0)
    op.assert_alive()
    yield op
    op.stop()
