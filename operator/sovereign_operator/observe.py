"""Status as a pure function of what the operator decided and what it observes in the cluster.

Inputs are plain dicts as the apiserver returns them (StatefulSets, the router Deployment, pods),
so tests drive this without a cluster. Reasons and messages say what is wrong and what to do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sovereign_operator import vocabulary
from sovereign_operator.api.status import (
    Condition,
    LLMDeploymentStatus,
    ModelStatus,
    PoolsStatus,
    PoolStatus,
)
from sovereign_operator.render import Rendered
from sovereign_operator.vocabulary import (
    DEGRADED,
    KV_TRANSFER_HEALTHY,
    MODEL_DOWNLOADED,
    OUTPUT_HEALTHY,
    PROGRESSING,
    READY,
    RECONCILER_CONDITIONS,
)

# Degraded's reason while KVTransferHealthy is False (the message carries the condition's own).
KV_UNHEALTHY = "KVTransferUnhealthy"
# Degraded's reason while OutputHealthy is False (pods failing their output self-test).
OUTPUT_UNHEALTHY = "OutputUnhealthy"
# Waiting reasons of a container that need a person, not patience.
_STUCK_WAITING = {
    "CrashLoopBackOff",
    "ImagePullBackOff",
    "ErrImagePull",
    "CreateContainerConfigError",
    "InvalidImageName",
}


@dataclass(frozen=True)
class Observed:
    """Children as read from the apiserver, keyed by component."""

    statefulsets: dict[str, dict[str, Any]] = field(default_factory=dict)
    router: dict[str, Any] | None = None
    pods: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Problem:
    """Why the operator could not realise the spec (invalid spec, rejected child, missing RBAC)."""

    reason: str
    message: str


def _condition(
    previous: list[Condition], kind: str, status: str, reason: str, message: str, now: str, generation: int
) -> Condition:
    before = next((c.to_api() for c in previous if c.type == kind), None)
    return Condition.model_validate(
        vocabulary.condition(kind, status, reason, message, now, before, generation)
    )


def _pool_status(desired: int, statefulset: dict[str, Any] | None) -> PoolStatus:
    observed = (statefulset or {}).get("status") or {}
    return PoolStatus(
        desired_replicas=desired,
        replicas=int(observed.get("replicas") or 0),
        ready_replicas=int(observed.get("readyReplicas") or 0),
        updated_replicas=int(observed.get("updatedReplicas") or 0),
    )


def _pod_problems(pods: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(reason, message) for pods that will not become ready without someone acting."""
    problems = []
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        name = pod["metadata"]["name"]
        status = pod.get("status") or {}
        for condition in status.get("conditions") or []:
            if condition.get("type") == "PodScheduled" and condition.get("reason") == "Unschedulable":
                detail = condition.get("message", "").strip().rstrip(".")
                problems.append(
                    (
                        "Unschedulable",
                        f"pod {name} cannot be scheduled: {detail}. Check that nodes offer the GPUs and RDMA"
                        " devices the pool requests (kubectl describe pod), or lower the pool's resources.",
                    )
                )
        for container in status.get("containerStatuses") or []:
            waiting = (container.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in _STUCK_WAITING:
                detail = waiting.get("message", "").strip()
                problems.append(
                    (
                        waiting["reason"],
                        f"pod {name} container {container.get('name')} is in {waiting['reason']}"
                        + (f": {detail}" if detail else "")
                        + "; see kubectl logs --previous and kubectl describe pod.",
                    )
                )
    return problems


def _is_rolling(statefulset: dict[str, Any] | None, desired: int) -> bool:
    if statefulset is None:
        return True
    status = statefulset.get("status") or {}
    generation = (statefulset.get("metadata") or {}).get("generation", 0)
    if int(status.get("observedGeneration") or 0) < int(generation):
        return True
    if status.get("updateRevision") and status.get("currentRevision") != status.get("updateRevision"):
        return True
    return int(status.get("updatedReplicas") or 0) < desired or int(status.get("replicas") or 0) != desired


def compute_status(
    generation: int,
    rendered: Rendered | None,
    observed: Observed,
    previous: LLMDeploymentStatus | None,
    now: str,
    problem: Problem | None = None,
    model: ModelStatus | None = None,
) -> LLMDeploymentStatus:
    """The status the operator wants the object to have; `now` is an RFC 3339 timestamp. `model` is
    a huggingFace source's download as last observed (modeldownload.py)."""
    before = previous or LLMDeploymentStatus()
    conditions = before.conditions

    def cond(kind: str, status: str, reason: str, message: str) -> Condition:
        return _condition(conditions, kind, status, reason, message, now, generation)

    if rendered is None:
        # Nothing could be rendered: keep what was observed before, say why in Degraded.
        assert problem is not None
        return before.model_copy(
            update={
                "observed_generation": generation,
                "conditions": [
                    cond(READY, "False", problem.reason, problem.message),
                    cond(PROGRESSING, "False", problem.reason, "waiting for a spec the operator can realise"),
                    cond(DEGRADED, "True", problem.reason, problem.message),
                ],
            }
        )

    pools: dict[str, PoolStatus] = {}
    for component, desired in rendered.replicas.items():
        pool = _pool_status(desired, observed.statefulsets.get(component))
        old = getattr(before.pools, component, None) if before.pools else None
        # The autoscaler owns its sub-object; carry it over untouched.
        pools[component] = pool.model_copy(update={"autoscaler": old.autoscaler if old else None})

    router_status = (observed.router or {}).get("status") or {}
    router_ready = int(router_status.get("readyReplicas") or 0)
    router_desired = int(((observed.router or {}).get("spec") or {}).get("replicas") or 0)

    summary = ", ".join(f"{c} {p.ready_replicas}/{p.desired_replicas}" for c, p in pools.items())
    summary += f", router {router_ready}/{router_desired} ready"
    all_ready = all(p.ready_replicas >= p.desired_replicas for p in pools.values()) and router_ready >= 1
    rolling = [c for c, p in pools.items() if _is_rolling(observed.statefulsets.get(c), p.desired_replicas)]

    pod_problems = _pod_problems(observed.pods)
    # Written by the KV-health monitor; counts only while the deployment is disaggregated.
    kv_failing = next((c for c in conditions if c.type == KV_TRANSFER_HEALTHY and c.status == "False"), None)
    if rendered.plan.mode != "disaggregated":
        kv_failing = None
    # Written by the output-health monitor from the pods' self-tests.
    output_failing = next((c for c in conditions if c.type == OUTPUT_HEALTHY and c.status == "False"), None)
    model_failing = model is not None and model.phase in ("Retrying", "Failed")
    if problem is not None:
        degraded = cond(DEGRADED, "True", problem.reason, problem.message)
    elif model is not None and model_failing:
        degraded = cond(
            DEGRADED,
            "True",
            model.reason or "DownloadFailed",
            f"downloading {model.repo}@{model.revision} failed: {model.message}"
            + (" (retried with backoff)" if model.phase == "Retrying" else ""),
        )
    elif pod_problems:
        reason, message = pod_problems[0]
        if len(pod_problems) > 1:
            message += f" ({len(pod_problems) - 1} more pod problem(s))"
        degraded = cond(DEGRADED, "True", reason, message)
    elif output_failing is not None:
        # Pods are out of the Service because their output is wrong; the message names them.
        degraded = cond(
            DEGRADED, "True", OUTPUT_UNHEALTHY, f"{output_failing.reason}: {output_failing.message}"
        )
    elif kv_failing is not None:
        # Serving, but not the way the spec asked (REFERENCE: RDMA trouble must not hide behind
        # Ready): Ready stays True, Degraded says what the KV transfer is doing.
        degraded = cond(DEGRADED, "True", KV_UNHEALTHY, f"{kv_failing.reason}: {kv_failing.message}")
    else:
        degraded = cond(DEGRADED, "False", "AsExpected", "no problems observed")

    waiting = rendered.waiting_for_model and model is not None
    if all_ready and not waiting:
        ready = cond(READY, "True", "AllReplicasReady", f"{summary}; serving at {rendered.endpoint}")
    elif waiting:
        assert model is not None
        ready = cond(
            READY,
            "False",
            "ModelNotDownloaded",
            f"the pools start once the model is downloaded ({model.progress})",
        )
    else:
        ready = cond(READY, "False", "ReplicasNotReady", f"{summary}")
    downloading = model is not None and model.phase != "Complete"
    if downloading and model is not None and model.phase == "Failed":
        progressing = cond(
            PROGRESSING, "False", model.reason or "DownloadFailed", model.message or model.progress
        )
    elif downloading and model is not None:
        message = f"{model.repo}@{model.revision}: {model.progress}"
        if model.serving is not None:
            message += f"; the pools serve commit {model.serving.commit[:12]} until it is complete"
        progressing = cond(PROGRESSING, "True", "DownloadingModel", message)
    elif rolling:
        progressing = cond(
            PROGRESSING,
            "True",
            "RollingOut",
            f"updating {', '.join(rolling)}; pods get up to {rendered.budget.seconds} s to start"
            " (startupProbe budget)",
        )
    elif not all_ready:
        progressing = cond(PROGRESSING, "True", "Starting", f"waiting for replicas: {summary}")
    else:
        progressing = cond(PROGRESSING, "False", "Stable", "all pools match the spec")

    def ratio(pool: PoolStatus | None) -> str | None:
        return None if pool is None else f"{pool.ready_replicas}/{pool.desired_replicas}"

    conditions = [ready, progressing, degraded]
    if model is not None:
        conditions.append(_model_condition(cond, model))
    decode_column = pools.get("decode") or pools.get("unified")
    return LLMDeploymentStatus(
        observed_generation=generation,
        conditions=conditions,
        mode=rendered.plan.mode,
        mode_reason=rendered.plan.reason,
        kv_transport=rendered.plan.kv_transport,
        endpoint=rendered.endpoint,
        startup_budget_seconds=rendered.budget.seconds,
        startup_budget=rendered.budget,
        pools=PoolsStatus(**pools),
        prefill_replicas=ratio(pools.get("prefill")),
        decode_replicas=ratio(decode_column),
        model=model,
    )


def _model_condition(cond: Any, model: ModelStatus) -> Condition:
    """ModelDownloaded: True once the commit is in its cache and verified; else why not yet."""
    if model.phase == "Complete":
        size = (model.bytes_total or 0) / 2**30
        return cond(
            MODEL_DOWNLOADED,
            "True",
            "Downloaded",
            f"{model.repo}@{(model.commit or '')[:12]} is in {model.cache} ({size:.1f} GiB, {model.files} files, verified)",
        )
    if model.reason:
        return cond(MODEL_DOWNLOADED, "False", model.reason, model.message or model.progress)
    what = f"{model.repo}@{model.revision}"
    if model.phase == "Resolving":
        return cond(
            MODEL_DOWNLOADED, "False", "Resolving", f"asking the hub what {what} is (the resolve Job)"
        )
    return cond(
        MODEL_DOWNLOADED, "False", "Downloading", f"{what} at {(model.commit or '')[:12]}: {model.progress}"
    )


# Pool sub-objects other writers own: the autoscaler's decision, the output monitor's speculation summary.
_FOREIGN_POOL_KEYS = ("autoscaler", "speculative")


def _without_autoscaler(status: dict[str, Any]) -> dict[str, Any]:
    pools = status.get("pools") or {}
    trimmed = {
        name: {k: v for k, v in pool.items() if k not in _FOREIGN_POOL_KEYS}
        for name, pool in pools.items()
        if pool
    }
    return {**status, "pools": trimmed} if pools else status


def status_patch(current: dict[str, Any] | None, desired: LLMDeploymentStatus) -> dict[str, Any] | None:
    """A JSON merge patch for `status`, or None when nothing the operator owns changed.

    The autoscaler's and the output monitor's sub-objects are left out so writers cannot undo each other; pools
    that no longer exist (after a mode change) are removed with null.
    """
    current = current or {}
    want = _without_autoscaler(desired.to_api())
    # Conditions are a list, replaced whole by a merge patch: keep other writers' entries.
    foreign = [c for c in current.get("conditions") or [] if c.get("type") not in RECONCILER_CONDITIONS]
    want["conditions"] = want.get("conditions", []) + foreign
    have = _without_autoscaler({k: v for k, v in current.items() if k in want or k in _owned_keys()})
    if {k: have.get(k) for k in want} == want and not (set(have) - set(want)):
        return None
    patch: dict[str, Any] = dict(want)
    for key in set(have) - set(want):
        patch[key] = None
    for pool in set(current.get("pools") or {}) - set(want.get("pools") or {}):
        patch.setdefault("pools", {})[pool] = None
    if isinstance(want.get("model"), dict) and isinstance(current.get("model"), dict):
        # One writer owns status.model whole: fields it no longer sets (a cleared failure) go.
        patch["model"] = _replacing(current["model"], want["model"])
    return patch


def _replacing(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """A merge patch turning `old` into exactly `new`: keys `new` lacks are set to null."""
    patch: dict[str, Any] = {key: None for key in old if key not in new}
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(old.get(key), dict):
            patch[key] = _replacing(old[key], value)
        else:
            patch[key] = value
    return patch


def _owned_keys() -> set[str]:
    return {LLMDeploymentStatus.model_fields[name].alias or name for name in LLMDeploymentStatus.model_fields}
