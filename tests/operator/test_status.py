"""Status computation: pure, from what was rendered and what the children report."""

from __future__ import annotations

from typing import Any

import pytest
from operator_specs import DEEPSEEK_SPEC, TINY_SPEC
from sovereign_operator.api import LLMDeploymentSpec
from sovereign_operator.api.status import LLMDeploymentStatus
from sovereign_operator.observe import Observed, Problem, compute_status, status_patch
from sovereign_operator.render import ClusterFacts, DeploymentRef, Rendered, render

REF = DeploymentRef(name="llm", namespace="ns", uid="u", generation=2)
T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def _rendered(spec: dict[str, Any] = DEEPSEEK_SPEC) -> Rendered:
    return render(REF, LLMDeploymentSpec.model_validate(spec), ClusterFacts())


def _sts(replicas: int, ready: int, updated: int | None = None, generation: int = 1) -> dict[str, Any]:
    return {
        "metadata": {"generation": generation},
        "status": {
            "observedGeneration": generation,
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": replicas if updated is None else updated,
            "currentRevision": "r1",
            "updateRevision": "r1",
        },
    }


def _router(ready: int) -> dict[str, Any]:
    return {"spec": {"replicas": 1}, "status": {"readyReplicas": ready}}


def _conditions(status: LLMDeploymentStatus) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status, c.reason) for c in status.conditions}


def test_all_ready_is_ready_and_stable() -> None:
    observed = Observed(statefulsets={"prefill": _sts(1, 1), "decode": _sts(1, 1)}, router=_router(1))
    status = compute_status(2, _rendered(), observed, None, T0)
    assert _conditions(status) == {
        "Ready": ("True", "AllReplicasReady"),
        "Progressing": ("False", "Stable"),
        "Degraded": ("False", "AsExpected"),
    }
    assert status.observed_generation == 2
    assert status.mode == "disaggregated" and status.kv_transport == "rdma"
    assert status.endpoint == "http://llm.ns.svc:8000/v1"
    assert status.startup_budget_seconds == 1600 and status.startup_budget is not None
    assert (status.prefill_replicas, status.decode_replicas) == ("1/1", "1/1")
    assert status.pools is not None and status.pools.decode is not None
    assert status.pools.decode.ready_replicas == 1


def test_starting_pool_is_progressing_and_names_the_budget() -> None:
    observed = Observed(statefulsets={"prefill": _sts(1, 0), "decode": _sts(1, 1)}, router=_router(1))
    status = compute_status(2, _rendered(), observed, None, T0)
    assert _conditions(status)["Ready"] == ("False", "ReplicasNotReady")
    ready_message = next(c.message for c in status.conditions if c.type == "Ready")
    assert "prefill 0/1" in ready_message
    assert status.prefill_replicas == "0/1"


def test_rollout_in_progress() -> None:
    sts = _sts(1, 1, updated=0)
    sts["status"]["updateRevision"] = "r2"
    observed = Observed(statefulsets={"prefill": sts, "decode": _sts(1, 1)}, router=_router(1))
    status = compute_status(2, _rendered(), observed, None, T0)
    progressing = next(c for c in status.conditions if c.type == "Progressing")
    assert (progressing.status, progressing.reason) == ("True", "RollingOut")
    assert "prefill" in progressing.message and "1600 s" in progressing.message


def test_unschedulable_pod_is_degraded_with_the_scheduler_message() -> None:
    pod = {
        "metadata": {"name": "llm-decode-0"},
        "status": {
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/3 nodes are available: 3 Insufficient rdma/rdma_shared_device_a.",
                }
            ]
        },
    }
    observed = Observed(
        statefulsets={"prefill": _sts(1, 1), "decode": _sts(1, 0)}, router=_router(1), pods=[pod]
    )
    status = compute_status(2, _rendered(), observed, None, T0)
    degraded = next(c for c in status.conditions if c.type == "Degraded")
    assert (degraded.status, degraded.reason) == ("True", "Unschedulable")
    assert "llm-decode-0" in degraded.message and "Insufficient rdma" in degraded.message
    assert "GPUs and RDMA devices" in degraded.message and "claims" not in degraded.message


@pytest.mark.parametrize(
    "said",
    [
        "0/3 nodes are available: pod has unbound immediate PersistentVolumeClaims.",
        "0/3 nodes are available: 1 node(s) had volume node affinity conflict, 2 Insufficient cpu.",
        "0/2 nodes are available: 2 node(s) didn't find available persistent volumes to bind.",
    ],
)
def test_a_pod_its_volumes_keep_off_every_node_is_pointed_at_its_claims(said: str) -> None:
    pod = {
        "metadata": {"name": "llm-decode-0"},
        "status": {
            "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": said}
            ]
        },
    }
    observed = Observed(
        statefulsets={"prefill": _sts(1, 1), "decode": _sts(1, 0)}, router=_router(1), pods=[pod]
    )
    status = compute_status(2, _rendered(), observed, None, T0)
    degraded = next(c for c in status.conditions if c.type == "Degraded")
    assert degraded.reason == "Unschedulable" and said.rstrip(".") in degraded.message
    assert "kubectl describe pvc" in degraded.message and "GPUs" not in degraded.message


def test_crash_loop_is_degraded() -> None:
    pod = {
        "metadata": {"name": "llm-unified-0"},
        "status": {
            "containerStatuses": [
                {
                    "name": "runtime",
                    "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off"}},
                }
            ]
        },
    }
    status = compute_status(
        2, _rendered(TINY_SPEC), Observed(statefulsets={"unified": _sts(1, 0)}, pods=[pod]), None, T0
    )
    assert _conditions(status)["Degraded"] == ("True", "CrashLoopBackOff")
    assert status.decode_replicas == "0/1" and status.prefill_replicas is None


def test_invalid_spec_keeps_old_fields_and_says_why() -> None:
    healthy = compute_status(
        1,
        _rendered(),
        Observed(statefulsets={"prefill": _sts(1, 1), "decode": _sts(1, 1)}, router=_router(1)),
        None,
        T0,
    )
    problem = Problem("InvalidSpec", "spec.mode: Input should be 'unified', 'disaggregated' or 'auto'")
    status = compute_status(3, None, Observed(), healthy, T1, problem)
    assert status.observed_generation == 3
    assert _conditions(status)["Degraded"] == ("True", "InvalidSpec")
    assert _conditions(status)["Ready"] == ("False", "InvalidSpec")
    assert status.mode == "disaggregated"  # what is running is still described


def test_transition_time_moves_only_when_status_flips() -> None:
    observed = Observed(statefulsets={"prefill": _sts(1, 1), "decode": _sts(1, 1)}, router=_router(1))
    first = compute_status(2, _rendered(), observed, None, T0)
    again = compute_status(2, _rendered(), observed, first, T1)
    assert all(c.last_transition_time == T0 for c in again.conditions)
    not_ready = Observed(statefulsets={"prefill": _sts(1, 0), "decode": _sts(1, 1)}, router=_router(1))
    later = compute_status(2, _rendered(), not_ready, again, T1)
    times = {c.type: c.last_transition_time for c in later.conditions}
    assert times["Ready"] == T1 and times["Degraded"] == T0


def test_status_patch_is_none_when_nothing_changed_and_spares_autoscaler_fields() -> None:
    observed = Observed(statefulsets={"prefill": _sts(1, 1), "decode": _sts(1, 1)}, router=_router(1))
    desired = compute_status(2, _rendered(), observed, None, T0)
    assert status_patch(None, desired) is not None
    current = desired.to_api()
    current["pools"]["decode"]["autoscaler"] = {"desiredReplicas": 3, "signal": "itl"}
    current["conditions"].append(
        {"type": "MetricsAvailable", "status": "True", "reason": "Scraped", "lastTransitionTime": T0}
    )
    assert status_patch(current, desired) is None
    current["pools"]["decode"]["readyReplicas"] = 0
    patch = status_patch(current, desired)
    assert patch is not None
    assert "autoscaler" not in patch["pools"]["decode"]
    assert any(c["type"] == "MetricsAvailable" for c in patch["conditions"])


def test_status_patch_removes_pools_of_the_old_mode() -> None:
    unified = compute_status(
        2, _rendered(TINY_SPEC), Observed(statefulsets={"unified": _sts(1, 1)}), None, T0
    )
    disaggregated = compute_status(
        2, _rendered(), Observed(statefulsets={"prefill": _sts(1, 1), "decode": _sts(1, 1)}), None, T0
    )
    patch = status_patch(unified.to_api(), disaggregated)
    assert patch is not None and patch["pools"]["unified"] is None
