"""Multi-node pools (nodesPerReplica > 1): a LeaderWorkerSet per pool, the leaders behind the pool's
Service, group status with the failed member, a clear condition without LeaderWorkerSet, whole groups
for the autoscaler."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
from operator_fakes import FakeKube, body_for
from operator_specs import DEEPSEEK_SPEC, TINY_SPEC, with_changes
from sovereign_operator.api import LLMDeploymentSpec
from sovereign_operator.api.document import InvalidDeployment, check_name
from sovereign_operator.autoscale.controller import _pods_of
from sovereign_operator.observe import Observed, compute_status, group_statuses
from sovereign_operator.reconcile import LWS_RETRY_SECONDS, Reconciler, RetryLater, budget_in_force
from sovereign_operator.render import ClusterFacts, DeploymentRef, Rendered, render
from sovereign_operator.render.plan import GROUP_START_SECONDS, startup_budget

REF = DeploymentRef(name="ds", namespace="team-a", uid="uid-1")
RDMA = "rdma/rdma_shared_device_a"
H100_SPEC = with_changes(
    DEEPSEEK_SPEC,
    decode={"replicas": 2, "nodesPerReplica": 2},
    prefill={"replicas": 1, "nodesPerReplica": 2, "nodeParallelism": "tensor"},
)


def _render(spec: dict[str, Any]) -> Rendered:
    return render(REF, LLMDeploymentSpec.model_validate(spec), ClusterFacts(frozenset({RDMA})))


def _kinds(rendered: Rendered) -> list[tuple[str, str]]:
    return [(c["kind"], c["metadata"]["name"]) for c in rendered.children]


def _lws(rendered: Rendered, component: str) -> dict[str, Any]:
    return next(
        c
        for c in rendered.children
        if c["kind"] == "LeaderWorkerSet" and c["metadata"]["name"] == f"ds-{component}-group"
    )


def _args(template: dict[str, Any]) -> dict[str, str]:
    args = template["spec"]["containers"][0]["args"]
    return {a: args[i + 1] for i, a in enumerate(args) if a.startswith("--") and i + 1 < len(args)}


# ---- rendering ---------------------------------------------------------------------------------------


def test_a_multi_node_pool_is_one_leader_worker_set_and_a_single_node_pool_stays_a_stateful_set() -> None:
    rendered = _render(with_changes(H100_SPEC, prefill={"replicas": 1}))
    kinds = _kinds(rendered)
    assert ("LeaderWorkerSet", "ds-decode-group") in kinds and ("StatefulSet", "ds-decode") not in kinds
    assert ("StatefulSet", "ds-prefill") in kinds and ("LeaderWorkerSet", "ds-prefill-group") not in kinds
    lws = _lws(rendered, "decode")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["spec"]["replicas"] == 2
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert lws["metadata"]["ownerReferences"][0]["kind"] == "LLMDeployment"
    # The router's Service takes the groups' leaders only; the PDB covers every member.
    service = next(
        c for c in rendered.children if c["kind"] == "Service" and c["metadata"]["name"] == "ds-decode"
    )
    assert service["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    pdb = next(
        c
        for c in rendered.children
        if c["kind"] == "PodDisruptionBudget" and c["metadata"]["name"] == "ds-decode"
    )
    assert "leaderworkerset.sigs.k8s.io/worker-index" not in pdb["spec"]["selector"]["matchLabels"]


def test_every_member_gets_the_gpus_and_rdma_and_the_groups_flags() -> None:
    rendered = _render(H100_SPEC)
    decode, prefill = _lws(rendered, "decode"), _lws(rendered, "prefill")
    budget = rendered.budget
    assert budget.group_seconds == GROUP_START_SECONDS
    for template in (decode["spec"]["leaderWorkerTemplate"][t] for t in ("leaderTemplate", "workerTemplate")):
        container = template["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
        assert container["resources"]["limits"][RDMA] == 1
        args = _args(template)
        # Pipeline over nodes by default: TP 8 within each node, 2 stages.
        assert args["--tensor-parallel-size"] == "8" and args["--pipeline-parallel-size"] == "2"
        assert args["--nnodes"] == "2" and args["--rendezvous-timeout"] == str(budget.seconds)
        # The group waits for its slowest rank: the probe allows the group's start.
        startup = container["startupProbe"]
        assert startup["failureThreshold"] * startup["periodSeconds"] == budget.seconds
        assert "--node-rank" not in args and "--leader-address" not in args  # LeaderWorkerSet's environment
    args = _args(prefill["spec"]["leaderWorkerTemplate"]["leaderTemplate"])
    assert (
        args["--tensor-parallel-size"] == "16" and "--pipeline-parallel-size" not in args
    )  # nodeParallelism tensor


def test_the_group_term_is_part_of_the_formula_and_the_budget_in_force_is_kept() -> None:
    spec = LLMDeploymentSpec.model_validate(H100_SPEC)
    single = startup_budget(LLMDeploymentSpec.model_validate(DEEPSEEK_SPEC))
    rendered = _render(H100_SPEC)
    formula = rendered.formula
    assert formula.seconds == formula.formula_seconds == single.seconds + GROUP_START_SECONDS
    assert formula.cold_seconds == (single.cold_seconds or 0) + GROUP_START_SECONDS  # a learned budget's cap
    assert f"group start {GROUP_START_SECONDS} s" in (formula.reason or "")
    # The reconciler renders the budget in force; the status refresh then decides the same one (no
    # re-render on every refresh).
    decided = budget_in_force(rendered, None)
    again = render(REF, spec, ClusterFacts(frozenset({RDMA})), budget=decided)
    assert again.budget == decided
    assert budget_in_force(again, {"startupBudget": decided.model_dump(by_alias=True)}) == decided
    # The groups' templates are the pods a learned budget waits to roll with: another budget (its probe
    # and the group's --rendezvous-timeout) leaves the hash alone, another image changes it.
    learned = decided.model_copy(update={"seconds": decided.seconds - 300, "source": "observed"})
    with_learned = render(REF, spec, ClusterFacts(frozenset({RDMA})), budget=learned)
    assert _args(_lws(with_learned, "decode")["spec"]["leaderWorkerTemplate"]["workerTemplate"])[
        "--rendezvous-timeout"
    ] == str(learned.seconds)
    assert with_learned.template_hash == rendered.template_hash
    other_image = _render(with_changes(H100_SPEC, runtime={"image": "example.com/sovereign-runtime:other"}))
    assert other_image.template_hash != rendered.template_hash
    # An override is the budget, with no group term.
    overridden = _render(with_changes(H100_SPEC, startup={"budgetSeconds": 600}))
    assert overridden.budget.seconds == 600 and overridden.budget.group_seconds == 0


def test_workers_serve_no_api_and_leave_when_the_leader_stops_them() -> None:
    group = _lws(_render(H100_SPEC), "decode")["spec"]["leaderWorkerTemplate"]
    leader, worker = (group[t]["spec"]["containers"][0] for t in ("leaderTemplate", "workerTemplate"))
    assert "preStop" in leader["lifecycle"] and "lifecycle" not in worker
    assert [p["name"] for p in leader["ports"]] == ["http", "kv"] and [
        p["name"] for p in worker["ports"]
    ] == ["http"]
    for container in (leader, worker):  # the worker's own probes: its ranks' phases
        assert container["startupProbe"]["httpGet"]["path"] == "/health/startup"
        assert container["readinessProbe"]["httpGet"]["path"] == "/health/ready"


def test_members_prefer_one_network_domain_unless_the_pool_sets_its_own_pod_affinity() -> None:
    template = _lws(_render(H100_SPEC), "decode")["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    terms = template["spec"]["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    keys = [t["podAffinityTerm"]["topologyKey"] for t in terms]
    assert (
        keys[0] == "network.topology.nvidia.com/accelerator" and "network.topology.nvidia.com/spine" in keys
    )
    assert all(
        t["podAffinityTerm"]["matchLabelKeys"] == ["leaderworkerset.sigs.k8s.io/group-key"] for t in terms
    )
    own = {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": []}, "nodeAffinity": {"x": 1}}
    spec = with_changes(H100_SPEC, decode__affinity=own)
    affinity = _lws(_render(spec), "decode")["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"][
        "affinity"
    ]
    assert affinity == own


def test_a_groups_ranks_may_reach_each_other_on_any_port() -> None:
    rendered = _render(with_changes(H100_SPEC, prefill={"replicas": 1}))
    policies = {c["metadata"]["name"]: c for c in rendered.children if c["kind"] == "NetworkPolicy"}
    decode_rules = policies["ds-decode"]["spec"]["ingress"]
    prefill_rules = policies["ds-prefill"]["spec"]["ingress"]
    own = {
        "podSelector": {
            "matchLabels": {
                "app.kubernetes.io/component": "decode",
                "app.kubernetes.io/instance": "ds",
                "app.kubernetes.io/name": "sovereign",
            }
        }
    }
    assert {"from": [own]} in decode_rules
    assert not any("ports" not in rule for rule in prefill_rules)


def test_autoscaled_multi_node_pools_scale_groups() -> None:
    spec = with_changes(
        H100_SPEC, decode={"nodesPerReplica": 2, "autoscaling": {"minReplicas": 1, "maxReplicas": 4}}
    )
    rendered = render(
        REF, LLMDeploymentSpec.model_validate(spec), ClusterFacts(frozenset({RDMA})), {"decode": 3}
    )
    assert _lws(rendered, "decode")["spec"]["replicas"] == 3


def test_a_multi_node_pool_needs_a_name_short_enough_for_its_stateful_sets() -> None:
    spec = LLMDeploymentSpec.model_validate(H100_SPEC)
    check_name("a" * 32, spec)
    with pytest.raises(
        InvalidDeployment, match="at most 32 characters when a pool has nodesPerReplica above 1"
    ):
        check_name("a" * 33, spec)
    check_name("a" * 40, LLMDeploymentSpec.model_validate(DEEPSEEK_SPEC))


# ---- status ------------------------------------------------------------------------------------------


def _pod(name: str, group: int, worker: int, ready: bool = True, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "labels": {
                "app.kubernetes.io/component": "decode",
                "leaderworkerset.sigs.k8s.io/name": "ds-decode-group",
                "leaderworkerset.sigs.k8s.io/group-index": str(group),
                "leaderworkerset.sigs.k8s.io/worker-index": str(worker),
            },
        },
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}], **status},
    }


CRASHED = {
    "containerStatuses": [
        {
            "name": "runtime",
            "restartCount": 2,
            "state": {"running": {}},
            "lastState": {"terminated": {"exitCode": 1, "reason": "Error"}},
        }
    ]
}


def test_group_status_names_the_member_that_failed() -> None:
    pods = [
        _pod("ds-decode-group-0", 0, 0),
        _pod("ds-decode-group-0-1", 0, 1),
        _pod("ds-decode-group-1", 1, 0, ready=False),
        _pod("ds-decode-group-1-1", 1, 1, ready=False, **CRASHED),
        _pod("ds-decode-group-2", 2, 0, ready=False),  # starting: not a failure
        {"metadata": {"name": "other", "labels": {}}, "status": {}},
    ]
    groups = group_statuses(pods, "ds-decode-group", 2)
    assert [(g.index, g.ready_members, g.failed_member) for g in groups] == [
        (0, 2, None),
        (1, 0, "ds-decode-group-1-1"),
        (2, 0, None),
    ]
    assert groups[1].reason == "container runtime exited with code 1 (Error), restarted 2 time(s)"
    assert groups[1].leader == "ds-decode-group-1"


def test_pool_status_counts_groups_and_lists_them() -> None:
    rendered = _render(with_changes(H100_SPEC, prefill={"replicas": 1}))
    lws = {"metadata": {"generation": 1}, "spec": {"replicas": 2}}
    lws["status"] = {"observedGeneration": 1, "replicas": 2, "readyReplicas": 1, "updatedReplicas": 2}
    sts = {
        "metadata": {"generation": 1},
        "status": {"observedGeneration": 1, "replicas": 1, "readyReplicas": 1, "updatedReplicas": 1},
    }
    pods = [
        _pod("ds-decode-group-0", 0, 0),
        _pod("ds-decode-group-0-1", 0, 1),
        _pod("ds-decode-group-1-1", 1, 1, ready=False, **CRASHED),
    ]
    observed = Observed(
        statefulsets={"prefill": sts},
        leader_worker_sets={"decode": lws},
        router={"spec": {"replicas": 1}, "status": {"readyReplicas": 1}},
        pods=pods,
    )
    status = compute_status(1, rendered, observed, None, "2026-01-01T00:00:00Z")
    decode = status.pools.decode  # type: ignore[union-attr]
    assert decode is not None and decode.nodes_per_replica == 2
    assert (decode.desired_replicas, decode.ready_replicas) == (2, 1)
    assert [g.failed_member for g in decode.groups or []] == [None, "ds-decode-group-1-1"]
    assert status.pools.prefill.groups is None  # type: ignore[union-attr]
    assert "decode 1/2" in status.conditions[0].message


def test_the_autoscaler_counts_a_group_by_its_leader() -> None:
    pods = [
        _pod("ds-decode-group-0", 0, 0),
        _pod("ds-decode-group-0-1", 0, 1),
        _pod("ds-decode-group-1", 1, 0),
    ]
    plain = {"metadata": {"name": "x-decode-0", "labels": {"app.kubernetes.io/component": "decode"}}}
    assert [p["metadata"]["name"] for p in _pods_of([*pods, plain], "decode")] == [
        "ds-decode-group-0",
        "ds-decode-group-1",
        "x-decode-0",
    ]


# ---- reconciling ------------------------------------------------------------------------------------


def test_without_leader_worker_set_the_deployment_is_degraded_and_retried_then_applied() -> None:
    body = body_for(H100_SPEC)
    body["metadata"]["name"] = "ds"
    kube = FakeKube(body, frozenset({RDMA}))
    kube.lws_installed = False
    reconciler = Reconciler(kube, clock=lambda: "2026-01-01T00:00:00Z")

    async def scenario() -> None:
        with pytest.raises(RetryLater) as raised:
            await reconciler.reconcile(copy.deepcopy(kube.body))
        assert raised.value.delay == LWS_RETRY_SECONDS
        assert kube.applies == 0
        degraded = next(c for c in kube.body["status"]["conditions"] if c["type"] == "Degraded")
        assert degraded["status"] == "True" and degraded["reason"] == "LeaderWorkerSetNotInstalled"
        assert "leaderworkersets.leaderworkerset.x-k8s.io" in degraded["message"]
        assert "nodesPerReplica" in degraded["message"]
        kube.lws_installed = True
        await reconciler.reconcile(copy.deepcopy(kube.body))
        assert ("LeaderWorkerSet", "ds-decode-group") in kube.children
        degraded = next(c for c in kube.body["status"]["conditions"] if c["type"] == "Degraded")
        assert degraded["status"] == "False"

    asyncio.run(scenario())


def test_single_node_pools_never_ask_for_leader_worker_set() -> None:
    kube = FakeKube(body_for(TINY_SPEC))
    kube.lws_installed = False
    asyncio.run(Reconciler(kube, clock=lambda: "2026-01-01T00:00:00Z").reconcile(kube.body))
    assert kube.applies > 0 and not any(kind == "LeaderWorkerSet" for kind, _ in kube.children)
