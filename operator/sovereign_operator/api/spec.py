"""The `spec` of an LLMDeployment: the one source of truth for the CRD schema and for rendering.

The common case fits one screen: a model and where its weights live, a runtime image with a
tensor-parallel size, and the pools. Everything else has a default an operator of DeepSeek-class
models would pick.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from pydantic import AfterValidator, Field, WithJsonSchema, field_validator

from sovereign_operator.api.base import ApiModel
from sovereign_operator.api.rules import CrossFieldRule

DEFAULT_RUNTIME_IMAGE = "ghcr.io/sovereign-ai/sovereign-runtime:0.1.0"
DEFAULT_RDMA_RESOURCE = "rdma/rdma_shared_device_a"
BUILTIN_MODELS = ("sovereign-tiny",)

Mode = Literal["unified", "disaggregated", "auto"]


def _operator_default(schema: dict[str, Any]) -> None:
    """Keep a field's default out of the CRD: the operator fills it from its own configuration
    (environment set by the Helm chart), so the apiserver must not store one."""
    schema.pop("default", None)


Precision = Literal["fp8", "bf16", "fp32"]

# Every integer the CRD stores is an int32 in the apiserver's eyes unless bounded lower.
INT32_MAX = 2**31 - 1
MAX_POOL_REPLICAS = 1024
# A chat template's characters: DeepSeek's are under 5000; 4 bytes each stays far inside a ConfigMap's 1 MiB.
MAX_CHAT_TEMPLATE_CHARS = 128 * 1024

# A non-negative Kubernetes quantity: "500m", "16Gi", "1.5", "1e3" or a plain integer (no sign).
QUANTITY_PATTERN = r"^([0-9]+([.][0-9]*)?|[.][0-9]+)(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?[0-9]+))?$"
QUANTITY_MESSAGE = (
    'must be a non-negative Kubernetes quantity: an integer or a string such as "500m" or "16Gi"'
)
# maxLength bounds the regex's cost in the apiserver's CEL budget.
MAX_QUANTITY_LENGTH = 64
QUANTITY_CEL = f"type(self) == int ? self >= 0 : string(self).matches('{QUANTITY_PATTERN}')"


def _check_quantity(value: int | str) -> int | str:
    if isinstance(value, int) and value >= 0:
        return value
    if isinstance(value, str) and len(value) <= MAX_QUANTITY_LENGTH and re.fullmatch(QUANTITY_PATTERN, value):
        return value
    raise ValueError(QUANTITY_MESSAGE)


Quantity = Annotated[
    int | str,
    AfterValidator(_check_quantity),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "maxLength": MAX_QUANTITY_LENGTH,
            "x-kubernetes-validations": [{"rule": QUANTITY_CEL, "message": QUANTITY_MESSAGE}],
        }
    ),
]
# Resource maps hold a handful of names (cpu, memory, nvidia.com/gpu, ...); bounded for CEL's cost budget.
MAX_RESOURCE_NAMES = 16

# Paths inside a volume or image: joined under the mount point, so they may never climb out of it.
RELATIVE_PATH_CEL = "!self.path.matches('(^|/)[.][.](/|$)')"
RELATIVE_PATH_MESSAGE = "path must stay inside the volume: no '..' segments"
MAX_PATH_LENGTH = 1024


def _stays_inside(path: str) -> bool:
    return re.search(r"(^|/)[.][.](/|$)", path) is None


RELATIVE_PATH_RULE = CrossFieldRule(
    cel=RELATIVE_PATH_CEL, message=RELATIVE_PATH_MESSAGE, holds=lambda s: _stays_inside(s.path)
)


class ResourceRequirements(ApiModel):
    """Container resources, as in a Pod: quantities by resource name."""

    requests: dict[str, Quantity] = Field(
        default_factory=dict,
        max_length=MAX_RESOURCE_NAMES,
        description='Quantities the scheduler reserves, e.g. cpu: "4", memory: 64Gi.',
    )
    limits: dict[str, Quantity] = Field(
        default_factory=dict,
        max_length=MAX_RESOURCE_NAMES,
        description="Quantities the container may not exceed, by resource name.",
    )


class Toleration(ApiModel):
    """A Pod toleration."""

    key: str | None = Field(None, description="The taint key tolerated; empty with Exists: every taint.")
    operator: Literal["Exists", "Equal"] | None = Field(
        None, description="Equal (the default) matches value; Exists matches any value."
    )
    value: str | None = Field(None, description="The taint value tolerated (with Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="The taint effect tolerated; empty: every effect."
    )
    toleration_seconds: int | None = Field(
        None,
        ge=0,
        le=INT32_MAX,
        description="With NoExecute: how long the pod stays bound after the taint appears.",
    )


class EnvVar(ApiModel):
    """A container environment variable; `valueFrom` takes any Kubernetes EnvVarSource."""

    name: str = Field(min_length=1, description="The variable's name.")
    value: str | None = Field(None, description="The variable's value.")
    value_from: dict[str, Any] | None = Field(
        None, description="A Kubernetes EnvVarSource (secretKeyRef, configMapKeyRef, fieldRef, ...)."
    )


# ---- model -------------------------------------------------------------------------------------


class PVCSource(ApiModel):
    """Weights on a PersistentVolumeClaim, mounted read-only."""

    claim_name: str = Field(
        min_length=1, description="The PersistentVolumeClaim in the deployment's namespace."
    )
    path: str = Field(
        "", max_length=MAX_PATH_LENGTH, description="Directory of the checkpoint inside the volume."
    )

    RULES = (RELATIVE_PATH_RULE,)


class HostPathSource(ApiModel):
    """Weights in a directory on the node."""

    path: str = Field(
        min_length=1, pattern=r"^/", description="Absolute directory of the checkpoint on the node."
    )


class ImageSource(ApiModel):
    """Weights in an OCI image, mounted as a Kubernetes image volume (Kubernetes 1.31+)."""

    reference: str = Field(min_length=1, description="The OCI image holding the checkpoint.")
    path: str = Field(
        "", max_length=MAX_PATH_LENGTH, description="Directory of the checkpoint inside the image."
    )
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="When the kubelet pulls the image volume."
    )

    RULES = (RELATIVE_PATH_RULE,)


# A hub repo id: `org/name` (or a legacy name without an org), as huggingface_hub validates it.
HF_REPO_PATTERN = r"^([A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*$"
MAX_PATTERNS = 64


class SecretKeyRef(ApiModel):
    """A key of a Secret in the deployment's namespace."""

    name: str = Field(min_length=1, max_length=253, description="The Secret's name.")
    key: str = Field("token", min_length=1, max_length=253, description="The key holding the value.")


class ModelCacheSpec(ApiModel):
    """The PersistentVolumeClaim a download fills. LLMDeployments naming the same repo, resolved
    commit, patterns and these settings share one cache (and one download)."""

    storage_class_name: str | None = Field(
        None,
        min_length=1,
        description="StorageClass of the cache claim; default: the cluster's default class.",
    )
    size: Quantity | None = Field(
        None, description="Capacity of the cache claim; default: the selected files' total + 5% + 1Gi."
    )
    access_mode: Literal["ReadWriteMany", "ReadWriteOnce"] = Field(
        "ReadWriteMany",
        description="ReadWriteMany lets pools on every node read it; ReadWriteOnce only suits one node.",
    )
    retention: Literal["Retain", "Delete"] = Field(
        "Retain",
        description="Retain: the cache outlives the LLMDeployments using it (delete it by hand); Delete:"
        " it goes with the last of them (Kubernetes garbage collection).",
    )


class HuggingFaceSource(ApiModel):
    """Weights downloaded from a Hugging Face hub (or a mirror) by a Job into a shared cache claim,
    which the pools mount read-only once the download is complete and verified."""

    repo: str = Field(
        min_length=1,
        max_length=200,
        pattern=HF_REPO_PATTERN,
        description="The repo id, e.g. deepseek-ai/DeepSeek-V3.",
    )
    revision: str = Field(
        "main",
        min_length=1,
        max_length=255,
        pattern=r"^[^\s]+$",
        description="Branch, tag or commit; resolved once to a commit (status.model.commit) that every pod runs.",
    )
    endpoint: str | None = Field(
        None,
        max_length=2048,
        pattern=r"^https?://[^\s]+$",
        description="The hub or a mirror; default: the operator's SOVEREIGN_HF_ENDPOINT, else https://huggingface.co.",
    )
    token_secret_ref: SecretKeyRef | None = Field(
        None,
        description="The access token (private and gated repos): a Secret key, passed to the Job as HF_TOKEN.",
    )
    allow_patterns: list[str] = Field(
        default_factory=list,
        max_length=MAX_PATTERNS,
        description="Download only paths matching one of these globs (huggingface_hub's allow_patterns).",
    )
    ignore_patterns: list[str] = Field(
        default_factory=list,
        max_length=MAX_PATTERNS,
        description="Skip paths matching one of these globs (huggingface_hub's ignore_patterns).",
    )
    cache: ModelCacheSpec = Field(
        default_factory=ModelCacheSpec, description="The cache claim the download fills and the pools read."
    )


def _count_sources(source: ModelSource) -> int:
    kinds = (source.pvc, source.host_path, source.image, source.builtin, source.hugging_face)
    return sum(x is not None for x in kinds)


class ModelSource(ApiModel):
    """Where the weights come from: exactly one of pvc, hostPath, image, builtin, huggingFace."""

    pvc: PVCSource | None = Field(None, description="Weights on a PersistentVolumeClaim, mounted read-only.")
    host_path: HostPathSource | None = Field(None, description="Weights in a directory on the node.")
    image: ImageSource | None = Field(
        None, description="Weights in an OCI image, mounted as an image volume (Kubernetes 1.31+)."
    )
    builtin: Literal["sovereign-tiny"] | None = Field(
        None, description="A model bundled with the runtime (demos and tests; runs on CPU)."
    )
    hugging_face: HuggingFaceSource | None = Field(
        None,
        description="Weights downloaded from a Hugging Face hub into a shared cache claim (see docs/models.md).",
    )

    RULES = (
        CrossFieldRule(
            cel="(has(self.pvc) ? 1 : 0) + (has(self.hostPath) ? 1 : 0) + (has(self.image) ? 1 : 0)"
            " + (has(self.builtin) ? 1 : 0) + (has(self.huggingFace) ? 1 : 0) == 1",
            message="set exactly one of pvc, hostPath, image, builtin or huggingFace",
            holds=lambda s: _count_sources(s) == 1,
        ),
    )


class ModelSpec(ApiModel):
    """The model to serve."""

    name: str = Field(min_length=1, description="The model name clients send (served model name).")
    source: ModelSource = Field(
        description="Where the weights come from: exactly one of pvc, hostPath, image, builtin, huggingFace."
    )
    precision: Precision = Field("bf16", description="Precision of the checkpoint's weights.")
    parameters_billions: float | None = Field(
        None,
        ge=0,
        le=100_000,
        description="Parameter count in billions; sizes memory and the startup budget.",
    )
    weights_gib: float | None = Field(
        None,
        ge=0,
        le=10_000_000,
        alias="weightsGiB",
        description="Size of the checkpoint in GiB; preferred over parametersBillions when set (a"
        " huggingFace source is measured from its file list instead).",
    )

    RULES = (
        CrossFieldRule(
            cel="has(self.source.builtin) || has(self.source.huggingFace) || has(self.parametersBillions)"
            " || has(self.weightsGiB)",
            message="set parametersBillions or weightsGiB so the operator can size the startup budget"
            " (builtin and huggingFace sources are measured)",
            holds=lambda m: (
                m.source.builtin is not None
                or m.source.hugging_face is not None
                or m.parameters_billions is not None
                or m.weights_gib is not None
            ),
        ),
    )


# ---- runtime and pools -------------------------------------------------------------------------


def chat_template_syntax_error(template: str) -> str | None:
    """Why Jinja cannot parse ``template`` (the runtime's dialect: its sandbox with loop controls), or None."""
    environment = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    try:
        environment.parse(template)
    except jinja2.TemplateSyntaxError as error:
        return f"the Jinja template does not parse: line {error.lineno}: {error.message}"
    return None


class RuntimeSpec(ApiModel):
    """The inference runtime every worker pod runs."""

    image: str = Field(
        DEFAULT_RUNTIME_IMAGE,
        min_length=1,
        description="Default: the operator's SOVEREIGN_RUNTIME_IMAGE (the Helm chart sets it).",
        json_schema_extra=_operator_default,
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="When the kubelet pulls the runtime image."
    )
    tensor_parallel_size: int = Field(
        1, ge=1, le=64, description="GPUs per worker pod; the model is sharded over them (1 for builtin)."
    )
    device: Literal["gpu", "cpu"] | None = Field(
        None, description="gpu requests nvidia.com/gpu = tensorParallelSize; default gpu, cpu for builtin."
    )
    args: list[str] = Field(default_factory=list, max_length=128, description="Extra `serve` arguments.")
    chat_template: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_CHAT_TEMPLATE_CHARS,
        description="A Jinja chat template the workers use in place of the model's own (`serve"
        " --chat-template`), for example one that writes `tools` into the prompt: DeepSeek-V3's own"
        " template does not. Kept in a ConfigMap; the pools roll when it changes.",
    )

    @field_validator("chat_template")
    @classmethod
    def _template_parses(cls, template: str | None) -> str | None:
        # The apiserver cannot parse Jinja: a template the workers would refuse at start (`serve` exits
        # naming the line) is refused here first, before any pod crash-loops on it.
        if template is not None:
            problem = chat_template_syntax_error(template)
            if problem is not None:
                raise ValueError(problem)
        return template

    env: list[EnvVar] = Field(
        default_factory=list, max_length=128, description="Extra environment variables of every worker pod."
    )
    resources: ResourceRequirements | None = Field(None, description="Defaults for every worker pod.")
    drain_timeout_seconds: int = Field(
        120, ge=0, le=3600, description="How long a stopping pod waits for in-flight requests."
    )


class PoolAutoscaling(ApiModel):
    """Bounds and targets for the pool's autoscaler; it decides replicas and records them in status."""

    min_replicas: int = Field(
        1, ge=0, le=MAX_POOL_REPLICAS, description="The fewest replicas; the pool starts here."
    )
    max_replicas: int = Field(
        ge=1, le=MAX_POOL_REPLICAS, description="The most replicas the autoscaler may ask for."
    )
    ttft_target_ms: int | None = Field(
        None, ge=1, le=INT32_MAX, description="Time-to-first-token target (p90)."
    )
    itl_target_ms: int | None = Field(
        None, ge=1, le=INT32_MAX, description="Inter-token-latency target (p90)."
    )
    kv_cache_usage_target: float | None = Field(
        None,
        ge=0.05,
        le=1,
        description="Mean KV-cache usage per replica (0.05-1); decode and unified pools with neither"
        " this nor itlTargetMs get 0.75.",
    )
    waiting_requests_target: int | None = Field(
        None, ge=1, le=INT32_MAX, description="Queued requests per replica."
    )

    RULES = (
        CrossFieldRule(
            cel="self.minReplicas <= self.maxReplicas",
            message="minReplicas must be less than or equal to maxReplicas",
            holds=lambda a: a.min_replicas <= a.max_replicas,
        ),
    )


class SpeculativeSpec(ApiModel):
    """Speculative decoding: the checkpoint's own multi-token-prediction (MTP) layer drafts tokens and
    the model verifies them in one forward, so outputs are the model's own. A checkpoint without MTP
    tensors serves without it; the SpeculativeDecoding condition then says why."""

    algorithm: Literal["mtp"] = Field("mtp", description="mtp: DeepSeek-V3's NextN draft layer.")
    num_draft_tokens: int = Field(
        1, ge=1, le=4, description="Draft tokens per decode step (1-4); 1 is DeepSeek-V3's own choice."
    )
    max_batch_size: int | None = Field(
        None,
        ge=0,
        le=4096,
        description="Draft only while at most this many sequences run in a pod (above it decode is"
        " compute-bound and drafting costs more than it returns); 0: always; default: the runtime's.",
    )


# Runtime flags the operator renders for a multi-node pool (a user's own would contradict them).
GROUP_FLAGS = (
    "--nnodes",
    "--node-rank",
    "--leader-address",
    "--pipeline-parallel-size",
    "--rendezvous-timeout",
)
MAX_NODES_PER_REPLICA = 64


def _sets_group_flag(args: list[str]) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args for flag in GROUP_FLAGS)


class PoolSpec(ApiModel):
    """A pool of runtime workers: either fixed `replicas` or `autoscaling` bounds, not both."""

    replicas: int | None = Field(
        None, ge=0, le=MAX_POOL_REPLICAS, description="Fixed size; 1 when neither is set."
    )
    autoscaling: PoolAutoscaling | None = Field(
        None, description="Bounds and targets; the autoscaler decides replicas and records them in status."
    )
    resources: ResourceRequirements | None = Field(None, description="Merged over runtime.resources.")
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels the pool's pods must match."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list,
        max_length=64,
        description="Taints the pool's pods tolerate (GPU nodes often have some).",
    )
    affinity: dict[str, Any] | None = Field(None, description="A Kubernetes Affinity.")
    speculative: SpeculativeSpec | None = Field(
        None, description="MTP speculative decoding; decode (or unified) pool only."
    )
    nodes_per_replica: int = Field(
        1,
        ge=1,
        le=MAX_NODES_PER_REPLICA,
        description="Nodes (pods) one replica spans, each with runtime.tensorParallelSize GPUs. Above 1 a"
        " replica is a gang: a LeaderWorkerSet group whose leader serves and whose workers join it, started,"
        " scaled and restarted as one (needs LeaderWorkerSet installed). Replicas count groups.",
    )
    node_parallelism: Literal["pipeline", "tensor"] | None = Field(
        None,
        description="How a multi-node replica splits the model over its nodes: pipeline (the default: each"
        " node holds a stage of the layers, only activations cross the network) or tensor (every layer over"
        " all GPUs of all nodes: an all-reduce per layer crosses the network, for fast interconnects)."
        " Only with nodesPerReplica above 1.",
    )

    RULES = (
        CrossFieldRule(
            cel="!(has(self.replicas) && has(self.autoscaling))",
            message="set either replicas or autoscaling, not both: the autoscaler owns the replica count",
            holds=lambda p: p.replicas is None or p.autoscaling is None,
        ),
        CrossFieldRule(
            cel="!has(self.nodeParallelism) || (has(self.nodesPerReplica) && self.nodesPerReplica > 1)",
            message="nodeParallelism splits a replica over its nodes: set nodesPerReplica above 1, or remove it",
            holds=lambda p: p.node_parallelism is None or p.nodes_per_replica > 1,
        ),
    )

    @property
    def multi_node(self) -> bool:
        return self.nodes_per_replica > 1


class RouterSpec(ApiModel):
    """The PD-aware router: the OpenAI endpoint of the deployment."""

    replicas: int = Field(1, ge=1, le=64, description="Router pods.")
    policy: Literal["cache-aware", "least-load", "round-robin"] = Field(
        "cache-aware",
        description="How the router picks a worker: cache-aware (the worker likely to hold the prompt's"
        " prefix unless loads are unbalanced), least-load (fewest requests in flight), round-robin.",
    )
    # The router measures uncached prompt characters (it does not tokenize); the name says so.
    disaggregation_threshold_chars: int | None = Field(
        None,
        ge=0,
        le=INT32_MAX,
        description="Prompts with fewer uncached characters are prefilled on the decode pool"
        " (disaggregated mode; router default 512).",
    )
    resources: ResourceRequirements | None = Field(
        None, description="Router pod resources; default requests cpu 250m, memory 256Mi."
    )


# ---- networking, startup, autoscaling ----------------------------------------------------------


class RDMASpec(ApiModel):
    """RDMA for the KV-cache transfer between prefill and decode pods."""

    enabled: Literal["auto", "true", "false"] = Field(
        "auto", description='"auto" uses RDMA when nodes advertise resourceName. Quote true/false in YAML.'
    )
    resource_name: str = Field(
        DEFAULT_RDMA_RESOURCE,
        min_length=1,
        description="Default: the operator's SOVEREIGN_RDMA_RESOURCE, else rdma/rdma_shared_device_a.",
        json_schema_extra=_operator_default,
    )
    count: int = Field(
        1,
        ge=0,
        le=64,
        description="RDMA devices per prefill/decode pod (at least 1 unless enabled is false).",
    )
    networks: list[str] = Field(
        default_factory=list, max_length=16, description="Multus NetworkAttachmentDefinition names."
    )

    RULES = (
        CrossFieldRule(
            cel="self.enabled == 'false' || self.count >= 1",
            message="count must be at least 1 when RDMA is enabled or auto",
            holds=lambda r: r.enabled == "false" or r.count >= 1,
        ),
    )


class NetworkPolicySpec(ApiModel):
    """Who may reach the deployment's pods. Workers take HTTP only from the router, the operator and
    the deployment's own decode pods (remote prefill), the KV port only from its prefill/decode pods."""

    enabled: bool = Field(True, description="Render NetworkPolicies (they need a CNI that enforces them).")
    router_from: list[dict[str, Any]] | None = Field(
        None,
        max_length=32,
        description="NetworkPolicyPeers that may reach the router; default: every pod of the namespace.",
    )
    metrics_from: list[dict[str, Any]] = Field(
        default_factory=list,
        max_length=32,
        description="Extra NetworkPolicyPeers that may reach the workers' HTTP port, e.g. Prometheus"
        " scraping /metrics (the port also serves the API: grant it to scrapers only).",
    )


class NetworkingSpec(ApiModel):
    """How pods reach each other: RDMA for the KV transfer, and who may reach which pod."""

    rdma: RDMASpec = Field(default_factory=RDMASpec, description="RDMA for the KV-cache transfer.")
    network_policy: NetworkPolicySpec = Field(
        default_factory=NetworkPolicySpec, description="The NetworkPolicies rendered for the pods."
    )


class PVCRef(ApiModel):
    """A PersistentVolumeClaim in the deployment's namespace."""

    claim_name: str = Field(min_length=1, description="The PersistentVolumeClaim's name.")


class EmptyDirCache(ApiModel):
    """A per-pod emptyDir: compiled kernels last as long as the pod."""

    size_limit: Quantity = Field("20Gi", description="The emptyDir's size limit.")


class JitCacheSpec(ApiModel):
    """Where compiled kernels live. A PVC (ReadWriteMany) persists them across restarts."""

    pvc: PVCRef | None = Field(
        None, description="A ReadWriteMany claim shared by the pods: kernels compile once (warm budget)."
    )
    empty_dir: EmptyDirCache | None = Field(None, description="A per-pod emptyDir (the default, 20Gi).")

    RULES = (
        CrossFieldRule(
            cel="has(self.pvc) != has(self.emptyDir)",
            message="set exactly one of pvc or emptyDir",
            holds=lambda j: (j.pvc is None) != (j.empty_dir is None),
        ),
    )


class StartupSpec(ApiModel):
    """Startup planning; see docs/startup.md for the budget formula."""

    budget_seconds: int | None = Field(None, ge=10, le=86400, description="Overrides the computed budget.")
    read_bandwidth_mibps: int = Field(
        1000, ge=1, le=INT32_MAX, alias="readBandwidthMiBps", description="Weight read bandwidth per pod."
    )
    jit_cache: JitCacheSpec | None = Field(
        None, description="Where compiled kernels live; default an emptyDir of 20Gi."
    )


class MetricsSource(ApiModel):
    """Where the autoscaler reads the runtime's metrics."""

    source: Literal["pods", "prometheus"] = Field(
        "pods", description="pods: scrape each ready pod's /metrics; prometheus: query prometheusUrl."
    )
    prometheus_url: str | None = Field(
        None, description="Base URL of a Prometheus API (required when source is prometheus)."
    )

    RULES = (
        CrossFieldRule(
            cel="self.source != 'prometheus' || has(self.prometheusUrl)",
            message="prometheusUrl is required when source is prometheus",
            holds=lambda m: m.source != "prometheus" or m.prometheus_url is not None,
        ),
    )


class RatioBounds(ApiModel):
    """Bounds on the prefill:decode replica ratio."""

    min: float = Field(ge=0, le=1000, description="The smallest prefill/decode replica ratio.")
    max: float = Field(ge=0, le=1000, description="The largest prefill/decode replica ratio.")

    RULES = (
        CrossFieldRule(
            cel="self.min <= self.max",
            message="min must be less than or equal to max",
            holds=lambda r: r.min <= r.max,
        ),
    )


class AutoscalingSpec(ApiModel):
    """Deployment-wide autoscaler settings; per-pool bounds live in prefill/decode.autoscaling."""

    metrics: MetricsSource = Field(
        default_factory=MetricsSource, description="Where the runtime's metrics are read (default: the pods)."
    )
    prefill_decode_ratio: RatioBounds | None = Field(None, description="Bounds on prefill/decode replicas.")
    scale_up_stabilization_seconds: int = Field(
        180, ge=0, le=3600, description="Scale up only to the smallest recommendation over this window."
    )
    scale_down_stabilization_seconds: int = Field(
        300, ge=0, le=3600, description="Scale down only to the largest recommendation over this window."
    )
    interval_seconds: int = Field(30, ge=5, le=3600, description="Seconds between two autoscaling decisions.")


class RemediationSpec(ApiModel):
    """What the operator may do on its own when pods misbehave. Everything is off by default."""

    restart_on_output_failure: bool = Field(
        False,
        description="Delete a pod whose output self-test fails (OutputHealthy False), so a fresh start"
        " re-compiles its kernels: one pod of a pool at a time, with exponential backoff.",
    )
    restart_backoff_seconds: int = Field(
        60, ge=10, le=86400, description="Wait after the first restart; doubles after each further one."
    )
    max_restart_backoff_seconds: int = Field(
        1800, ge=10, le=86400, description="Cap on the wait between restarts."
    )

    RULES = (
        CrossFieldRule(
            cel="self.restartBackoffSeconds <= self.maxRestartBackoffSeconds",
            message="restartBackoffSeconds must be less than or equal to maxRestartBackoffSeconds",
            holds=lambda r: r.restart_backoff_seconds <= r.max_restart_backoff_seconds,
        ),
    )


# ---- the whole spec ----------------------------------------------------------------------------


class LLMDeploymentSpec(ApiModel):
    """One model served by prefill/decode (or one unified) pool(s) behind a router.

    In unified mode (set, or resolved from auto) the single pool is configured by `decode`.
    """

    model: ModelSpec = Field(description="The model to serve and where its weights live.")
    runtime: RuntimeSpec = Field(
        default_factory=RuntimeSpec, description="The inference runtime every worker pod runs."
    )
    mode: Mode = Field(
        "auto", description="auto: disaggregated when nodes advertise the RDMA resource, else unified."
    )
    prefill: PoolSpec | None = Field(
        None, description="The prefill pool (disaggregated mode); default replicas 1. Rejected by unified."
    )
    decode: PoolSpec | None = Field(
        None, description="The decode pool; in unified mode the one pool. Default replicas 1."
    )
    router: RouterSpec = Field(
        default_factory=RouterSpec, description="The OpenAI endpoint in front of the pools."
    )
    networking: NetworkingSpec = Field(
        default_factory=NetworkingSpec, description="How prefill and decode pods reach each other."
    )
    startup: StartupSpec = Field(
        default_factory=StartupSpec, description="Startup probe budget and the compiled-kernel cache."
    )
    autoscaling: AutoscalingSpec = Field(
        default_factory=AutoscalingSpec, description="Deployment-wide autoscaler settings."
    )
    remediation: RemediationSpec = Field(
        default_factory=RemediationSpec,
        description="What the operator may do on its own when pods misbehave; everything off by default.",
    )

    RULES = (
        CrossFieldRule(
            cel="self.mode != 'disaggregated' || (has(self.prefill) && has(self.decode))",
            message="mode disaggregated needs both the prefill and the decode pool",
            holds=lambda s: s.mode != "disaggregated" or (s.prefill is not None and s.decode is not None),
        ),
        CrossFieldRule(
            cel="self.mode != 'unified' || !has(self.prefill)",
            message="mode unified runs one pool configured by decode; remove prefill or use mode"
            " disaggregated or auto",
            holds=lambda s: s.mode != "unified" or s.prefill is None,
        ),
        CrossFieldRule(
            cel="!has(self.prefill) || !has(self.prefill.speculative)",
            message="speculative decoding drafts while decoding: set it on decode (the unified pool too),"
            " not on prefill",
            holds=lambda s: s.prefill is None or s.prefill.speculative is None,
        ),
        CrossFieldRule(
            cel="!has(self.decode) || !has(self.decode.speculative) || !has(self.runtime)"
            " || !has(self.runtime.args) || !self.runtime.args.exists(a, a.startsWith('--speculative-'))",
            message="decode.speculative renders the --speculative-* flags: remove them from runtime.args",
            holds=lambda s: (
                s.decode is None
                or s.decode.speculative is None
                or not any(a.startswith("--speculative-") for a in s.runtime.args)
            ),
        ),
        CrossFieldRule(
            cel="!has(self.runtime) || !has(self.runtime.chatTemplate) || !has(self.runtime.args)"
            " || !self.runtime.args.exists(a, a == '--chat-template' || a.startsWith('--chat-template='))",
            message="runtime.chatTemplate renders the --chat-template flag: remove it from runtime.args",
            holds=lambda s: (
                s.runtime.chat_template is None
                or not any(a == "--chat-template" or a.startswith("--chat-template=") for a in s.runtime.args)
            ),
        ),
        CrossFieldRule(
            cel="((!has(self.prefill) || !has(self.prefill.nodesPerReplica) || self.prefill.nodesPerReplica == 1)"
            " && (!has(self.decode) || !has(self.decode.nodesPerReplica) || self.decode.nodesPerReplica == 1))"
            " || !has(self.runtime) || !has(self.runtime.args)"
            " || !self.runtime.args.exists(a, "
            + " || ".join(f"a == '{f}' || a.startsWith('{f}=')" for f in GROUP_FLAGS)
            + ")",
            message="nodesPerReplica renders " + ", ".join(GROUP_FLAGS) + ": remove them from runtime.args",
            holds=lambda s: (
                not any(p is not None and p.multi_node for p in (s.prefill, s.decode))
                or not _sets_group_flag(s.runtime.args)
            ),
        ),
        CrossFieldRule(
            cel="!has(self.model.source.builtin) || !has(self.runtime)"
            " || !has(self.runtime.tensorParallelSize) || self.runtime.tensorParallelSize == 1",
            message="the builtin model runs on one CPU process: runtime.tensorParallelSize must be 1",
            holds=lambda s: s.model.source.builtin is None or s.runtime.tensor_parallel_size == 1,
        ),
    )

    def pool_for(self, component: str) -> PoolSpec | None:
        """The pool spec configuring a component's pool, None where the spec leaves it out; the
        unified pool is configured by `decode` (the one place this rule is written)."""
        return self.prefill if component == "prefill" else self.decode

    def uses_gpu(self) -> bool:
        if self.runtime.device is not None:
            return self.runtime.device == "gpu"
        return self.model.source.builtin is None
