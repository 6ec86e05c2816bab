"""Decisions rendering depends on: the resolved mode, the KV transport, pool sizes, startup budget.

All pure: the inputs are the spec, facts observed in the cluster, and replica counts the
autoscaler decided (read back from status, never from spec).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from sovereign_operator.api.spec import (
    DEFAULT_RDMA_RESOURCE,
    DEFAULT_RUNTIME_IMAGE,
    LLMDeploymentSpec,
    PoolSpec,
)
from sovereign_operator.api.status import StartupBudget
from sovereign_operator.render.modelcache import DEFAULT_HF_ENDPOINT, Serving
from sovereign_operator.vocabulary import (
    BUDGET_SOURCE_ANNOTATION,
    MODEL_PRECISION_ANNOTATION,
    MODEL_REVISION_ANNOTATION,
)

ResolvedMode = Literal["unified", "disaggregated"]
Component = Literal["prefill", "decode", "unified"]

PROBE_PERIOD_SECONDS = 10
BASE_STARTUP_SECONDS = 60
BYTES_PER_PARAMETER = {"fp8": 1, "bf16": 2, "fp32": 4}
# Kernel compilation allowance, (cold cache, persistent cache). DeepGEMM's FP8 GEMMs take 10-30
# minutes cold and under 3 minutes warm; bf16/fp32 only compile Triton kernels. See docs/startup.md.
JIT_SECONDS = {
    "fp8": (900, 240),
    "bf16": (300, 120),
    "fp32": (300, 120),
    "cpu": (60, 60),
}

TCP_SLOWER = (
    "KV-cache transfer over plain TCP makes disaggregation slower than a unified pool"
    " (measured ~98 s TTFT versus 0.2-0.5 s with RDMA)"
)


@dataclass(frozen=True)
class ClusterFacts:
    """What rendering needs to know about the cluster: extended resources nodes advertise."""

    advertised_resources: frozenset[str] = field(default_factory=frozenset)

    def advertises(self, resource_name: str) -> bool:
        return resource_name in self.advertised_resources


# The namespace docs/install.md installs the chart into.
DEFAULT_OPERATOR_NAMESPACE = "sovereign-system"


@dataclass(frozen=True)
class OperatorDefaults:
    """Values a spec may leave to the operator's installation (the Helm chart sets them)."""

    runtime_image: str = DEFAULT_RUNTIME_IMAGE
    rdma_resource: str = DEFAULT_RDMA_RESOURCE
    # The hub a huggingFace source without `endpoint` downloads from (a mirror, for air-gapped sites).
    hf_endpoint: str = DEFAULT_HF_ENDPOINT
    # Where the operator's pods run (the chart passes its release namespace): workers' NetworkPolicies
    # admit its metrics and KV-health scrapes from there.
    operator_namespace: str = DEFAULT_OPERATOR_NAMESPACE

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> OperatorDefaults:
        return cls(
            runtime_image=environ.get("SOVEREIGN_RUNTIME_IMAGE") or DEFAULT_RUNTIME_IMAGE,
            rdma_resource=environ.get("SOVEREIGN_RDMA_RESOURCE") or DEFAULT_RDMA_RESOURCE,
            hf_endpoint=environ.get("SOVEREIGN_HF_ENDPOINT") or DEFAULT_HF_ENDPOINT,
            operator_namespace=environ.get("SOVEREIGN_OPERATOR_NAMESPACE") or DEFAULT_OPERATOR_NAMESPACE,
        )


def with_operator_defaults(spec: LLMDeploymentSpec, defaults: OperatorDefaults) -> LLMDeploymentSpec:
    """The spec with the fields it left unset filled from the operator's defaults."""
    runtime, rdma = spec.runtime, spec.networking.rdma
    if "image" not in runtime.model_fields_set:
        runtime = runtime.model_copy(update={"image": defaults.runtime_image})
    if "resource_name" not in rdma.model_fields_set:
        rdma = rdma.model_copy(update={"resource_name": defaults.rdma_resource})
    networking = spec.networking.model_copy(update={"rdma": rdma})
    return spec.model_copy(update={"runtime": runtime, "networking": networking})


@dataclass(frozen=True)
class ModePlan:
    mode: ResolvedMode
    reason: str
    # How prefill hands the KV cache to decode; None in unified mode (no transfer).
    kv_transport: Literal["rdma", "tcp"] | None


def resolve_mode(spec: LLMDeploymentSpec, facts: ClusterFacts) -> ModePlan:
    rdma = spec.networking.rdma
    available = facts.advertises(rdma.resource_name)
    wants_rdma = rdma.enabled == "true" or (rdma.enabled == "auto" and available)
    if spec.mode == "unified":
        return ModePlan("unified", "mode unified is set in spec", None)
    if spec.mode == "disaggregated":
        if wants_rdma:
            reason = "mode disaggregated is set in spec; KV transfer uses RDMA"
            if not available:
                reason += f" but no node advertises {rdma.resource_name}, so pods cannot be scheduled"
            return ModePlan("disaggregated", reason, "rdma")
        why = "disabled" if rdma.enabled == "false" else f"not advertised by any node ({rdma.resource_name})"
        return ModePlan(
            "disaggregated",
            f"mode disaggregated is set in spec; RDMA is {why}, so KV transfer uses TCP: {TCP_SLOWER}",
            "tcp",
        )
    # mode auto
    if rdma.enabled == "false":
        return ModePlan("unified", f"auto: networking.rdma.enabled is false and {TCP_SLOWER}", None)
    if available:
        return ModePlan(
            "disaggregated", f"auto: nodes advertise {rdma.resource_name}, so KV transfer uses RDMA", "rdma"
        )
    return ModePlan("unified", f"auto: no node advertises {rdma.resource_name} and {TCP_SLOWER}", None)


def sticky_plan(status: Mapping[str, Any] | None, generation: int) -> ModePlan | None:
    """The mode already resolved for this spec generation, if status records one.

    `auto` (and `rdma.enabled: auto`) are resolved when the spec changes, not whenever nodes
    change: switching modes replaces every pool, and a device plugin that restarts for a minute
    must not tear down pods that took half an hour to start.
    """
    status = status or {}
    mode = status.get("mode")
    if status.get("observedGeneration") != generation or mode not in ("unified", "disaggregated"):
        return None
    transport = status.get("kvTransport")
    if mode == "disaggregated" and transport not in ("rdma", "tcp"):
        return None
    return ModePlan(mode, str(status.get("modeReason") or ""), transport if mode == "disaggregated" else None)


def pool_spec_for(spec: LLMDeploymentSpec, component: Component) -> PoolSpec:
    """The spec that configures a pool (defaults where the spec leaves it out)."""
    return spec.pool_for(component) or PoolSpec()


def components_for(mode: ResolvedMode) -> tuple[Component, ...]:
    return ("prefill", "decode") if mode == "disaggregated" else ("unified",)


def desired_replicas(pool: PoolSpec, override: int | None) -> int:
    """Fixed replicas win; an autoscaled pool takes the autoscaler's decision within its bounds."""
    if pool.replicas is not None:
        return pool.replicas
    if pool.autoscaling is None:
        return 1
    bounds = pool.autoscaling
    chosen = bounds.min_replicas if override is None else override
    return max(bounds.min_replicas, min(bounds.max_replicas, chosen))


def plan_replicas(
    spec: LLMDeploymentSpec, mode: ResolvedMode, overrides: Mapping[str, int]
) -> dict[Component, int]:
    return {c: desired_replicas(pool_spec_for(spec, c), overrides.get(c)) for c in components_for(mode)}


def weight_bytes(spec: LLMDeploymentSpec, measured: int | None = None) -> int:
    """Bytes a pod reads at start: `measured` (a downloaded checkpoint's files) when known, else the
    spec's size (0 for builtin, and for a huggingFace source not yet resolved and not sized)."""
    model = spec.model
    if model.source.builtin is not None:
        return 0
    if measured is not None:
        return measured
    if model.weights_gib is not None:
        return int(model.weights_gib * 2**30)
    if model.parameters_billions is None:
        return 0  # huggingFace, before the resolve Job has measured it (ModelSpec's rule allows it)
    return int(model.parameters_billions * 1e9 * BYTES_PER_PARAMETER[model.precision])


def has_persistent_jit_cache(spec: LLMDeploymentSpec) -> bool:
    cache = spec.startup.jit_cache
    return cache is not None and cache.pvc is not None


def whole_periods(seconds: int) -> int:
    """Seconds rounded up to whole startup-probe periods."""
    return math.ceil(seconds / PROBE_PERIOD_SECONDS) * PROBE_PERIOD_SECONDS


def startup_budget(spec: LLMDeploymentSpec, measured_bytes: int | None = None) -> StartupBudget:
    """base + weight bytes / read bandwidth + JIT allowance, rounded up to whole probe periods (or
    spec.startup.budgetSeconds). Learned budgets start from this (startupbudget.py)."""
    load = math.ceil(weight_bytes(spec, measured_bytes) / (spec.startup.read_bandwidth_mibps * 2**20))
    kind = spec.model.precision if spec.uses_gpu() else "cpu"
    cold, warm = JIT_SECONDS[kind]
    jit = warm if has_persistent_jit_cache(spec) else cold
    computed = whole_periods(BASE_STARTUP_SECONDS + load + jit)
    override = spec.startup.budget_seconds
    parts = f"base {BASE_STARTUP_SECONDS} s + weight load {load} s + JIT {jit} s"
    if override is not None:
        reason = f"spec.startup.budgetSeconds ({override} s) replaces the formula ({parts} = {computed} s)"
    else:
        reason = f"the formula: {parts} = {computed} s"
    return StartupBudget(
        seconds=whole_periods(override) if override is not None else computed,
        base_seconds=BASE_STARTUP_SECONDS,
        weight_load_seconds=load,
        jit_seconds=jit,
        overridden=override is not None,
        source="override" if override is not None else "formula",
        reason=reason,
        formula_seconds=computed,
        cold_seconds=whole_periods(BASE_STARTUP_SECONDS + load + cold),
    )


# Multi-node pools: LeaderWorkerSet creates the workers' pods once the leader's exists, they are scheduled
# and pull images on their own nodes, and the leader waits for the slowest rank (docs/startup.md).
GROUP_START_SECONDS = 120


def group_budget(budget: StartupBudget, nodes_per_replica: int) -> StartupBudget:
    """The formula's budget when a pool's replicas span ``nodes_per_replica`` pods: the group term is part
    of the formula (and of its cold value, the most a learned budget may be), since a group's observed
    starts include the leader's wait for its slowest rank. One budget serves every pool of a deployment."""
    if nodes_per_replica <= 1 or budget.overridden:
        return budget
    seconds = budget.seconds + GROUP_START_SECONDS
    parts = (
        f"base {budget.base_seconds} s + weight load {budget.weight_load_seconds} s + JIT {budget.jit_seconds} s"
        f" + group start {GROUP_START_SECONDS} s"
    )
    return budget.model_copy(
        update={
            "seconds": seconds,
            "group_seconds": GROUP_START_SECONDS,
            "formula_seconds": seconds,
            "cold_seconds": (budget.cold_seconds or budget.seconds) + GROUP_START_SECONDS,
            "reason": f"the formula: {parts} = {seconds} s",
        }
    )


def uses_groups(spec: LLMDeploymentSpec) -> bool:
    """Whether a pool of the spec is multi-node (rendered as a LeaderWorkerSet)."""
    return any(pool is not None and pool.multi_node for pool in (spec.prefill, spec.decode))


def startup_failure_threshold(budget: StartupBudget) -> int:
    return budget.seconds // PROBE_PERIOD_SECONDS


# ---- what a start is a sample of (startupbudget.py learns budgets from samples) -------------------


@dataclass(frozen=True)
class SpecKey:
    """What a start is a sample of, besides the node: the same for every pod of one spec."""

    revision: str
    precision: str
    runtime_image: str

    def describe(self) -> str:
        return f"{self.revision} ({self.precision}) on {self.runtime_image}"


def model_revision(spec: LLMDeploymentSpec, serving: Serving | None) -> str:
    """The weights the pods read, as one string: repo@commit for huggingFace, else the source."""
    source = spec.model.source
    if source.hugging_face is not None:
        return f"{source.hugging_face.repo}@{serving.commit if serving else source.hugging_face.revision}"
    if source.builtin is not None:
        return f"builtin:{source.builtin}"
    if source.pvc is not None:
        return f"pvc:{source.pvc.claim_name}/{source.pvc.path.strip('/')}"
    if source.host_path is not None:
        return f"hostPath:{source.host_path.path}"
    assert source.image is not None
    return f"image:{source.image.reference}/{source.image.path.strip('/')}"


def spec_key(spec: LLMDeploymentSpec, serving: Serving | None) -> SpecKey:
    """The profile of the current spec's pods (spec with the operator's defaults applied)."""
    return SpecKey(model_revision(spec, serving), spec.model.precision, spec.runtime.image)


def pod_annotations(key: SpecKey, budget: StartupBudget) -> dict[str, str]:
    """What the worker pod template carries so that its starts can be attributed (and its overruns)."""
    annotations = {MODEL_REVISION_ANNOTATION: key.revision, MODEL_PRECISION_ANNOTATION: key.precision}
    if budget.source == "observed":
        annotations[BUDGET_SOURCE_ANNOTATION] = "observed"
    return annotations
