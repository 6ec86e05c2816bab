"""A deployment whose children the apiserver refuses says which child and why; others carry on."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import pytest
from cluster_helpers import Kubectl, OperatorHandle, condition, get_llmd, llmd, wait_for, wait_ready

pytestmark = pytest.mark.cluster

TINY = {
    "model": {"name": "sovereign-tiny", "source": {"builtin": "sovereign-tiny"}},
    "mode": "unified",
    "runtime": {"resources": {"requests": {"cpu": "100m", "memory": "256Mi"}}},
    "decode": {"replicas": 1},
}


def test_quota_exceeded_names_the_child_and_other_deployments_keep_reconciling(
    kube: Kubectl,
    operator: OperatorHandle,
    namespace: str,
    more_namespaces: Callable[[str], AbstractContextManager[str]],
) -> None:
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "ResourceQuota",
            "metadata": {"name": "no-pdbs"},
            "spec": {"hard": {"count/poddisruptionbudgets.policy": "0"}},
        },
        namespace,
    )
    # The quota controller must have counted usage before admission enforces it.
    wait_for(
        "the ResourceQuota to be counted",
        lambda: (kube.get("resourcequota", "no-pdbs", "-n", namespace).get("status") or {}).get("used"),
    )
    kube.apply(llmd("capped", TINY), namespace)
    with more_namespaces("apply-failures-other") as other:
        kube.apply(llmd("free", TINY), other)

        def degraded() -> dict | None:
            cond = condition(get_llmd(kube, namespace, "capped"), "Degraded")
            return cond if cond and cond.get("reason") == "QuotaExceeded" else None

        cond = wait_for("Degraded=QuotaExceeded on the capped deployment", degraded, timeout=90)
        assert cond["status"] == "True"
        assert "PodDisruptionBudget/capped-unified" in cond["message"]
        assert "exceeded quota" in cond["message"]
        # The other namespace's deployment is not held up by the failing one.
        wait_ready(kube, operator, other, "free")
        events = kube.items("events", "-n", namespace, "--field-selector", "involvedObject.name=capped")
        assert any(e.get("reason") == "QuotaExceeded" for e in events), [e.get("reason") for e in events]

        # Lifting the quota lets the operator's retry converge it.
        kube.run("delete", "resourcequota", "no-pdbs", "-n", namespace)
        wait_ready(kube, operator, namespace, "capped", timeout=420)
