"""Fixtures for the tests that run against a real Kubernetes control plane.

The session brings up the local cluster (`e2e/cluster/cluster.sh up`: real etcd, kube-apiserver,
kube-controller-manager and kube-scheduler, kwok for fake GPU nodes) or reuses the cluster that
`KUBECONFIG` names, applies `crds/`, and runs the operator for real as a subprocess under the
least-privilege identity the Helm chart grants (a ServiceAccount bound to
`charts/sovereign/files/operator-rbac-rules.yaml`, authenticated with its token). Each test gets
its own namespace. Everything talks to the cluster through the kubectl built next to it.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from cluster_helpers import (
    CLUSTER_SH,
    CRD_DIR,
    REPO,
    Kubectl,
    OperatorProcess,
    local_kubeconfig,
    make_operator_kubeconfig,
    reachable,
)

# Every namespace of this session starts with this prefix and the session's operator watches only
# those, so two sessions on one cluster (CI retries, engineers sharing .cluster) never fight.
SESSION_PREFIX = f"t{secrets.token_hex(2)}-"


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
    else:
        subprocess.run([str(CLUSTER_SH), "up"], check=True, timeout=3600)
        kubectl = Kubectl(local_kubeconfig())
    # Large CRDs exceed the client-side apply annotation limit: apply server-side.
    kubectl.run("apply", "--server-side", "--force-conflicts", "-f", str(CRD_DIR))
    kubectl.run("wait", "--for=condition=Established", "crd", "--all", "--timeout=60s")
    return kubectl


@contextmanager
def fresh_namespace(kube: Kubectl, label: str) -> Iterator[str]:
    """Create a namespace named after `label`; delete it afterwards and wait until it is gone.

    Waiting matters: the fake GPU nodes are few, and the next test needs their GPUs free.
    """
    base = re.sub(r"[^a-z0-9-]+", "-", label.lower()).strip("-")[:40].strip("-")
    name = f"{SESSION_PREFIX}{base}-{secrets.token_hex(3)}"
    kube.run("create", "namespace", name)
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


@pytest.fixture(scope="module")
def module_namespace(kube: Kubectl, request: pytest.FixtureRequest) -> Iterator[str]:
    """One namespace for a module whose tests leave nothing behind (e.g. rejected creates)."""
    with fresh_namespace(kube, request.module.__name__.rsplit(".", 1)[-1]) as name:
        yield name


@pytest.fixture(scope="session")
def operator_kubeconfig(kube: Kubectl, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A kubeconfig for the operator's ServiceAccount, bound to exactly the chart's RBAC rules."""
    return make_operator_kubeconfig(kube, tmp_path_factory.mktemp("operator"))


@pytest.fixture(scope="session")
def operator(
    kube: Kubectl, operator_kubeconfig: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    """The operator, running for the whole session under its least-privilege identity."""
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
