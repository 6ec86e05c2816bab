"""The `status` of an LLMDeployment: everything the operator and the autoscaler decide.

The operator never writes `spec` (GitOps tools own it); decided replica counts live here, in
`pools.<pool>.autoscaler.desiredReplicas`, and rendering reads them back as overrides.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sovereign_operator.api.base import ApiModel

ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(ApiModel):
    """One aspect of the deployment's state, as Kubernetes conditions go."""

    type: str = Field(
        min_length=1,
        description="Ready, Progressing, Degraded, ModelDownloaded (the operator), MetricsAvailable (the"
        " autoscaler), KVTransferHealthy (the KV-health monitor), OutputHealthy and SpeculativeDecoding"
        " (the output monitor).",
    )
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(min_length=1, description="Why, in one CamelCase word.")
    message: str = Field("", description="Why, for a person: what is wrong and what to do.")
    last_transition_time: str = Field(description="RFC 3339 time the status last changed.")
    observed_generation: int | None = Field(None, description="The spec generation this condition is about.")


class ScalingEvent(ApiModel):
    """One replica change the autoscaler made."""

    time: str = Field(description="RFC 3339 time of the change.")
    from_: int = Field(alias="from", description="Replicas before.")
    to: int = Field(description="Replicas after.")
    signal: str = Field(description="The signal that drove the change.")
    value: float | None = Field(None, description="The signal's value at the change.")


class AutoscalerStatus(ApiModel):
    """The autoscaler's latest decision for one pool (written by the autoscaler)."""

    desired_replicas: int | None = Field(
        None, ge=0, description="The replicas decided; rendering applies them within the pool's bounds."
    )
    signal: str | None = Field(
        None,
        description="The driving signal (kv_cache_usage, ttft, itl, ...), none when holding without one.",
    )
    value: float | None = Field(None, description="The driving signal's value.")
    target: float | None = Field(None, description="The driving signal's target.")
    reason: str | None = Field(None, description="The decision in one line: what, why, what limited it.")
    last_decision_time: str | None = Field(
        None, description="RFC 3339 time of the decision (rewritten on change and at least every 5 minutes)."
    )
    history: list[ScalingEvent] = Field(
        default_factory=list, max_length=10, description="The last ten replica changes, newest last."
    )


class SpeculationStatus(ApiModel):
    """MTP speculative decoding as the pool's pods report it (written by the output monitor)."""

    num_draft_tokens: int = Field(description="Draft tokens per step the pool asks for.")
    pods_in_force: int = Field(description="Pods decoding with speculation.")
    pods_reporting: int = Field(
        description="Pods that reported (running pods whose /health/startup answered)."
    )
    acceptance_rate: float | None = Field(
        None, description="Accepted / proposed draft tokens over the pods' lifetimes (0-1)."
    )
    mean_accept_length: float | None = Field(
        None, description="Tokens gained per verify step, the verified token included (1: no draft kept)."
    )
    reason: str | None = Field(None, description="Why pods serve without it (e.g. no MTP tensors).")


class GroupStatus(ApiModel):
    """One replica of a multi-node pool: its pods (the leader and its workers) as observed."""

    index: int = Field(description="The group's index (LeaderWorkerSet group-index).")
    leader: str = Field(description="The leader pod, which serves the replica's API.")
    ready_members: int = Field(description="Pods of the group that are Ready.")
    size: int = Field(description="Pods the group must have (nodesPerReplica).")
    failed_member: str | None = Field(
        None,
        description="The first member that is not Ready or has restarted (the group restarts as one), if any.",
    )
    reason: str | None = Field(None, description="What is wrong with failedMember, for a person.")


class PoolStatus(ApiModel):
    """One pool's StatefulSet (or, for a multi-node pool, LeaderWorkerSet) as observed."""

    desired_replicas: int = Field(0, description="The replicas the pool should have (spec or autoscaler).")
    replicas: int = Field(0, description="Replicas the pool has (pods; groups for a multi-node pool).")
    ready_replicas: int = Field(
        0, description="Replicas that are Ready (a group: its leader, so every rank)."
    )
    updated_replicas: int = Field(0, description="Replicas at the pool's current revision.")
    nodes_per_replica: int | None = Field(None, description="Pods per replica, when above 1.")
    groups: list[GroupStatus] | None = Field(
        None,
        max_length=1024,
        description="Multi-node pools: each group's members, and which one failed.",
    )
    observed_startup_seconds: int | None = Field(
        None,
        description="The longest start among the pool's Ready pods: container start to Ready, in"
        " seconds; compare with startupBudget.seconds (docs/startup.md).",
    )
    autoscaler: AutoscalerStatus | None = Field(
        None, description="The autoscaler's latest decision, when the pool is autoscaled."
    )
    speculative: SpeculationStatus | None = Field(
        None, description="Speculative decoding in force, when the pool asks for it."
    )


class PoolsStatus(ApiModel):
    """The pools of the resolved mode."""

    prefill: PoolStatus | None = Field(None, description="The prefill pool (disaggregated mode).")
    decode: PoolStatus | None = Field(None, description="The decode pool (disaggregated mode).")
    unified: PoolStatus | None = Field(
        None, description="The one pool of unified mode (configured by decode)."
    )


BudgetSource = Literal["formula", "observed", "override"]


class StartupBudget(ApiModel):
    """The startup probe's budget in force and how it was decided (see docs/startup.md).

    Decided when the pools' pods roll anyway (a change of their template other than the probe) and
    after an overrun of a learned budget; new observations alone never change it (they would roll every
    pod): `startupObservations.learnedSeconds` is what the next rollout applies."""

    seconds: int = Field(description="The budget: the startup probe fails a pod after this long.")
    base_seconds: int = Field(description="Fixed part: process start, CUDA/NCCL initialisation.")
    weight_load_seconds: int = Field(description="Weight bytes over startup.readBandwidthMiBps.")
    jit_seconds: int = Field(description="Kernel compilation allowance (cold, or warm with a jitCache pvc).")
    group_seconds: int = Field(
        0,
        description="Multi-node pools: the workers' pods start after the leader's and the leader waits for"
        " the slowest rank to join and load (0 with one node per replica).",
    )
    overridden: bool = Field(False, description="True when startup.budgetSeconds set the budget.")
    source: BudgetSource = Field(
        "formula",
        description="formula (base + weight load + JIT; no start observed yet, or the fallback after"
        " overruns), observed (learned from starts) or override (startup.budgetSeconds).",
    )
    reason: str | None = Field(None, description="The decision in one line, with its numbers.")
    formula_seconds: int | None = Field(
        None, description="What the formula gives (base + weight load + JIT)."
    )
    cold_seconds: int | None = Field(
        None,
        description="The formula with the cold JIT allowance: the most a learned budget may be, and the"
        " fallback after consecutive overruns.",
    )
    samples: int | None = Field(None, ge=0, description="Observed starts behind a learned budget.")
    p95_seconds: int | None = Field(
        None, description="95th percentile of those starts, on the slowest node type (nodeType)."
    )
    node_type: str | None = Field(
        None, description="The node type (GPU product, or cpu) whose starts set a learned budget."
    )
    overruns: int | None = Field(
        None, ge=0, description="Consecutive overruns of the learned budget this decision answered."
    )
    overrun_at: str | None = Field(
        None,
        description="RFC 3339 end of the newest overrun this decision answered (a newer one re-decides).",
    )
    pod_template_hash: str | None = Field(
        None,
        description="Digest of the worker pod templates, probe aside, it was decided for: when they change"
        " (a rollout) the budget is decided again.",
    )


class StartupSample(ApiModel):
    """One observed start: a container life from its start to the pod's Ready."""

    pod: str = Field(description="The pod.")
    started_at: str = Field(description="RFC 3339 start of the container (with the pod, which start).")
    seconds: int = Field(ge=0, description="Container start to Ready, in seconds.")


class StartupOverrun(ApiModel):
    """A start the kubelet cut short by the startup probe while a learned budget was in force."""

    pod: str = Field(description="The pod.")
    started_at: str = Field(description="RFC 3339 start of the container life that was cut short.")
    finished_at: str = Field(description="RFC 3339 end of that life.")
    window_seconds: int = Field(ge=0, description="The probe's window it overran, in seconds.")


class StartupProfile(ApiModel):
    """Observed starts of one model revision and precision on one runtime image and node type."""

    revision: str = Field(
        description="The weights: repo@commit for huggingFace, else the source (builtin:, pvc:, hostPath:, image:)."
    )
    precision: str = Field(description="spec.model.precision of those pods.")
    runtime_image: str = Field(description="The runtime image (its kernels are what is compiled at start).")
    node_type: str = Field(description="The GPU product label of the nodes (nvidia.com/gpu.product), or cpu.")
    samples: list[StartupSample] = Field(
        default_factory=list, max_length=10, description="The latest successful starts, oldest first."
    )
    overruns: list[StartupOverrun] = Field(
        default_factory=list,
        max_length=4,
        description="The latest overruns of a learned budget, oldest first.",
    )
    p95_seconds: int | None = Field(None, description="95th percentile of the samples (nearest rank).")
    consecutive_overruns: int = Field(0, ge=0, description="Overruns since the newest successful start.")


class StartupObservations(ApiModel):
    """What observed starts say now: the history (bounded) and the budget the next rollout applies."""

    learned_seconds: int | None = Field(
        None,
        description="The budget the observations give for the current spec: max(p95 × 1.5, base + weight"
        " load) over its node types, at most the cold formula; none before a start was observed.",
    )
    samples: int = Field(0, ge=0, description="Observed starts of the current spec's profiles.")
    profiles: list[StartupProfile] = Field(
        default_factory=list, max_length=8, description="Per profile, the most recently active first."
    )


DownloadPhase = Literal["Resolving", "Downloading", "Complete", "Retrying", "Failed"]


class ServedModel(ApiModel):
    """The downloaded cache the pools read (the last complete download)."""

    commit: str = Field(description="The commit the pools run.")
    cache: str = Field(description="The PersistentVolumeClaim holding it (mounted read-only).")
    bytes_total: int = Field(ge=0, description="Bytes of the checkpoint (they size the startup budget).")


class ModelStatus(ApiModel):
    """The huggingFace source's download, as the operator observes its Jobs (see docs/models.md)."""

    repo: str = Field(description="The repo id from spec.")
    revision: str = Field(description="The revision from spec.")
    source_hash: str = Field(
        description="Digest of the source fields the commit was resolved from; a change resolves again."
    )
    commit: str | None = Field(None, description="The commit the revision resolved to (downloads go by it).")
    cache: str | None = Field(None, description="The cache PersistentVolumeClaim of that commit.")
    phase: DownloadPhase = Field(
        description="Resolving, Downloading, Complete, Retrying (failed; retried with backoff) or Failed"
        " (the Job gave up: delete it to start again)."
    )
    bytes_total: int | None = Field(None, ge=0, description="Bytes of the selected files.")
    bytes_done: int | None = Field(None, ge=0, description="Bytes on the cache volume so far.")
    files: int | None = Field(None, ge=0, description="Files selected.")
    files_done: int | None = Field(None, ge=0, description="Files downloaded and in place.")
    rate_bytes_per_second: int | None = Field(None, ge=0, description="Download rate over the last minute.")
    eta_seconds: int | None = Field(None, ge=0, description="Time left at that rate.")
    attempts: int | None = Field(None, ge=0, description="Starts of the current Job's container so far.")
    reason: str | None = Field(
        None, description="Why the last attempt failed (Unauthorized, RevisionNotFound, ...)."
    )
    message: str | None = Field(None, description="The failure in full, with the hub's own message.")
    progress: str = Field(description="One line for `kubectl get llmd` (the Download column).")
    serving: ServedModel | None = Field(
        None,
        description="What the pools read; during an update the previous download until the new one completes.",
    )


class LLMDeploymentStatus(ApiModel):
    """What the operator and the autoscaler observe and decide; never written by users."""

    observed_generation: int | None = Field(None, description="The spec generation last reconciled.")
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=16,
        description="Ready, Progressing, Degraded and the monitors' conditions.",
    )
    mode: Literal["unified", "disaggregated"] | None = Field(None, description="The resolved mode.")
    mode_reason: str | None = Field(None, description="Why this mode (and KV transport) was chosen.")
    kv_transport: Literal["rdma", "tcp"] | None = Field(
        None, description="How prefill hands the KV cache to decode (disaggregated mode)."
    )
    endpoint: str | None = Field(None, description="The OpenAI base URL of the router Service.")
    startup_budget_seconds: int | None = Field(None, description="The startup probe's budget in seconds.")
    startup_budget: StartupBudget | None = Field(None, description="How the startup budget was decided.")
    startup_observations: StartupObservations | None = Field(
        None, description="Observed starts (bounded history) and the budget they give (docs/startup.md)."
    )
    pools: PoolsStatus | None = Field(None, description="Each pool's replicas and autoscaler decision.")
    model: ModelStatus | None = Field(None, description="The huggingFace source's download and cache.")
    # "ready/desired" summaries for the printer columns; in unified mode decode shows the pool.
    prefill_replicas: str | None = Field(None, description="Prefill pods ready/desired (printer column).")
    decode_replicas: str | None = Field(
        None, description="Decode pods ready/desired, the unified pool in unified mode (printer column)."
    )
