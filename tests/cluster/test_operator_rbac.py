"""What the operator's ServiceAccount may do, as the Helm chart binds it: a `kubectl auth can-i` matrix.

The chart's RBAC objects (`helm template`: ServiceAccount, ClusterRoles, bindings, the leader-election
Role) are applied to the control plane, and the apiserver's authorizer answers every row, through the
SubjectAccessReviews `kubectl auth can-i --as` sends, all rows in one request. Both bindings the chart
makes are checked: cluster-wide (no `operator.watchNamespaces`) and bound to the watched namespaces.

The rows say what the operator needs (its children, status, events, its Lease, pods read and deleted,
nodes listed) and what it must never be able to do: read Secrets, exec into or attach to pods, write
nodes, namespaces or CRDs, mint tokens, impersonate, grant itself more, write `spec`.
"""

from __future__ import annotations

import json
import secrets
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from cluster_helpers import BIN, REPO, Kubectl

CHART = REPO / "charts" / "sovereign"
HELM = BIN / "helm"
RBAC_KINDS = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}

# (verb, resource[/subresource], where): where is "watched" (a namespace with LLMDeployments),
# "release" (the operator's own), "other" (a namespace it does not watch) or "cluster".
Row = tuple[str, str, str]
CHILD_VERBS = ("get", "list", "watch", "create", "patch", "delete")
CHILDREN = (
    "statefulsets.apps",
    "deployments.apps",
    "services",
    "configmaps",
    "serviceaccounts",
    "poddisruptionbudgets.policy",
    "roles.rbac.authorization.k8s.io",
    "rolebindings.rbac.authorization.k8s.io",
    "networkpolicies.networking.k8s.io",
    "leaderworkersets.leaderworkerset.x-k8s.io",  # multi-node pools
)
MUST: list[Row] = [
    *((verb, "llmdeployments.sovereign.ai", "watched") for verb in ("get", "list", "watch", "patch")),
    ("patch", "llmdeployments.sovereign.ai/status", "watched"),
    ("update", "llmdeployments.sovereign.ai/finalizers", "watched"),  # blockOwnerDeletion on children
    *((verb, child, "watched") for child in CHILDREN for verb in CHILD_VERBS),
    *((verb, "endpointslices.discovery.k8s.io", "watched") for verb in ("get", "list", "watch")),
    *((verb, "pods", "watched") for verb in ("get", "list", "watch", "delete")),
    ("get", "pods/log", "watched"),  # a model download's progress line
    # huggingFace sources: resolve and download Jobs, the cache claims they fill.
    *((verb, what, "watched") for what in ("jobs.batch", "persistentvolumeclaims") for verb in CHILD_VERBS),
    ("create", "events", "watched"),
    ("list", "events", "watched"),  # why a download's cache claim stays Pending
    *((verb, "leases.coordination.k8s.io", "release") for verb in ("get", "create", "update")),
    ("list", "nodes", "cluster"),
    *((verb, "namespaces", "cluster") for verb in ("get", "list", "watch")),
    *(
        (verb, "customresourcedefinitions.apiextensions.k8s.io", "cluster")
        for verb in ("get", "list", "watch")
    ),
]
MUST_NOT: list[Row] = [
    # Secrets it does not manage, anywhere.
    *(
        (verb, "secrets", where)
        for verb in ("get", "list", "watch")
        for where in ("watched", "release", "cluster")
    ),
    # Into pods.
    *(
        (verb, sub, "watched")
        for verb in ("create", "get")
        for sub in ("pods/exec", "pods/attach", "pods/portforward")
    ),
    ("create", "pods", "watched"),  # StatefulSets and Jobs create pods, not the operator
    ("patch", "pods", "watched"),
    # Cluster-scoped writes it does not need.
    *((verb, "nodes", "cluster") for verb in ("get", "watch", "patch", "update", "delete")),
    ("patch", "nodes/status", "cluster"),
    ("get", "nodes/proxy", "cluster"),
    *((verb, "namespaces", "cluster") for verb in ("create", "delete", "patch")),
    *(
        (verb, "customresourcedefinitions.apiextensions.k8s.io", "cluster")
        for verb in ("create", "update", "delete")
    ),
    ("create", "clusterroles.rbac.authorization.k8s.io", "cluster"),
    ("create", "clusterrolebindings.rbac.authorization.k8s.io", "cluster"),
    ("create", "mutatingwebhookconfigurations.admissionregistration.k8s.io", "cluster"),
    # No way to more power: grant roles it does not hold, mint tokens, act as someone else.
    *((verb, "roles.rbac.authorization.k8s.io", "watched") for verb in ("bind", "escalate")),
    ("create", "serviceaccounts/token", "watched"),
    *(("impersonate", what, "cluster") for what in ("users", "groups", "serviceaccounts")),
    # The spec is GitOps' (Argo CD); status only by merge patch; LLMDeployments are the user's.
    *((verb, "llmdeployments.sovereign.ai", "watched") for verb in ("update", "create", "delete")),
    ("update", "llmdeployments.sovereign.ai/status", "watched"),
    # Things it never manages.
    *((verb, "persistentvolumes", "cluster") for verb in ("create", "delete")),
    ("create", "cronjobs.batch", "watched"),
    ("create", "events.events.k8s.io", "watched"),
    *((verb, "events", "watched") for verb in ("watch", "patch", "delete")),
    ("update", "leases.coordination.k8s.io", "other"),  # its Lease lives in its own namespace only
]
# Bound to the watched namespaces: nothing in a namespace it does not watch.
SCOPED_MUST_NOT: list[Row] = [
    ("create", "statefulsets.apps", "other"),
    ("list", "pods", "other"),
    ("get", "configmaps", "other"),
    ("list", "llmdeployments.sovereign.ai", "cluster"),
    ("create", "configmaps", "cluster"),
]
# Cluster-wide (no watchNamespaces): LLMDeployments may live anywhere, so must its children.
CLUSTER_WIDE_MUST: list[Row] = [
    ("create", "statefulsets.apps", "other"),
    ("watch", "llmdeployments.sovereign.ai", "cluster"),
    ("list", "pods", "cluster"),
]


def _resource_attributes(verb: str, resource: str, namespace: str | None) -> dict[str, Any]:
    name, _, subresource = resource.partition("/")
    plural, _, group = name.partition(".")
    attributes: dict[str, Any] = {"verb": verb, "group": group, "resource": plural}
    if subresource:
        attributes["subresource"] = subresource
    if namespace:
        attributes["namespace"] = namespace
    return attributes


def can_i(kube: Kubectl, user: str, namespace: str, rows: list[tuple[str, str, str | None]]) -> list[bool]:
    """The apiserver's answers to `kubectl auth can-i VERB RESOURCE [-n NS] --as USER`, one per row."""
    reviews = [
        {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {
                "user": user,
                "groups": [
                    "system:serviceaccounts",
                    f"system:serviceaccounts:{namespace}",
                    "system:authenticated",
                ],
                "resourceAttributes": _resource_attributes(verb, resource, ns),
            },
        }
        for verb, resource, ns in rows
    ]
    out = kube.run(
        "create",
        "-o",
        "json",
        "-f",
        "-",
        stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": reviews}),
    )
    # kubectl prints one JSON document per created review.
    items: list[dict[str, Any]] = []
    decoder, text, at = json.JSONDecoder(), out.stdout, 0
    while text[at:].strip():
        at += len(text[at:]) - len(text[at:].lstrip())
        item, at = decoder.raw_decode(text, at)
        items.extend(item["items"] if item.get("kind") == "List" else [item])
    assert len(items) == len(rows)
    return [bool(item["status"].get("allowed")) for item in items]


@pytest.fixture
def chart_rbac(kube: Kubectl, namespace: str, request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    """The chart's RBAC objects for a release in a fresh namespace, watching that namespace
    (request.param "scoped") or the whole cluster ("cluster-wide"). `default` is a namespace it does
    not watch."""
    if not HELM.exists():
        pytest.skip(f"needs helm at {HELM} (built with the local control plane: make tools)")
    release = f"rbac-{secrets.token_hex(3)}"
    version = json.loads(kube.run("version", "-o", "json").stdout)["serverVersion"]["gitVersion"]
    args = [str(HELM), "template", release, str(CHART), "--namespace", namespace, "--kube-version", version]
    if request.param == "scoped":
        args += ["--set", f"operator.watchNamespaces={{{namespace}}}"]
    rendered = subprocess.run(args, capture_output=True, text=True, timeout=120, check=True).stdout
    objects = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] in RBAC_KINDS]
    kube.apply({"apiVersion": "v1", "kind": "List", "items": objects})
    try:
        yield {
            "user": f"system:serviceaccount:{namespace}:{release}-sovereign",
            "release": namespace,
            "watched": namespace,
            "other": "default",
        }
    finally:
        # Namespaced objects go with the namespace.
        for obj in objects:
            if obj["kind"].startswith("Cluster"):
                kube.run(
                    "delete", obj["kind"].lower(), obj["metadata"]["name"], "--ignore-not-found", check=False
                )


def _check(kube: Kubectl, chart_rbac: dict[str, str], rows: list[Row], expected: bool) -> list[str]:
    resolved = [
        (verb, resource, None if where == "cluster" else chart_rbac[where]) for verb, resource, where in rows
    ]
    answers = can_i(kube, chart_rbac["user"], chart_rbac["release"], resolved)
    word = "cannot" if expected else "may"
    return [
        f"{word} {verb} {resource} ({where})"
        for (verb, resource, where), ok in zip(rows, answers, strict=True)
        if ok != expected
    ]


@pytest.mark.parametrize("chart_rbac", ["scoped", "cluster-wide"], indirect=True)
def test_the_operators_service_account_can_do_what_it_needs_and_nothing_it_must_not(
    kube: Kubectl, chart_rbac: dict[str, str], request: pytest.FixtureRequest
) -> None:
    scoped = "scoped" in request.node.name
    wrong = _check(kube, chart_rbac, MUST + ([] if scoped else CLUSTER_WIDE_MUST), expected=True)
    wrong += _check(kube, chart_rbac, MUST_NOT + (SCOPED_MUST_NOT if scoped else []), expected=False)
    assert not wrong, f"{chart_rbac['user']}:\n" + "\n".join(wrong)
