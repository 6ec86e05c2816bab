"""The Kubernetes vocabulary the whole operator shares: label keys, child names, condition types and
the one way to build a condition, RFC 3339 times, and what a pod says about itself.

Pure and free of every other operator module, so rendering, status, the autoscaler and the
KV-health monitor say each thing the same way. A new condition type is one line below (its writer
builds it with `condition` and writes it with `conditions_patch`; every other writer keeps it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

# ---- labels and names --------------------------------------------------------------------------

MANAGED_BY = "sovereign-operator"
APP_NAME = "sovereign"
NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
COMPONENT_LABEL = "app.kubernetes.io/component"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
# The runtime's HTTP port in every worker pod (OpenAI API, /metrics, /health/*).
RUNTIME_PORT = 8000
# Components whose pods run the runtime's `serve` (the router's pods do not).
WORKER_COMPONENTS = ("prefill", "decode", "unified")
# On worker pods (their template): what a start is a sample of (startupbudget.py), and whether the
# startup probe's budget was learned (then an overrun widens it).
MODEL_REVISION_ANNOTATION = "sovereign.ai/model-revision"
MODEL_PRECISION_ANNOTATION = "sovereign.ai/model-precision"
BUDGET_SOURCE_ANNOTATION = "sovereign.ai/startup-budget-source"


def pool_name(deployment: str, component: str) -> str:
    """A pool's StatefulSet, headless Service and PDB: `<deployment>-<component>`."""
    return f"{deployment}-{component}"


def router_name(deployment: str) -> str:
    return f"{deployment}-router"


def config_name(deployment: str) -> str:
    return f"{deployment}-runtime"


def chat_template_name(deployment: str) -> str:
    """The ConfigMap holding `runtime.chatTemplate`, mounted into the worker pods."""
    return f"{deployment}-chat-template"


def group_set_name(deployment: str, component: str) -> str:
    """A multi-node pool's LeaderWorkerSet (and LeaderWorkerSet's own headless Service for its pods):
    `<deployment>-<component>-group`; the pool's Service `<deployment>-<component>` selects its leaders."""
    return f"{deployment}-{component}-group"


def owned_labels(instance: str | None = None) -> dict[str, str]:
    """The labels selecting the children the operator owns (of one LLMDeployment, when named)."""
    labels = {MANAGED_BY_LABEL: MANAGED_BY}
    if instance is not None:
        labels[INSTANCE_LABEL] = instance
    return labels


# ---- LeaderWorkerSet (multi-node pools) ---------------------------------------------------------

LWS_GROUP = "leaderworkerset.x-k8s.io"
LWS_VERSION = "v1"
LWS_KIND = "LeaderWorkerSet"
LWS_PLURAL = "leaderworkersets"
LWS_CRD = f"{LWS_PLURAL}.{LWS_GROUP}"
# Labels LeaderWorkerSet puts on every pod of a group.
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_GROUP_KEY_LABEL = "leaderworkerset.sigs.k8s.io/group-key"


def pod_serves(pod: Mapping[str, Any]) -> bool:
    """Whether the pod serves a replica's API and metrics: every pool pod, except a multi-node group's
    workers (only its leader, worker index 0, serves)."""
    return (pod["metadata"].get("labels") or {}).get(LWS_WORKER_INDEX_LABEL, "0") == "0"


# ---- conditions --------------------------------------------------------------------------------

# Condition types of an LLMDeployment, by writer. Status is merge-patched and a merge patch replaces
# the whole list, so each writer sends every entry it does not own unchanged.
READY = "Ready"  # reconciler
PROGRESSING = "Progressing"  # reconciler
DEGRADED = "Degraded"  # reconciler
MODEL_DOWNLOADED = "ModelDownloaded"  # reconciler (huggingFace sources only)
METRICS_AVAILABLE = "MetricsAvailable"  # autoscaler
KV_TRANSFER_HEALTHY = "KVTransferHealthy"  # KV-health monitor
OUTPUT_HEALTHY = "OutputHealthy"  # output-health monitor (the pods' self-tests)
RECONCILER_CONDITIONS = (READY, PROGRESSING, DEGRADED, MODEL_DOWNLOADED)


def condition(
    kind: str,
    status: str,
    reason: str,
    message: str,
    now: str,
    previous: Mapping[str, Any] | None = None,
    observed_generation: int | None = None,
) -> dict[str, Any]:
    """A condition as status holds it (camelCase); `now` is RFC 3339. The transition time moves only
    when the status flips (Kubernetes API conventions), so `previous`'s is kept otherwise."""
    transition = now
    if previous and previous.get("status") == status and previous.get("lastTransitionTime"):
        transition = previous["lastTransitionTime"]
    cond: dict[str, Any] = {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": transition,
    }
    if observed_generation is not None:
        cond["observedGeneration"] = observed_generation
    return cond


def find_condition(conditions: Iterable[Mapping[str, Any]] | None, kind: str) -> Mapping[str, Any] | None:
    """The condition of this type in a `conditions` list (of an LLMDeployment or a pod)."""
    return next((c for c in conditions or () if c.get("type") == kind), None)


def same_condition(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> bool:
    """Equal for what it says (status, reason, message, generation); times do not count."""
    keys = ("status", "reason", "message", "observedGeneration")
    if a is None or b is None:
        return a is b
    return all(a.get(k) == b.get(k) for k in keys)


def with_condition(
    conditions: Iterable[Mapping[str, Any]] | None, kind: str, cond: Mapping[str, Any] | None
) -> list[Mapping[str, Any]]:
    """The list with this type's entry replaced by `cond` (removed with None), others as they are."""
    return [c for c in conditions or () if c.get("type") != kind] + ([cond] if cond is not None else [])


def conditions_patch(
    status: Mapping[str, Any] | None, kind: str, cond: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """A status merge patch putting (or, with None, removing) one condition; None when status
    already says that."""
    current = (status or {}).get("conditions")
    if same_condition(find_condition(current, kind), cond):
        return None
    return {"conditions": with_condition(current, kind, cond)}


# ---- times -------------------------------------------------------------------------------------


def rfc3339(ts: float) -> str:
    """Unix seconds as Kubernetes writes times: UTC, whole seconds, `Z`."""
    return datetime.fromtimestamp(ts, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_rfc3339() -> str:
    return rfc3339(datetime.now(UTC).timestamp())


def parse_rfc3339(text: str | None) -> float | None:
    """Unix seconds of a Kubernetes time; None for an absent one."""
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


# ---- pods --------------------------------------------------------------------------------------


def pod_condition(pod: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    return find_condition((pod.get("status") or {}).get("conditions"), kind)


def pod_is_ready(pod: Mapping[str, Any]) -> bool:
    """Ready and not terminating: a pod that serves."""
    ready = pod_condition(pod, "Ready")
    return bool(ready and ready.get("status") == "True") and not pod["metadata"].get("deletionTimestamp")


def pod_component(pod: Mapping[str, Any]) -> str | None:
    return (pod["metadata"].get("labels") or {}).get(COMPONENT_LABEL)


def pod_url(pod: Mapping[str, Any], path: str) -> str | None:
    """The runtime's URL for `path` on this pod; None before it has an IP."""
    ip = (pod.get("status") or {}).get("podIP")
    return f"http://{ip}:{RUNTIME_PORT}{path}" if ip else None
