"""The operator's RBAC rules: no wildcards, and enough to apply, prune and observe every child."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from operator_specs import DEEPSEEK_SPEC, TINY_SPEC
from sovereign_operator.api import LLMDeploymentSpec
from sovereign_operator.render import ClusterFacts, DeploymentRef, render
from sovereign_operator.render.modelcache import ModelFacts, Resolved

RULES_FILE = (
    Path(__file__).resolve().parents[2] / "charts" / "sovereign" / "files" / "operator-rbac-rules.yaml"
)
PLURALS = {
    "ConfigMap": "configmaps",
    "ServiceAccount": "serviceaccounts",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    "Service": "services",
    "StatefulSet": "statefulsets",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "Deployment": "deployments",
    "NetworkPolicy": "networkpolicies",
    "Job": "jobs",
    "PersistentVolumeClaim": "persistentvolumeclaims",
    "LeaderWorkerSet": "leaderworkersets",
}
HF_SPEC = {
    "model": {
        "name": "m",
        "source": {"huggingFace": {"repo": "org/model", "cache": {"retention": "Delete"}}},
    },
    "mode": "unified",
}
MULTI_NODE_SPEC = {**DEEPSEEK_SPEC, "decode": {**DEEPSEEK_SPEC["decode"], "nodesPerReplica": 2}}


def _rules() -> list[dict[str, Any]]:
    rules = yaml.safe_load(RULES_FILE.read_text())
    assert isinstance(rules, list) and rules
    return rules


def _allowed(group: str, resource: str) -> set[str]:
    verbs: set[str] = set()
    for rule in _rules():
        if group in rule["apiGroups"] and resource in rule["resources"]:
            verbs.update(rule["verbs"])
    return verbs


def test_no_wildcards_and_well_formed() -> None:
    for rule in _rules():
        assert set(rule) == {"apiGroups", "resources", "verbs"}
        for key in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[key], rule


def test_every_rendered_kind_can_be_applied_watched_and_pruned() -> None:
    kinds: dict[str, str] = {}
    resolved = ModelFacts(resolved=Resolved("a" * 40, 1, 1))
    cases = (
        (TINY_SPEC, None),
        (DEEPSEEK_SPEC, None),
        (HF_SPEC, None),
        (HF_SPEC, resolved),
        (MULTI_NODE_SPEC, None),
    )
    for spec, model in cases:
        rendered = render(
            DeploymentRef("a", "b", "c"), LLMDeploymentSpec.model_validate(spec), ClusterFacts(), model=model
        )
        # Shared model caches are applied, listed, patched (owner references) and deleted too.
        for child in rendered.children + rendered.shared:
            group = child["apiVersion"].rpartition("/")[0]
            kinds[child["kind"]] = group
    assert {"Job", "PersistentVolumeClaim", "LeaderWorkerSet"} <= set(kinds)
    for kind, group in kinds.items():
        assert {"get", "list", "watch", "create", "patch", "delete"} <= _allowed(group, PLURALS[kind]), kind


def test_operator_holds_what_it_grants_the_router() -> None:
    rendered = render(
        DeploymentRef("a", "b", "c"), LLMDeploymentSpec.model_validate(TINY_SPEC), ClusterFacts()
    )
    role = next(c for c in rendered.children if c["kind"] == "Role")
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                assert set(rule["verbs"]) <= _allowed(group, resource)


def test_operator_can_run_its_own_loop() -> None:
    assert {"get", "list", "watch", "patch"} <= _allowed("sovereign.ai", "llmdeployments")
    assert "patch" in _allowed("sovereign.ai", "llmdeployments/status")
    assert "update" in _allowed("sovereign.ai", "llmdeployments/finalizers")
    assert {"list", "watch", "delete"} <= _allowed("", "pods") and "list" in _allowed("", "nodes")
    assert _allowed("", "pods/log") == {"get"}  # a download's progress line, read-only
    assert "create" in _allowed("", "events")
    # Whether LeaderWorkerSet is installed (multi-node pools) is read off its CRD.
    assert "get" in _allowed("apiextensions.k8s.io", "customresourcedefinitions")
    assert "update" not in _allowed("sovereign.ai", "llmdeployments"), "the operator never writes spec"


def test_nothing_beyond_what_the_operator_does() -> None:
    # Status is merge-patched, Events created (and a Pending cache claim's listed), nodes listed once
    # per spec change: no update, no watch of nodes or events, no writes of events beyond create;
    # never Secrets, exec or anything cluster-scoped it writes.
    assert _allowed("sovereign.ai", "llmdeployments/status") == {"patch"}
    assert _allowed("", "nodes") == {"list"}
    assert _allowed("", "events") == {"create", "list"}
    assert not _allowed("events.k8s.io", "events")
    for group, resource in [
        ("", "secrets"),
        ("", "pods/exec"),
        ("", "pods/portforward"),
        ("", "pods/attach"),
    ]:
        assert not _allowed(group, resource), resource
    for group, resource in [
        ("", "nodes"),
        ("", "namespaces"),
        ("apiextensions.k8s.io", "customresourcedefinitions"),
    ]:
        assert _allowed(group, resource) <= {"get", "list", "watch"}, resource
