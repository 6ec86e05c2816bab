"""Status as a pure function of what the operator decided and what it observes in the cluster.

Inputs are plain dicts as the apiserver returns them (StatefulSets, the router Deployment, pods),
so tests drive this without a cluster. Reasons and messages say what is wrong and what to do.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sovereign_operator import vocabulary
from sovereign_operator.api.status import (
    Condition,
    GroupStatus,
    LLMDeploymentStatus,
    ModelStatus,
    PoolsStatus,
    PoolStatus,
    StartupObservations,
)
from sovereign_operator.modeldownload import CLAIM_PENDING
from sovereign_operator.podstatus import (
    CONTAINER_CONFIG_REASONS,
    CRASH_LOOP,
    IMAGE_PULL_WAITING,
    BudgetFacts,
    LifeMemory,
    PodProblem,
    container_statuses,
    current_life,
    observed_startup_seconds,
    pod_problems,
    readiness_failing,
)
from sovereign_operator.render import Rendered
from sovereign_operator.startupbudget import learn, observe_starts, record
from sovereign_operator.vocabulary import (
    DEGRADED,
    KV_TRANSFER_HEALTHY,
    LWS_GROUP_INDEX_LABEL,
    LWS_NAME_LABEL,
    LWS_WORKER_INDEX_LABEL,
    MODEL_DOWNLOADED,
    OUTPUT_HEALTHY,
    PROGRESSING,
    READY,
    RECONCILER_CONDITIONS,
    WORKER_COMPONENTS,
    parse_rfc3339,
    pod_component,
    pod_is_ready,
    pod_serves,
)

# Degraded's reason while KVTransferHealthy is False (the message carries the condition's own).
KV_UNHEALTHY = "KVTransferUnhealthy"
# Degraded's reason while OutputHealthy is False (pods failing their output self-test).
OUTPUT_UNHEALTHY = "OutputUnhealthy"
# Pods named in a message beside the first problem, and starting pods named in Progressing.
MORE_PROBLEMS_NAMED = 3
STARTING_PODS_NAMED = 4


@dataclass(frozen=True)
class Observed:
    """Children as read from the apiserver, keyed by component."""

    statefulsets: dict[str, dict[str, Any]] = field(default_factory=dict)
    router: dict[str, Any] | None = None
    pods: list[dict[str, Any]] = field(default_factory=list)
    # What the startup monitor remembers of each container life (podstatus.LifeMemory), by life id.
    lives: Mapping[str, LifeMemory] = field(default_factory=dict)
    # Labels of the nodes the worker pods run on, by node name (the GPU product names a start's node type).
    node_labels: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # Multi-node pools: their LeaderWorkerSets (replicas, readyReplicas... count groups).
    leader_worker_sets: dict[str, dict[str, Any]] = field(default_factory=dict)

    def pool_set(self, component: str) -> dict[str, Any] | None:
        """The object running a pool's replicas: its LeaderWorkerSet, else its StatefulSet."""
        return self.leader_worker_sets.get(component) or self.statefulsets.get(component)


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


def _pool_status(desired: int, statefulset: dict[str, Any] | None, pods: list[dict[str, Any]]) -> PoolStatus:
    observed = (statefulset or {}).get("status") or {}
    startups = [s for s in (observed_startup_seconds(p) for p in pods) if s is not None]
    return PoolStatus(
        desired_replicas=desired,
        replicas=int(observed.get("replicas") or 0),
        ready_replicas=int(observed.get("readyReplicas") or 0),
        updated_replicas=int(observed.get("updatedReplicas") or 0),
        observed_startup_seconds=max(startups) if startups else None,
    )


# Waiting reasons of a member that will not start without someone acting.
_GROUP_STUCK_WAITING = (CRASH_LOOP, *CONTAINER_CONFIG_REASONS, *IMAGE_PULL_WAITING)


def _member_problem(pod: dict[str, Any]) -> str | None:
    """Why a group member failed (restarts, a stuck container, unschedulable, going away), or None while
    it is merely starting or serving."""
    status = pod.get("status") or {}
    if pod["metadata"].get("deletionTimestamp"):
        return "terminating (LeaderWorkerSet restarts the group as one)"
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("reason") == "Unschedulable":
            return f"unschedulable: {condition.get('message', '').strip().rstrip('.')}"
    if status.get("phase") == "Failed":
        return f"failed: {status.get('reason') or status.get('message') or 'the pod failed'}"
    for container in status.get("containerStatuses") or []:
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in _GROUP_STUCK_WAITING:
            return f"{waiting['reason']}: {waiting.get('message', '').strip()}".rstrip(": ")
        terminated = (container.get("state") or {}).get("terminated") or (
            (container.get("lastState") or {}).get("terminated") if container.get("restartCount") else None
        )
        if terminated:
            restarts = int(container.get("restartCount") or 0)
            return (
                f"container {container.get('name')} exited with code {terminated.get('exitCode')}"
                f" ({terminated.get('reason') or 'Error'})"
                + (f", restarted {restarts} time(s)" if restarts else "")
            )
    return None


def _group_sets(rendered: Rendered) -> dict[str, tuple[str, int]]:
    """Component -> (LeaderWorkerSet name, pods per group) of the rendered multi-node pools."""
    return {
        child["metadata"]["labels"][vocabulary.COMPONENT_LABEL]: (
            child["metadata"]["name"],
            int(child["spec"]["leaderWorkerTemplate"]["size"]),
        )
        for child in rendered.children
        if child["kind"] == vocabulary.LWS_KIND
    }


def group_statuses(pods: list[dict[str, Any]], set_name: str, size: int) -> list[GroupStatus]:
    """Each group of a LeaderWorkerSet from its pods: ready members, and the first member that failed."""
    groups: dict[int, dict[int, dict[str, Any]]] = {}
    for pod in pods:
        labels = pod["metadata"].get("labels") or {}
        if labels.get(LWS_NAME_LABEL) != set_name:
            continue
        try:
            index, worker = int(labels[LWS_GROUP_INDEX_LABEL]), int(labels[LWS_WORKER_INDEX_LABEL])
        except (KeyError, ValueError):
            continue
        groups.setdefault(index, {})[worker] = pod
    out = []
    for index in sorted(groups):
        members = groups[index]
        failed, reason = None, None
        for worker in range(size):
            pod = members.get(worker)
            problem = _member_problem(pod) if pod is not None else None
            if problem is not None:
                failed, reason = pod["metadata"]["name"], problem  # type: ignore[index]
                break
        out.append(
            GroupStatus(
                index=index,
                leader=f"{set_name}-{index}",
                ready_members=sum(1 for pod in members.values() if pod_is_ready(pod)),
                size=size,
                failed_member=failed,
                reason=reason,
            )
        )
    return out


def _problem_message(problems: list[PodProblem]) -> str:
    """The first problem's message, naming the others briefly (stable while the set is)."""
    message = problems[0].message
    rest = problems[1:]
    if rest:
        named = ", ".join(f"{p.reason} on {p.pod}" for p in rest[:MORE_PROBLEMS_NAMED])
        more = f" and {len(rest) - MORE_PROBLEMS_NAMED} more" if len(rest) > MORE_PROBLEMS_NAMED else ""
        message += f" (also {named}{more})"
    return message


def _starting(pods: list[dict[str, Any]], lives: Mapping[str, LifeMemory]) -> str:
    """`; starting: POD PHASE, ...` for worker pods whose runtime runs but has not started."""
    parts = []
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        if pod_component(pod) not in WORKER_COMPONENTS or pod["metadata"].get("deletionTimestamp"):
            continue
        for status in container_statuses(pod):
            life = current_life(pod, status)
            if life is None or status.get("started") is True:
                continue
            report = (lives.get(life) or LifeMemory()).last_report
            parts.append(f"{pod['metadata']['name']} {report.phase if report else 'starting'}")
            break
    if not parts:
        return ""
    more = f" and {len(parts) - STARTING_PODS_NAMED} more" if len(parts) > STARTING_PODS_NAMED else ""
    return f"; starting: {', '.join(parts[:STARTING_PODS_NAMED])}{more}"


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
        pool_pods = [p for p in observed.pods if pod_component(p) == component]
        # A multi-node group's start is its leader's (Ready only once every rank is).
        members = [p for p in pool_pods if pod_serves(p)]
        pool = _pool_status(desired, observed.pool_set(component), members)
        group_set = _group_sets(rendered).get(component)
        if group_set is not None:
            name, size = group_set
            groups = group_statuses(pool_pods, name, size)
            pool = pool.model_copy(update={"nodes_per_replica": size, "groups": groups})
        old = getattr(before.pools, component, None) if before.pools else None
        # The autoscaler owns its sub-object; carry it over untouched.
        pools[component] = pool.model_copy(update={"autoscaler": old.autoscaler if old else None})

    router_status = (observed.router or {}).get("status") or {}
    router_ready = int(router_status.get("readyReplicas") or 0)
    router_desired = int(((observed.router or {}).get("spec") or {}).get("replicas") or 0)

    summary = ", ".join(f"{c} {p.ready_replicas}/{p.desired_replicas}" for c, p in pools.items())
    summary += f", router {router_ready}/{router_desired} ready"
    all_ready = all(p.ready_replicas >= p.desired_replicas for p in pools.values()) and router_ready >= 1
    rolling = [c for c, p in pools.items() if _is_rolling(observed.pool_set(c), p.desired_replicas)]

    budget = BudgetFacts(rendered.budget.seconds, rendered.budget.overridden, rendered.budget.source)
    hard = pod_problems(observed.pods, observed.lives, budget)
    at = parse_rfc3339(now)
    soft = readiness_failing(observed.pods, at) if at is not None else []
    # Written by the KV-health monitor; counts only while the deployment is disaggregated.
    kv_failing = next((c for c in conditions if c.type == KV_TRANSFER_HEALTHY and c.status == "False"), None)
    if rendered.plan.mode != "disaggregated":
        kv_failing = None
    # Written by the output-health monitor from the pods' self-tests.
    output_failing = next((c for c in conditions if c.type == OUTPUT_HEALTHY and c.status == "False"), None)
    model_failing = model is not None and model.phase in ("Retrying", "Failed")
    # A cache claim its StorageClass refuses waits for a person as a failed download does.
    model_stuck = model is not None and model.reason == CLAIM_PENDING
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
    elif model is not None and model_stuck:
        degraded = cond(
            DEGRADED,
            "True",
            CLAIM_PENDING,
            f"downloading {model.repo}@{model.revision} waits: {model.message}",
        )
    elif hard:
        degraded = cond(DEGRADED, "True", hard[0].reason, _problem_message(hard))
    elif output_failing is not None:
        # Pods are out of the Service because their output is wrong; the message names them.
        degraded = cond(
            DEGRADED, "True", OUTPUT_UNHEALTHY, f"{output_failing.reason}: {output_failing.message}"
        )
    elif kv_failing is not None:
        # Serving, but not the way the spec asked (REFERENCE: RDMA trouble must not hide behind
        # Ready): Ready stays True, Degraded says what the KV transfer is doing.
        degraded = cond(DEGRADED, "True", KV_UNHEALTHY, f"{kv_failing.reason}: {kv_failing.message}")
    elif soft:
        degraded = cond(DEGRADED, "True", soft[0].reason, _problem_message(soft))
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
    starting = _starting(observed.pods, observed.lives)
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
            f" (startupProbe budget){starting}",
        )
    elif not all_ready:
        progressing = cond(PROGRESSING, "True", "Starting", f"waiting for replicas: {summary}{starting}")
    else:
        progressing = cond(PROGRESSING, "False", "Stable", "all pools match the spec")

    profiles = record(
        before.startup_observations.profiles if before.startup_observations else [],
        observe_starts(observed.pods, observed.node_labels, observed.lives),
    )
    learned = learn(profiles, rendered.spec_key, rendered.formula)
    observations = (
        StartupObservations(learned_seconds=learned.seconds, samples=learned.samples, profiles=profiles)
        if profiles
        else None
    )

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
        startup_observations=observations,
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
    for key in _REPLACED_WHOLE:
        if isinstance(want.get(key), dict) and isinstance(current.get(key), dict):
            # One writer owns these objects whole: fields it no longer sets (a cleared failure, a
            # learned budget's numbers after a fallback) go.
            patch[key] = _replacing(current[key], want[key])
    return patch


_REPLACED_WHOLE = ("model", "startupBudget", "startupObservations")


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
