"""Pure rendering: one LLMDeployment (+ cluster facts + autoscaler decisions) -> child objects.

The output is a list of plain dicts in a fixed order with sorted maps, so applying it twice is a
no-op for server-side apply and the operator can compare it byte for byte.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sovereign_operator.api.crd import API_VERSION, KIND
from sovereign_operator.api.spec import LLMDeploymentSpec, PoolSpec, ResourceRequirements
from sovereign_operator.api.status import StartupBudget
from sovereign_operator.render.gang import RENDEZVOUS_TIMEOUT_FLAG, leader_selector, leader_worker_set
from sovereign_operator.render.modelcache import (
    CHECKPOINT_SUBDIR,
    CacheObjects,
    ModelFacts,
    Serving,
    cache_objects,
)
from sovereign_operator.render.plan import (
    PROBE_PERIOD_SECONDS,
    ClusterFacts,
    Component,
    ModePlan,
    OperatorDefaults,
    SpecKey,
    group_budget,
    plan_replicas,
    pod_annotations,
    pool_spec_for,
    resolve_mode,
    spec_key,
    startup_budget,
    startup_failure_threshold,
    with_operator_defaults,
)
from sovereign_operator.vocabulary import (
    APP_NAME,
    BUDGET_SOURCE_ANNOTATION,
    COMPONENT_LABEL,
    INSTANCE_LABEL,
    LWS_KIND,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    NAME_LABEL,
    RUNTIME_PORT,
    chat_template_name,
    config_name,
    group_set_name,
    pool_name,
    router_name,
)

# The decode role's KV receiver (`serve --kv-port`, default 8001); prefill instances dial the pod IP.
KV_PORT = 8001
MODEL_MOUNT = "/models"
CHAT_TEMPLATE_MOUNT = "/etc/sovereign/chat-template"
CHAT_TEMPLATE_KEY = "chat_template.jinja"
JIT_CACHE_MOUNT = "/var/cache/sovereign/jit"
MULTUS_ANNOTATION = "k8s.v1.cni.cncf.io/networks"
SETTINGS_HASH_ANNOTATION = "sovereign.ai/settings-hash"
GPU_RESOURCE = "nvidia.com/gpu"
RUNTIME_UID = 65532  # the runtime image's user (images/runtime.Dockerfile)
RUNTIME_GID = 65532  # and its group
# Time after the preStop drain for SIGTERM handling and exit (the runtime gets --drain-timeout =
# runtime.drainTimeoutSeconds, the same bound the hook waits; the hook itself ends within
# PRESTOP_OVERRUN_SECONDS of that bound).
EXIT_GRACE_SECONDS = 45
PRESTOP_OVERRUN_SECONDS = 2
# A rolling update replaces the next old pod only this long after the new one turned Ready: the
# router learns of the new pod from its EndpointSlice watch (well under a second) before the old one
# starts draining, so there is always a worker it knows that takes new requests.
WORKER_MIN_READY_SECONDS = 10
# The router: a new pod counts as available after this long (kube-proxy on every node has programmed
# it into the Service); an old one keeps serving ROUTER_SHUTDOWN_DELAY_SECONDS after SIGTERM with
# readiness 503 while endpoints forget it, then lets in-flight streams finish (the workers' drain
# timeout) before it exits.
ROUTER_MIN_READY_SECONDS = 5
ROUTER_SHUTDOWN_DELAY_SECONDS = 5
ROUTER_EXIT_GRACE_SECONDS = 15
# While no worker can take a request (a one-replica pool whose pod restarts in a rolling update, every
# worker draining), the router holds it this long for one instead of answering 503 at once.
ROUTER_WAIT_FOR_WORKER_SECONDS = 60
# The router holds connections and a prefix tree of bounded size (2 M characters per pool): a memory
# limit stops a leak or a flood from taking the node down with it. No CPU limit: throttling the router
# would delay every request (its health checks measure their own lateness for the same reason).
ROUTER_DEFAULT_RESOURCES = {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}
# Writable places of a worker whose root filesystem is read-only: temporary files (TP rendezvous,
# torch) and the home cache (Hugging Face, torch extensions); the JIT cache has its own volume.
WORKER_SCRATCH = (("tmp", "/tmp"), ("home-cache", "/home/sovereign/.cache"))

# The preStop hook: ask the runtime to drain, then wait until nothing runs or queues. It only
# uses the runtime's contract (POST /drain, the vLLM request gauges on /metrics) and python3.
DRAIN_SCRIPT = """\
import os, sys, time, urllib.error, urllib.request
base = "http://127.0.0.1:RUNTIME_PORT"
deadline = time.monotonic() + float(sys.argv[1])
def timeout():
    # Every call ends by the deadline (or half a second after it): the hook ends inside the grace period.
    return max(0.5, min(5.0, deadline - time.monotonic()))
# /drain takes the API key like the API does.
key = os.environ.get("SOVEREIGN_API_KEY")
auth = {"Authorization": "Bearer " + key} if key else {}
try:
    urllib.request.urlopen(urllib.request.Request(base + "/drain", method="POST", headers=auth), timeout=timeout())
except urllib.error.HTTPError as error:
    # Non-zero: the kubelet records FailedPreStopHook with this line; its SIGTERM still drains.
    sys.exit("preStop: POST /drain answered %d: %s" % (error.code, error.read()[:200].decode(errors="replace")))
except Exception:
    sys.exit(0)  # nothing listens (still starting, or already gone): nothing to drain
gauges = ("vllm:num_requests_running", "vllm:num_requests_waiting")
while deadline - time.monotonic() > 0:
    try:
        text = urllib.request.urlopen(base + "/metrics", timeout=timeout()).read().decode()
    except Exception:
        break  # the runtime finished its drain and exited
    busy = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(gauges))
    if busy == 0:
        break
    time.sleep(max(0.0, min(1.0, deadline - time.monotonic())))
""".replace("RUNTIME_PORT", str(RUNTIME_PORT))


@dataclass(frozen=True)
class DeploymentRef:
    """The identity of the LLMDeployment being rendered."""

    name: str
    namespace: str
    uid: str
    generation: int = 1


@dataclass(frozen=True)
class Rendered:
    children: list[dict[str, Any]]
    plan: ModePlan
    # The startup budget rendered into the probes (the formula's, or one decided from observed starts).
    budget: StartupBudget
    replicas: dict[Component, int]
    endpoint: str
    # The formula's budget for this spec (what a learned budget starts from and is bounded by).
    formula: StartupBudget
    # What the pools' starts are samples of, and the digest of their pod templates without the probe.
    spec_key: SpecKey
    template_hash: str
    # A huggingFace source's shared objects (resolve Job, or cache claim and download Job): applied
    # under this deployment's own field manager, never pruned, released when no longer rendered.
    shared: list[dict[str, Any]] = field(default_factory=list)
    # Shared objects still in use though not rendered (the cache the pools read during an update).
    keep_shared: frozenset[tuple[str, str]] = frozenset()
    # None unless the source is huggingFace; then what the cluster said about it.
    model: ModelFacts | None = None
    cache: CacheObjects | None = None

    @property
    def waiting_for_model(self) -> bool:
        """The pools are not rendered yet: their weights are still being downloaded."""
        return self.model is not None and self.model.serving is None


# ---- names and metadata ------------------------------------------------------------------------


def selector_labels(deployment: str, component: str) -> dict[str, str]:
    return {COMPONENT_LABEL: component, INSTANCE_LABEL: deployment, NAME_LABEL: APP_NAME}


def child_labels(deployment: str, component: str) -> dict[str, str]:
    return _sorted({**selector_labels(deployment, component), MANAGED_BY_LABEL: MANAGED_BY})


def _metadata(ref: DeploymentRef, name: str, component: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": ref.namespace,
        "labels": child_labels(ref.name, component),
        "ownerReferences": [
            {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": ref.name,
                "uid": ref.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }


def _sorted(mapping: Mapping[str, Any]) -> dict[str, Any]:
    return {key: mapping[key] for key in sorted(mapping)}


# ---- worker pods -------------------------------------------------------------------------------


def _model_volume(spec: LLMDeploymentSpec, serving: Serving | None) -> tuple[str, dict[str, Any] | None]:
    """The `--model` argument and the volume holding the weights (None for builtin models)."""
    source = spec.model.source
    if source.builtin is not None:
        return f"builtin:{source.builtin}", None
    if source.hugging_face is not None:
        assert serving is not None  # pools render only once the download is complete
        volume = {"persistentVolumeClaim": {"claimName": serving.cache, "readOnly": True}}
        subpath = CHECKPOINT_SUBDIR
    elif source.pvc is not None:
        volume = {"persistentVolumeClaim": {"claimName": source.pvc.claim_name, "readOnly": True}}
        subpath = source.pvc.path
    elif source.host_path is not None:
        volume = {"hostPath": {"path": source.host_path.path, "type": "Directory"}}
        subpath = ""
    else:
        assert source.image is not None
        volume = {"image": {"reference": source.image.reference, "pullPolicy": source.image.pull_policy}}
        subpath = source.image.path
    path = MODEL_MOUNT + ("/" + subpath.strip("/") if subpath.strip("/") else "")
    return path, {"name": "model", **volume}


def _jit_cache_volume(spec: LLMDeploymentSpec) -> dict[str, Any]:
    cache = spec.startup.jit_cache
    if cache is not None and cache.pvc is not None:
        return {"name": "jit-cache", "persistentVolumeClaim": {"claimName": cache.pvc.claim_name}}
    size = cache.empty_dir.size_limit if cache is not None and cache.empty_dir is not None else "20Gi"
    return {"name": "jit-cache", "emptyDir": {"sizeLimit": size}}


def merged_resources(*layers: ResourceRequirements | None) -> dict[str, dict[str, Any]]:
    """Later layers override earlier ones key by key, separately for requests and limits."""
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    for layer in layers:
        if layer is not None:
            requests.update(layer.requests)
            limits.update(layer.limits)
    return {"limits": limits, "requests": requests}


ROUTER_DEFAULT_RESOURCES_MODEL = ResourceRequirements.model_validate(ROUTER_DEFAULT_RESOURCES)


def _worker_resources(spec: LLMDeploymentSpec, pool: PoolSpec, plan: ModePlan) -> dict[str, Any]:
    resources = merged_resources(spec.runtime.resources, pool.resources)
    # Extended resources (GPUs, RDMA devices) must have requests equal to limits.
    if spec.uses_gpu():
        for part in ("requests", "limits"):
            resources[part][GPU_RESOURCE] = spec.runtime.tensor_parallel_size
    if plan.kv_transport == "rdma":
        rdma = spec.networking.rdma
        for part in ("requests", "limits"):
            resources[part][rdma.resource_name] = rdma.count
    return {part: _sorted(values) for part, values in sorted(resources.items()) if values}


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def _runtime_args(spec: LLMDeploymentSpec, component: Component, plan: ModePlan, model_arg: str) -> list[str]:
    args = [
        "serve",
        "--model",
        model_arg,
        "--role",
        component,
        "--host",
        "0.0.0.0",
        "--port",
        str(RUNTIME_PORT),
        "--served-model-name",
        spec.model.name,
        "--tensor-parallel-size",
        str(spec.runtime.tensor_parallel_size),
    ]
    if spec.runtime.drain_timeout_seconds > 0:
        # POST /drain (the preStop hook) starts the runtime's own drain clock: without this it would
        # abort in-flight requests after its 30 s default while the hook and grace period allow more.
        args += ["--drain-timeout", str(spec.runtime.drain_timeout_seconds)]
    if plan.kv_transport is not None:
        args += ["--kv-transport", plan.kv_transport]
    if spec.runtime.chat_template is not None:
        args += ["--chat-template", f"{CHAT_TEMPLATE_MOUNT}/{CHAT_TEMPLATE_KEY}"]
    return args + speculative_args(spec, component) + list(spec.runtime.args)


def speculative_args(spec: LLMDeploymentSpec, component: Component) -> list[str]:
    """The decode (or unified) pool's ``--speculative-*`` flags from ``decode.speculative``."""
    pool = spec.pool_for(component)
    wanted = pool.speculative if pool is not None and component != "prefill" else None
    if wanted is None:
        return []
    args = [
        "--speculative-algorithm",
        wanted.algorithm,
        "--speculative-num-draft-tokens",
        str(wanted.num_draft_tokens),
    ]
    if wanted.max_batch_size is not None:
        args += ["--speculative-max-batch-size", str(wanted.max_batch_size)]
    return args


def _worker_env(spec: LLMDeploymentSpec) -> list[dict[str, Any]]:
    def field_ref(name: str, path: str) -> dict[str, Any]:
        return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}

    env = [
        field_ref("POD_NAME", "metadata.name"),
        field_ref("POD_NAMESPACE", "metadata.namespace"),
        field_ref("POD_IP", "status.podIP"),
        # One persistent place for every JIT: Triton, torch inductor and DeepGEMM.
        {"name": "TRITON_CACHE_DIR", "value": f"{JIT_CACHE_MOUNT}/triton"},
        {"name": "TORCHINDUCTOR_CACHE_DIR", "value": f"{JIT_CACHE_MOUNT}/inductor"},
        {"name": "DG_JIT_CACHE_DIR", "value": f"{JIT_CACHE_MOUNT}/deepgemm"},
    ]
    return env + [var.to_api() for var in spec.runtime.env]


def _non_root_user() -> dict[str, Any]:
    """Pod-level identity: the image's user by number, so a different image cannot run as root."""
    return {
        "runAsGroup": RUNTIME_GID,
        "runAsNonRoot": True,
        "runAsUser": RUNTIME_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _restricted_container_security() -> dict[str, Any]:
    """What Pod Security's `restricted` profile asks of a container."""
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def _worker_pod_template(
    ref: DeploymentRef,
    spec: LLMDeploymentSpec,
    component: Component,
    plan: ModePlan,
    budget: StartupBudget,
    settings_hash: str,
    serving: Serving | None = None,
) -> dict[str, Any]:
    pool = pool_spec_for(spec, component)
    model_arg, model_volume = _model_volume(spec, serving)
    mounts = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "jit-cache", "mountPath": JIT_CACHE_MOUNT},
        *({"name": name, "mountPath": path} for name, path in WORKER_SCRATCH),
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        _jit_cache_volume(spec),
        *({"name": name, "emptyDir": {}} for name, _ in WORKER_SCRATCH),
    ]
    if model_volume is not None:
        mounts.insert(0, {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
        volumes.insert(0, model_volume)
    if spec.runtime.chat_template is not None:
        mounts.append({"name": "chat-template", "mountPath": CHAT_TEMPLATE_MOUNT, "readOnly": True})
        volumes.append({"name": "chat-template", "configMap": {"name": chat_template_name(ref.name)}})

    # The profile its starts are samples of, and whether its probe's budget was learned.
    annotations = {
        SETTINGS_HASH_ANNOTATION: settings_hash,
        **pod_annotations(spec_key(spec, serving), budget),
    }
    container: dict[str, Any] = {
        "name": "runtime",
        "image": spec.runtime.image,
        "imagePullPolicy": spec.runtime.image_pull_policy,
        "command": ["sovereign-runtime"],
        "args": _runtime_args(spec, component, plan, model_arg),
        "ports": [{"name": "http", "containerPort": RUNTIME_PORT, "protocol": "TCP"}]
        + ([{"name": "kv", "containerPort": KV_PORT, "protocol": "TCP"}] if component == "decode" else []),
        "env": _worker_env(spec),
        "envFrom": [{"configMapRef": {"name": config_name(ref.name)}}],
        "resources": _worker_resources(spec, pool, plan),
        # Startup runs first with a budget sized for weight loading and JIT; liveness and
        # readiness only count once it has succeeded.
        "startupProbe": _probe("/health/startup", PROBE_PERIOD_SECONDS, startup_failure_threshold(budget)),
        "livenessProbe": _probe("/health", 10, 3),
        "readinessProbe": _probe("/health/ready", 5, 3),
        # A crash's last log lines land in the pod's status: Degraded quotes them.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "lifecycle": {
            "preStop": {
                "exec": {"command": ["python3", "-c", DRAIN_SCRIPT, str(spec.runtime.drain_timeout_seconds)]}
            }
        },
        "volumeMounts": mounts,
        # Everything the runtime writes goes to the volumes above.
        "securityContext": {**_restricted_container_security(), "readOnlyRootFilesystem": True},
    }
    if plan.kv_transport == "rdma":
        # Registering memory for RDMA needs locked pages: the one capability such a pod keeps (the
        # namespace then needs Pod Security `baseline`; every other pod fits `restricted`).
        container["securityContext"]["capabilities"]["add"] = ["IPC_LOCK"]
        if spec.networking.rdma.networks:
            annotations[MULTUS_ANNOTATION] = ",".join(spec.networking.rdma.networks)

    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        # The runtime image runs as a non-root user; fsGroup makes a JIT-cache PVC writable to it.
        "securityContext": {
            "fsGroup": RUNTIME_GID,
            "fsGroupChangePolicy": "OnRootMismatch",
            **_non_root_user(),
        },
        "terminationGracePeriodSeconds": spec.runtime.drain_timeout_seconds + EXIT_GRACE_SECONDS,
        "containers": [container],
        "volumes": volumes,
    }
    if pool.node_selector:
        pod_spec["nodeSelector"] = _sorted(pool.node_selector)
    if pool.tolerations:
        pod_spec["tolerations"] = [t.to_api() for t in pool.tolerations]
    if pool.affinity:
        pod_spec["affinity"] = pool.affinity
    return {
        "metadata": {"labels": child_labels(ref.name, component), "annotations": _sorted(annotations)},
        "spec": pod_spec,
    }


# ---- children ----------------------------------------------------------------------------------


def _config_map(ref: DeploymentRef, spec: LLMDeploymentSpec, plan: ModePlan) -> dict[str, Any]:
    data = {
        "SOVEREIGN_DEPLOYMENT": ref.name,
        "SOVEREIGN_MODE": plan.mode,
        "SOVEREIGN_KV_TRANSPORT": plan.kv_transport or "none",
        "SOVEREIGN_SERVED_MODEL_NAME": spec.model.name,
        "SOVEREIGN_TENSOR_PARALLEL_SIZE": str(spec.runtime.tensor_parallel_size),
    }
    if plan.mode == "disaggregated":
        data["SOVEREIGN_PREFILL_SERVICE"] = pool_name(ref.name, "prefill")
        data["SOVEREIGN_DECODE_SERVICE"] = pool_name(ref.name, "decode")
    if plan.kv_transport == "rdma":
        data["SOVEREIGN_RDMA_RESOURCE"] = spec.networking.rdma.resource_name
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(ref, config_name(ref.name), "config"),
        "data": _sorted(data),
    }


def _chat_template_config_map(ref: DeploymentRef, template: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(ref, chat_template_name(ref.name), "config"),
        "data": {CHAT_TEMPLATE_KEY: template},
    }


def _headless_service(ref: DeploymentRef, component: str, leaders_only: bool = False) -> dict[str, Any]:
    selector = selector_labels(ref.name, component)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(ref, pool_name(ref.name, component), component),
        "spec": {
            "clusterIP": "None",
            # A multi-node pool's traffic goes to its groups' leaders only (render/gang.py).
            "selector": leader_selector(selector) if leaders_only else selector,
            "ports": [{"name": "http", "port": RUNTIME_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def _stateful_set(
    ref: DeploymentRef,
    spec: LLMDeploymentSpec,
    component: Component,
    replicas: int,
    plan: ModePlan,
    budget: StartupBudget,
    settings_hash: str,
    serving: Serving | None = None,
) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _metadata(ref, pool_name(ref.name, component), component),
        "spec": {
            "replicas": replicas,
            "serviceName": pool_name(ref.name, component),
            # Starts take many minutes; ordered start-up would serialise them.
            "podManagementPolicy": "Parallel",
            "minReadySeconds": WORKER_MIN_READY_SECONDS,
            "updateStrategy": {"type": "RollingUpdate"},
            "selector": {"matchLabels": selector_labels(ref.name, component)},
            "template": _worker_pod_template(ref, spec, component, plan, budget, settings_hash, serving),
        },
    }


def _pdb(ref: DeploymentRef, component: str, name: str) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(ref, name, component),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(ref.name, component)}},
    }


def _router_rbac(ref: DeploymentRef) -> list[dict[str, Any]]:
    name = router_name(ref.name)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(ref, name, "router")},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _metadata(ref, name, "router"),
            # The router discovers workers from the pools' EndpointSlices.
            "rules": [
                {
                    "apiGroups": ["discovery.k8s.io"],
                    "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"],
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _metadata(ref, name, "router"),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ref.namespace}],
        },
    ]


def router_drain_seconds(spec: LLMDeploymentSpec) -> int:
    """How long a stopping router lets in-flight streams run: as long as a worker lets them run."""
    return max(1, spec.runtime.drain_timeout_seconds)


def _router_args(ref: DeploymentRef, spec: LLMDeploymentSpec, plan: ModePlan) -> list[str]:
    args = [
        "router",
        "--host",
        "0.0.0.0",
        "--port",
        str(RUNTIME_PORT),
        "--policy",
        spec.router.policy,
        "--namespace",
        ref.namespace,
        "--wait-for-worker",
        str(ROUTER_WAIT_FOR_WORKER_SECONDS),
        "--shutdown-delay",
        str(ROUTER_SHUTDOWN_DELAY_SECONDS),
        "--drain-timeout",
        str(router_drain_seconds(spec)),
    ]
    if plan.mode == "disaggregated":
        args += [
            "--prefill-service",
            pool_name(ref.name, "prefill"),
            "--decode-service",
            pool_name(ref.name, "decode"),
        ]
        if spec.router.disaggregation_threshold_chars is not None:
            args += ["--disaggregation-threshold", str(spec.router.disaggregation_threshold_chars)]
    else:
        args += ["--worker-service", pool_name(ref.name, "unified")]
    return args


def _router_deployment(ref: DeploymentRef, spec: LLMDeploymentSpec, plan: ModePlan) -> dict[str, Any]:
    router = spec.router
    resources = merged_resources(ROUTER_DEFAULT_RESOURCES_MODEL, router.resources)
    own = router.resources
    if own is not None and "memory" in own.requests and "memory" not in own.limits:
        # A memory request of the spec's own must not exceed the default limit: limit = request.
        resources["limits"]["memory"] = own.requests["memory"]
    container = {
        "name": "router",
        "image": spec.runtime.image,
        "imagePullPolicy": spec.runtime.image_pull_policy,
        "command": ["sovereign-runtime"],
        "args": _router_args(ref, spec, plan),
        "ports": [{"name": "http", "containerPort": RUNTIME_PORT, "protocol": "TCP"}],
        "resources": {part: _sorted(values) for part, values in sorted(resources.items()) if values},
        "livenessProbe": _probe("/health", 10, 3),
        # Ready once its EndpointSlice watch has listed the pools (a new router pod in a rolling update
        # knows the workers before it gets traffic), and not while it stops.
        "readinessProbe": _probe("/health/ready", 5, 3),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        # The router writes nothing to disk.
        "securityContext": {**_restricted_container_security(), "readOnlyRootFilesystem": True},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(ref, router_name(ref.name), "router"),
        "spec": {
            "replicas": router.replicas,
            "selector": {"matchLabels": selector_labels(ref.name, "router")},
            "minReadySeconds": ROUTER_MIN_READY_SECONDS,
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": child_labels(ref.name, "router")},
                "spec": {
                    "serviceAccountName": router_name(ref.name),
                    "securityContext": _non_root_user(),
                    "terminationGracePeriodSeconds": ROUTER_SHUTDOWN_DELAY_SECONDS
                    + router_drain_seconds(spec)
                    + ROUTER_EXIT_GRACE_SECONDS,
                    "containers": [container],
                },
            },
        },
    }


def _router_service(ref: DeploymentRef) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        # The OpenAI endpoint carries the deployment's own name.
        "metadata": _metadata(ref, ref.name, "router"),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(ref.name, "router"),
            "ports": [{"name": "http", "port": RUNTIME_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


# ---- network policies --------------------------------------------------------------------------


def _pods_of(ref: DeploymentRef, *components: str) -> list[dict[str, Any]]:
    return [{"podSelector": {"matchLabels": selector_labels(ref.name, c)}} for c in components]


def _operator_peer(operator_namespace: str) -> dict[str, Any]:
    return {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": operator_namespace}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/component": "operator"}},
    }


def _tcp(port: int) -> list[dict[str, Any]]:
    return [{"port": port, "protocol": "TCP"}]


def _network_policy(
    ref: DeploymentRef, component: str, name: str, rules: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(ref, name, component),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(ref.name, component)},
            "policyTypes": ["Ingress"],
            "ingress": rules,
        },
    }


def network_policies(
    ref: DeploymentRef, spec: LLMDeploymentSpec, components: list[Component], operator_namespace: str
) -> list[dict[str, Any]]:
    """Ingress for every pool and the router: whatever is not listed is refused."""
    policy = spec.networking.network_policy
    if not policy.enabled:
        return []
    scrapers = [_operator_peer(operator_namespace), *policy.metrics_from]
    children = []
    for component in components:
        http_from = [*_pods_of(ref, "router"), *scrapers]
        if component == "prefill":
            http_from += _pods_of(ref, "decode")  # the decode role calls /v1/internal/prefill
        rules = [{"from": http_from, "ports": _tcp(RUNTIME_PORT)}]
        if component == "decode":
            rules.append({"from": _pods_of(ref, "prefill", "decode"), "ports": _tcp(KV_PORT)})
        if pool_spec_for(spec, component).multi_node:
            # A group's ranks meet at the leader's rendezvous port and then talk on ports gloo/NCCL pick.
            rules.append({"from": _pods_of(ref, component)})
        children.append(_network_policy(ref, component, pool_name(ref.name, component), rules))
    router_from = policy.router_from if policy.router_from is not None else [{"podSelector": {}}]
    router_rules = [
        {"from": router_from, "ports": _tcp(RUNTIME_PORT)},
        {"from": scrapers, "ports": _tcp(RUNTIME_PORT)},
    ]
    children.append(_network_policy(ref, "router", router_name(ref.name), router_rules))
    return children


def endpoint_url(ref: DeploymentRef) -> str:
    return f"http://{ref.name}.{ref.namespace}.svc:{RUNTIME_PORT}/v1"


def render(
    ref: DeploymentRef,
    spec: LLMDeploymentSpec,
    facts: ClusterFacts | None = None,
    replica_overrides: Mapping[str, int] | None = None,
    resolved: ModePlan | None = None,
    defaults: OperatorDefaults | None = None,
    model: ModelFacts | None = None,
    budget: StartupBudget | None = None,
) -> Rendered:
    """Every child of one LLMDeployment, in apply order.

    `resolved` is the mode decided earlier for this same spec generation; when given, the cluster
    facts are not consulted again (see `sticky_plan`). `model` is what the cluster said about a
    huggingFace source (see modelcache.py); the pools render once its download is complete. `budget`
    is the startup budget decided from observed starts (startupbudget.py); without it, the formula's.
    """
    defaults = defaults or OperatorDefaults()
    spec = with_operator_defaults(spec, defaults)
    plan = resolved if resolved is not None else resolve_mode(spec, facts or ClusterFacts())
    cache = None
    serving = None
    if spec.model.source.hugging_face is not None:
        model = model or ModelFacts()
        cache = cache_objects(ref.name, ref.uid, ref.namespace, spec, defaults.hf_endpoint, model)
        serving = model.serving
    else:
        model = None
    measured = (
        serving.bytes_total if serving else (model.resolved.bytes_total if model and model.resolved else None)
    )
    replicas = plan_replicas(spec, plan.mode, replica_overrides or {})
    # A multi-node pool's group start is part of the formula (plan.group_budget).
    widest = max((pool_spec_for(spec, c).nodes_per_replica for c in replicas), default=1)
    formula = group_budget(startup_budget(spec, measured), widest)
    budget = budget or formula
    config = _config_map(ref, spec, plan)
    configs = [config]
    settings = config["data"]
    if spec.runtime.chat_template is not None:
        configs.append(_chat_template_config_map(ref, spec.runtime.chat_template))
        settings = {**settings, CHAT_TEMPLATE_KEY: spec.runtime.chat_template}
    # Pods roll when what they read from the ConfigMaps changes (settings, the chat template).
    settings_hash = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]

    children: list[dict[str, Any]] = [*configs, *_router_rbac(ref)]
    for component, count in replicas.items():
        pool = pool_spec_for(spec, component)
        children.append(_headless_service(ref, component, leaders_only=pool.multi_node))
        downloaded = model is None or serving is not None  # a huggingFace source's pools wait for it
        if downloaded and pool.multi_node:
            template = _worker_pod_template(ref, spec, component, plan, budget, settings_hash, serving)
            metadata = _metadata(ref, group_set_name(ref.name, component), component)
            selector = selector_labels(ref.name, component)
            children.append(leader_worker_set(metadata, spec, pool, count, budget, template, selector))
        elif downloaded:
            children.append(_stateful_set(ref, spec, component, count, plan, budget, settings_hash, serving))
        children.append(_pdb(ref, component, pool_name(ref.name, component)))
    children += [
        _router_service(ref),
        _router_deployment(ref, spec, plan),
        _pdb(ref, "router", router_name(ref.name)),
        *network_policies(ref, spec, list(replicas), defaults.operator_namespace),
    ]
    return Rendered(
        children=children,
        plan=plan,
        budget=budget,
        replicas=replicas,
        endpoint=endpoint_url(ref),
        formula=formula,
        spec_key=spec_key(spec, serving),
        template_hash=pod_templates_hash(children),
        shared=cache.shared if cache is not None else [],
        keep_shared=frozenset({("PersistentVolumeClaim", serving.cache)} if serving is not None else ()),
        model=model,
        cache=cache,
    )


def _worker_templates(child: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The worker pod templates of a pool's StatefulSet or LeaderWorkerSet, by a name each."""
    name = child["metadata"]["name"]
    if child.get("kind") == "StatefulSet":
        return [(name, child["spec"]["template"])]
    if child.get("kind") == LWS_KIND:
        group = child["spec"]["leaderWorkerTemplate"]
        return [(f"{name}/leader", group["leaderTemplate"]), (f"{name}/worker", group["workerTemplate"])]
    return []


def pod_templates_hash(children: list[dict[str, Any]]) -> str:
    """A digest of the worker pod templates without what the startup budget sets (the probe's
    failureThreshold, the budget-source annotation, a group's --rendezvous-timeout): it changes exactly
    when the pods roll for another reason, which is when a learned budget may change too."""
    templates = []
    for child in children:
        for name, original in _worker_templates(child):
            template = json.loads(json.dumps(original))
            template.get("metadata", {}).get("annotations", {}).pop(BUDGET_SOURCE_ANNOTATION, None)
            for container in template["spec"]["containers"]:
                container.get("startupProbe", {}).pop("failureThreshold", None)
                args = container.get("args") or []
                if RENDEZVOUS_TIMEOUT_FLAG in args[:-1]:
                    args[args.index(RENDEZVOUS_TIMEOUT_FLAG) + 1] = "budget"
            templates.append([name, template])
    return hashlib.sha256(json.dumps(templates, sort_keys=True).encode()).hexdigest()[:16]
