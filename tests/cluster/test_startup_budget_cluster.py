"""Startup budgets learned from observed starts, on a real control plane: kwok's pods start (Ready a
few seconds after their containers), the operator records each start under the node's GPU product
label (read under its least-privilege identity), keeps the StatefulSet as it is, and brings the
learned budget with the next rollout."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
from cluster_helpers import DEEPSEEK_V3_FP8, Kubectl, OperatorHandle, get_llmd, llmd, wait_for, wait_ready

pytestmark = [pytest.mark.cluster, pytest.mark.fake_gpu_nodes]

GPU_PRODUCT = "nvidia.com/gpu.product"


def startup_threshold(sts: dict[str, Any]) -> int:
    return int(sts["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["failureThreshold"])


def test_starts_are_learned_and_the_budget_comes_with_the_next_rollout(
    kube: Kubectl, operator: OperatorHandle, namespace: str
) -> None:
    # The local cluster has two GPU products (kwok's H200 and H100 nodes, equally free to the scheduler):
    # pinned, the start is a sample of one known node type, wherever earlier tests left pods.
    decode = {"replicas": 1, "nodeSelector": {GPU_PRODUCT: "NVIDIA-H200"}}
    spec: dict[str, Any] = {**copy.deepcopy(DEEPSEEK_V3_FP8), "mode": "unified", "decode": decode}
    kube.apply(llmd("ds", spec), namespace)
    wait_ready(kube, operator, namespace, "ds")
    [pod] = kube.items(
        "pods", "-n", namespace, "-l", "app.kubernetes.io/instance=ds,app.kubernetes.io/component=unified"
    )
    node = kube.get("node", pod["spec"]["nodeName"])
    assert node["metadata"]["labels"][GPU_PRODUCT] == "NVIDIA-H200", pod["spec"]["nodeName"]

    def observed() -> dict[str, Any] | None:
        status = get_llmd(kube, namespace, "ds").get("status") or {}
        return status if (status.get("startupObservations") or {}).get("samples") else None

    status = wait_for("a start in status.startupObservations", observed, timeout=60)
    [profile] = status["startupObservations"]["profiles"]
    assert (profile["revision"], profile["precision"], profile["nodeType"]) == (
        "hostPath:/models/deepseek-v3",
        "fp8",
        "NVIDIA-H200",
    )
    [sample] = profile["samples"]
    assert sample["pod"] == "ds-unified-0" and 0 <= sample["seconds"] < 60
    budget = status["startupBudget"]
    assert budget["source"] == "formula" and budget["seconds"] == budget["formulaSeconds"]
    # The start changed status, not the pods: the StatefulSet is as first applied.
    sts = kube.get("statefulset", "ds-unified", "-n", namespace)
    assert sts["metadata"]["generation"] == 1 and startup_threshold(sts) == budget["seconds"] // 10
    learned = status["startupObservations"]["learnedSeconds"]
    floor = budget["baseSeconds"] + budget["weightLoadSeconds"]
    assert learned == max(math.ceil(math.ceil(sample["seconds"] * 1.5) / 10) * 10, math.ceil(floor / 10) * 10)
    assert learned < budget["seconds"]

    # A change that rolls the pods anyway brings the learned budget with it.
    spec["runtime"]["args"] = ["--max-num-seqs", "64"]
    kube.apply(llmd("ds", spec), namespace)

    def applied() -> dict[str, Any] | None:
        status = get_llmd(kube, namespace, "ds").get("status") or {}
        in_force = status.get("startupBudget") or {}
        return (
            in_force
            if status.get("observedGeneration") == 2 and in_force.get("source") == "observed"
            else None
        )

    budget = wait_for("the learned budget in force", applied, timeout=120)
    assert (budget["seconds"], budget["samples"], budget["nodeType"]) == (learned, 1, "NVIDIA-H200")
    assert budget["reason"].startswith("learned from 1 observed starts: p95")
    sts = kube.get("statefulset", "ds-unified", "-n", namespace)
    assert startup_threshold(sts) == learned // 10
    assert (
        sts["spec"]["template"]["metadata"]["annotations"]["sovereign.ai/startup-budget-source"] == "observed"
    )
    wait_ready(kube, operator, namespace, "ds")
