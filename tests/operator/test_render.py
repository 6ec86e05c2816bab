"""Rendering, table-driven: modes, RDMA on/off/auto, probe budgets, resources, labels, owners."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from operator_specs import DEEPSEEK_SPEC, TINY_SPEC, with_changes
from sovereign_operator import yamlio
from sovereign_operator.api import LLMDeploymentSpec
from sovereign_operator.render import ClusterFacts, DeploymentRef, Rendered, render, startup_budget
from sovereign_operator.render.plan import PROBE_PERIOD_SECONDS, OperatorDefaults
from sovereign_runtime.router.cli import add_router_arguments, validate_router_args

REF = DeploymentRef(name="llm", namespace="team-a", uid="uid-123", generation=3)
RDMA = "rdma/rdma_shared_device_a"
RDMA_NODES = ClusterFacts(frozenset({RDMA}))
NO_RDMA = ClusterFacts()


def _render(spec: dict[str, Any], facts: ClusterFacts = NO_RDMA, **overrides: int) -> Rendered:
    return render(REF, LLMDeploymentSpec.model_validate(spec), facts, overrides)


def _one(rendered: Rendered, kind: str, name: str) -> dict[str, Any]:
    matches = [c for c in rendered.children if c["kind"] == kind and c["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name} not rendered exactly once"
    return matches[0]


def _container(statefulset: dict[str, Any]) -> dict[str, Any]:
    return statefulset["spec"]["template"]["spec"]["containers"][0]


def _arg(container: dict[str, Any], flag: str) -> str | None:
    args = container["args"]
    return args[args.index(flag) + 1] if flag in args else None


MODE_CASES = [
    # (name, spec, facts, mode, transport, pools)
    ("unified explicit", TINY_SPEC, RDMA_NODES, "unified", None, ["unified"]),
    (
        "auto without rdma nodes",
        with_changes(DEEPSEEK_SPEC, mode="auto"),
        NO_RDMA,
        "unified",
        None,
        ["unified"],
    ),
    (
        "auto with rdma nodes",
        with_changes(DEEPSEEK_SPEC, mode="auto", networking__rdma__enabled="auto"),
        RDMA_NODES,
        "disaggregated",
        "rdma",
        ["prefill", "decode"],
    ),
    (
        "auto with rdma disabled",
        with_changes(DEEPSEEK_SPEC, mode="auto", networking__rdma__enabled="false"),
        RDMA_NODES,
        "unified",
        None,
        ["unified"],
    ),
    ("disaggregated rdma true", DEEPSEEK_SPEC, NO_RDMA, "disaggregated", "rdma", ["prefill", "decode"]),
    (
        "disaggregated rdma auto, none advertised",
        with_changes(DEEPSEEK_SPEC, networking__rdma__enabled="auto"),
        NO_RDMA,
        "disaggregated",
        "tcp",
        ["prefill", "decode"],
    ),
    (
        "disaggregated rdma false",
        with_changes(DEEPSEEK_SPEC, networking__rdma__enabled="false"),
        RDMA_NODES,
        "disaggregated",
        "tcp",
        ["prefill", "decode"],
    ),
]


@pytest.mark.parametrize(
    ("name", "spec", "facts", "mode", "transport", "pools"), MODE_CASES, ids=[c[0] for c in MODE_CASES]
)
def test_mode_and_transport(
    name: str,
    spec: dict[str, Any],
    facts: ClusterFacts,
    mode: str,
    transport: str | None,
    pools: list[str],
) -> None:
    rendered = _render(spec, facts)
    assert rendered.plan.mode == mode
    assert rendered.plan.kv_transport == transport
    statefulsets = [c["metadata"]["name"] for c in rendered.children if c["kind"] == "StatefulSet"]
    assert statefulsets == [f"llm-{pool}" for pool in pools]
    for pool in pools:
        container = _container(_one(rendered, "StatefulSet", f"llm-{pool}"))
        assert _arg(container, "--role") == pool
        assert _arg(container, "--kv-transport") == transport
        # The decode role's KV receiver listens on 8001 (`serve --kv-port` default), advertised by POD_IP.
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == ({"http": 8000, "kv": 8001} if pool == "decode" else {"http": 8000})
        assert any(e["name"] == "POD_IP" for e in container["env"])
        resources = container["resources"]
        has_rdma = RDMA in resources.get("requests", {})
        assert has_rdma == (transport == "rdma")
        capabilities = container.get("securityContext", {}).get("capabilities", {}).get("add", [])
        assert ("IPC_LOCK" in capabilities) == (transport == "rdma")


def test_auto_unified_explains_why() -> None:
    rendered = _render(with_changes(DEEPSEEK_SPEC, mode="auto", networking__rdma__enabled="auto"), NO_RDMA)
    assert RDMA in rendered.plan.reason and "TCP" in rendered.plan.reason and "slower" in rendered.plan.reason


def test_unified_pool_takes_decode_settings() -> None:
    spec = with_changes(TINY_SPEC, decode={"replicas": 3, "nodeSelector": {"pool": "cpu"}})
    statefulset = _one(_render(spec), "StatefulSet", "llm-unified")
    assert statefulset["spec"]["replicas"] == 3
    assert statefulset["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "cpu"}


def test_rdma_resources_multus_and_count() -> None:
    spec = with_changes(
        DEEPSEEK_SPEC, networking__rdma={"enabled": "true", "count": 2, "networks": ["a", "b"]}
    )
    statefulset = _one(_render(spec), "StatefulSet", "llm-decode")
    resources = _container(statefulset)["resources"]
    assert resources["requests"][RDMA] == 2 and resources["limits"][RDMA] == 2
    annotations = statefulset["spec"]["template"]["metadata"]["annotations"]
    assert annotations["k8s.v1.cni.cncf.io/networks"] == "a,b"


def test_gpu_count_is_tensor_parallel_size_and_cpu_model_gets_none() -> None:
    gpu = _container(_one(_render(DEEPSEEK_SPEC), "StatefulSet", "llm-prefill"))
    assert gpu["resources"]["requests"]["nvidia.com/gpu"] == 8
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert _arg(gpu, "--tensor-parallel-size") == "8"
    cpu = _container(_one(_render(TINY_SPEC), "StatefulSet", "llm-unified"))
    assert "nvidia.com/gpu" not in cpu["resources"].get("limits", {})
    assert _arg(cpu, "--model") == "builtin:sovereign-tiny"


def test_pool_resources_merge_over_runtime_resources() -> None:
    spec = with_changes(
        DEEPSEEK_SPEC,
        runtime__resources={"requests": {"cpu": "32", "memory": "1Ti"}, "limits": {"memory": "1Ti"}},
        prefill={"replicas": 1, "resources": {"requests": {"cpu": "64"}}},
    )
    prefill = _container(_one(_render(spec), "StatefulSet", "llm-prefill"))["resources"]
    decode = _container(_one(_render(spec), "StatefulSet", "llm-decode"))["resources"]
    assert prefill["requests"]["cpu"] == "64" and prefill["requests"]["memory"] == "1Ti"
    assert decode["requests"]["cpu"] == "32"


@pytest.mark.parametrize(
    ("source", "model_arg", "volume_key"),
    [
        ({"pvc": {"claimName": "w", "path": "/ckpt/"}}, "/models/ckpt", "persistentVolumeClaim"),
        ({"hostPath": {"path": "/data/w"}}, "/models", "hostPath"),
        ({"image": {"reference": "reg/weights:1", "path": "m"}}, "/models/m", "image"),
    ],
)
def test_model_sources_mount_read_only(source: dict[str, Any], model_arg: str, volume_key: str) -> None:
    statefulset = _one(
        _render(with_changes(DEEPSEEK_SPEC, model__source=source)), "StatefulSet", "llm-decode"
    )
    container = _container(statefulset)
    assert _arg(container, "--model") == model_arg
    volumes = {v["name"]: v for v in statefulset["spec"]["template"]["spec"]["volumes"]}
    assert volume_key in volumes["model"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "model")
    assert mount == {"name": "model", "mountPath": "/models", "readOnly": True}


def test_shm_jit_cache_and_cache_environment() -> None:
    spec = with_changes(TINY_SPEC, startup={"jitCache": {"pvc": {"claimName": "jit"}}})
    statefulset = _one(_render(spec), "StatefulSet", "llm-unified")
    volumes = {v["name"]: v for v in statefulset["spec"]["template"]["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["jit-cache"]["persistentVolumeClaim"]["claimName"] == "jit"
    container = _container(statefulset)
    env = {e["name"]: e.get("value") for e in container["env"]}
    mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "jit-cache")
    for variable in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "DG_JIT_CACHE_DIR"):
        assert env[variable].startswith(mount + "/")
    assert {m["mountPath"] for m in container["volumeMounts"]} >= {"/dev/shm", mount}
    # The non-root runtime user can write the cache volume.
    assert statefulset["spec"]["template"]["spec"]["securityContext"]["fsGroup"] == 65532


BUDGET_CASES = [
    # (name, spec changes, expected budget seconds)
    # 671e9 bytes / (1000 MiB/s) = 640 s load; 900 s cold FP8 JIT; 60 s base.
    ("fp8 671B cold", {}, 1600),
    ("fp8 671B persistent cache", {"startup": {"jitCache": {"pvc": {"claimName": "c"}}}}, 60 + 640 + 240),
    ("fp8 faster storage", {"startup": {"readBandwidthMiBps": 4000}}, 60 + 160 + 900),
    ("bf16 doubles the bytes", {"model__precision": "bf16"}, 60 + 1280 + 300),
    # 100 GiB at 1000 MiB/s is 102.4 s -> 103 s; 1063 s rounds up to whole 10 s probe periods.
    ("size in GiB", {"model__parametersBillions": None, "model__weightsGiB": 100}, 1070),
    ("override", {"startup": {"budgetSeconds": 3601}}, 3610),
]


@pytest.mark.parametrize(("name", "changes", "seconds"), BUDGET_CASES, ids=[c[0] for c in BUDGET_CASES])
def test_startup_budget(name: str, changes: dict[str, Any], seconds: int) -> None:
    spec = LLMDeploymentSpec.model_validate(with_changes(DEEPSEEK_SPEC, **changes))
    budget = startup_budget(spec)
    assert budget.seconds == seconds
    assert budget.overridden == ("startup" in changes and "budgetSeconds" in changes["startup"])
    probe = _container(_one(render(REF, spec), "StatefulSet", "llm-decode"))["startupProbe"]
    assert probe["httpGet"]["path"] == "/health/startup"
    assert probe["periodSeconds"] <= 10
    assert probe["periodSeconds"] * probe["failureThreshold"] == seconds


def test_fp8_jit_allowance_is_at_least_ten_minutes_cold_and_less_warm() -> None:
    cold = startup_budget(LLMDeploymentSpec.model_validate(DEEPSEEK_SPEC))
    warm = startup_budget(
        LLMDeploymentSpec.model_validate(
            with_changes(DEEPSEEK_SPEC, startup={"jitCache": {"pvc": {"claimName": "c"}}})
        )
    )
    assert cold.jit_seconds >= 600 and warm.jit_seconds < cold.jit_seconds


def test_liveness_readiness_and_graceful_termination() -> None:
    spec = with_changes(TINY_SPEC, runtime={"drainTimeoutSeconds": 200})
    statefulset = _one(_render(spec), "StatefulSet", "llm-unified")
    container = _container(statefulset)
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert "/drain" in command[2] and command[-1] == "200"
    # The runtime's own drain (started by the hook's POST /drain) waits as long as the hook does.
    assert _arg(container, "--drain-timeout") == "200"
    assert statefulset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 200


def test_rolling_updates_leave_the_router_a_worker_and_a_router_to_clients() -> None:
    """What a rolling update under load needs of the rendered children (docs/CONTRACTS.md)."""
    spec = with_changes(TINY_SPEC, runtime={"drainTimeoutSeconds": 90})
    rendered = _render(spec)
    statefulset = _one(rendered, "StatefulSet", "llm-unified")
    # One pod at a time (the default partition-free RollingUpdate), the next old pod only after the
    # new one has been Ready long enough for the router's EndpointSlice watch to know it.
    assert statefulset["spec"]["updateStrategy"] == {"type": "RollingUpdate"}
    assert statefulset["spec"]["minReadySeconds"] >= 5
    assert _one(rendered, "PodDisruptionBudget", "llm-unified")["spec"]["maxUnavailable"] == 1
    # The router: surge first, a new pod is Ready only once it knows a worker, and an old one
    # serves on through the endpoint update, then gives streams the workers' drain time.
    router = _one(rendered, "Deployment", "llm-router")
    assert router["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert router["spec"]["minReadySeconds"] >= 1
    pod = router["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    delay, drain = (
        float(_arg(container, "--shutdown-delay") or 0),
        float(_arg(container, "--drain-timeout") or 0),
    )
    assert delay >= 1 and drain == 90
    assert float(_arg(container, "--wait-for-worker") or 0) >= 30  # a one-replica pool restarting
    assert pod["terminationGracePeriodSeconds"] > delay + drain
    for each in (container, _container(statefulset)):
        assert each["terminationMessagePolicy"] == "FallbackToLogsOnError"
    # The router's flags are its CLI's.
    parser = argparse.ArgumentParser()
    add_router_arguments(parser)
    assert validate_router_args(parser.parse_args(container["args"][1:])) is None


def test_every_child_has_labels_and_controller_owner() -> None:
    rendered = _render(DEEPSEEK_SPEC)
    for child in rendered.children:
        labels = child["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "sovereign"
        assert labels["app.kubernetes.io/instance"] == "llm"
        assert labels["app.kubernetes.io/managed-by"] == "sovereign-operator"
        assert labels["app.kubernetes.io/component"] in {"prefill", "decode", "router", "config"}
        assert child["metadata"]["namespace"] == "team-a"
        (owner,) = child["metadata"]["ownerReferences"]
        assert owner == {
            "apiVersion": "sovereign.ai/v1alpha1",
            "kind": "LLMDeployment",
            "name": "llm",
            "uid": "uid-123",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    kinds = sorted({c["kind"] for c in rendered.children})
    assert kinds == sorted(
        {
            "ConfigMap",
            "ServiceAccount",
            "Role",
            "RoleBinding",
            "Service",
            "StatefulSet",
            "PodDisruptionBudget",
            "Deployment",
            "NetworkPolicy",
        }
    )


@pytest.mark.parametrize(
    ("spec", "service_flags"),
    [
        (TINY_SPEC, {"--worker-service": "llm-unified"}),
        (DEEPSEEK_SPEC, {"--prefill-service": "llm-prefill", "--decode-service": "llm-decode"}),
    ],
)
def test_router_discovers_pools_and_serves_port_8000(
    spec: dict[str, Any], service_flags: dict[str, str]
) -> None:
    rendered = _render(spec)
    router = _one(rendered, "Deployment", "llm-router")
    container = router["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][0] == "router"
    assert _arg(container, "--namespace") == "team-a" and _arg(container, "--policy") == "cache-aware"
    for flag, value in service_flags.items():
        assert _arg(container, flag) == value
    assert router["spec"]["template"]["spec"]["serviceAccountName"] == "llm-router"
    service = _one(rendered, "Service", "llm")
    assert service["spec"]["type"] == "ClusterIP" and service["spec"]["ports"][0]["port"] == 8000
    assert rendered.endpoint == "http://llm.team-a.svc:8000/v1"
    role = _one(rendered, "Role", "llm-router")
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]


def test_pool_services_are_headless_and_pdbs_cover_every_pool() -> None:
    rendered = _render(DEEPSEEK_SPEC)
    for pool in ("prefill", "decode"):
        assert _one(rendered, "Service", f"llm-{pool}")["spec"]["clusterIP"] == "None"
        assert _one(rendered, "StatefulSet", f"llm-{pool}")["spec"]["serviceName"] == f"llm-{pool}"
        pdb = _one(rendered, "PodDisruptionBudget", f"llm-{pool}")
        assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == pool
    _one(rendered, "PodDisruptionBudget", "llm-router")


@pytest.mark.parametrize(
    ("decode", "override", "replicas"),
    [
        ({"replicas": 3}, 7, 3),  # fixed replicas ignore the autoscaler
        ({"autoscaling": {"minReplicas": 2, "maxReplicas": 5}}, None, 2),
        ({"autoscaling": {"minReplicas": 2, "maxReplicas": 5}}, 4, 4),
        ({"autoscaling": {"minReplicas": 2, "maxReplicas": 5}}, 9, 5),
        ({"autoscaling": {"minReplicas": 2, "maxReplicas": 5}}, 0, 2),
        ({}, None, 1),
    ],
)
def test_autoscaler_overrides_stay_within_bounds(
    decode: dict[str, Any], override: int | None, replicas: int
) -> None:
    overrides = {} if override is None else {"decode": override}
    rendered = _render(with_changes(DEEPSEEK_SPEC, decode=decode), **overrides)
    assert _one(rendered, "StatefulSet", "llm-decode")["spec"]["replicas"] == replicas


def test_output_is_deterministic_and_settings_changes_roll_pods() -> None:
    first = yamlio.dump_all(_render(DEEPSEEK_SPEC).children)
    assert first == yamlio.dump_all(_render(DEEPSEEK_SPEC).children)
    tcp = _render(with_changes(DEEPSEEK_SPEC, networking__rdma__enabled="false"))
    rdma = _render(DEEPSEEK_SPEC)

    def settings_hash(rendered: Rendered) -> str:
        template = _one(rendered, "StatefulSet", "llm-decode")["spec"]["template"]
        return template["metadata"]["annotations"]["sovereign.ai/settings-hash"]

    assert settings_hash(tcp) != settings_hash(rdma)


def test_extra_args_env_and_scheduling_pass_through() -> None:
    spec = with_changes(
        DEEPSEEK_SPEC,
        runtime__args=["--speculative-algorithm", "mtp"],
        runtime__env=[{"name": "NCCL_DEBUG", "value": "INFO"}],
        prefill={
            "replicas": 1,
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": {"nodeAffinity": {"x": 1}},
        },
    )
    statefulset = _one(_render(spec), "StatefulSet", "llm-prefill")
    container = _container(statefulset)
    assert container["args"][-2:] == ["--speculative-algorithm", "mtp"]
    assert {"name": "NCCL_DEBUG", "value": "INFO"} in container["env"]
    pod = statefulset["spec"]["template"]["spec"]
    assert pod["tolerations"] == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["affinity"] == {"nodeAffinity": {"x": 1}}
    assert PROBE_PERIOD_SECONDS <= 10


def test_router_disaggregation_threshold_is_passed_only_when_disaggregated() -> None:
    spec = with_changes(DEEPSEEK_SPEC, router={"disaggregationThresholdChars": 2048})
    router = _one(_render(spec), "Deployment", "llm-router")["spec"]["template"]["spec"]["containers"][0]
    assert _arg(router, "--disaggregation-threshold") == "2048"
    unified = with_changes(spec, mode="unified", prefill=None)
    router = _one(_render(unified), "Deployment", "llm-router")["spec"]["template"]["spec"]["containers"][0]
    assert "--disaggregation-threshold" not in router["args"]


def test_operator_defaults_fill_only_what_the_spec_leaves_unset() -> None:
    from sovereign_operator.render import OperatorDefaults

    defaults = OperatorDefaults.from_environment(
        {"SOVEREIGN_RUNTIME_IMAGE": "mirror.local/runtime:7", "SOVEREIGN_RDMA_RESOURCE": "rdma/ib"}
    )
    spec = with_changes(DEEPSEEK_SPEC, runtime__image=None, networking__rdma={"enabled": "auto"})
    rendered = render(
        REF, LLMDeploymentSpec.model_validate(spec), ClusterFacts(frozenset({"rdma/ib"})), defaults=defaults
    )
    container = _container(_one(rendered, "StatefulSet", "llm-decode"))
    assert container["image"] == "mirror.local/runtime:7"
    assert container["resources"]["limits"]["rdma/ib"] == 1 and rendered.plan.kv_transport == "rdma"
    explicit = render(REF, LLMDeploymentSpec.model_validate(DEEPSEEK_SPEC), RDMA_NODES, defaults=defaults)
    assert (
        _container(_one(explicit, "StatefulSet", "llm-decode"))["image"]
        == "registry.example/sovereign-runtime:1"
    )
    assert OperatorDefaults.from_environment({}) == OperatorDefaults()


@pytest.mark.parametrize(("spec", "facts"), [(TINY_SPEC, NO_RDMA), (DEEPSEEK_SPEC, RDMA_NODES)])
def test_pods_meet_pod_security_restricted_except_rdma_ipc_lock(
    spec: dict[str, Any], facts: ClusterFacts
) -> None:
    rendered = _render(spec, facts)
    workloads = [c for c in rendered.children if c["kind"] in ("StatefulSet", "Deployment")]
    assert workloads
    for workload in workloads:
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in pod["containers"]:
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False
            assert security["capabilities"]["drop"] == ["ALL"]
            # Locked pages for RDMA registration are the only capability a pod adds back, and only
            # the workers that register KV memory do.
            wants_ipc_lock = workload["kind"] == "StatefulSet" and rendered.plan.kv_transport == "rdma"
            assert security["capabilities"].get("add", []) == (["IPC_LOCK"] if wants_ipc_lock else [])


# ---- security of what we deploy -------------------------------------------------------------------


def _pods(*components: str) -> list[dict[str, Any]]:
    return [
        {
            "podSelector": {
                "matchLabels": {
                    "app.kubernetes.io/component": c,
                    "app.kubernetes.io/instance": "llm",
                    "app.kubernetes.io/name": "sovereign",
                }
            }
        }
        for c in components
    ]


OPERATOR_PEER = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "sovereign-system"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/component": "operator"}},
}


def _ingress(rendered: Rendered, name: str) -> dict[int, list[dict[str, Any]]]:
    """Port -> the peers admitted to it, for one NetworkPolicy."""
    policy = _one(rendered, "NetworkPolicy", name)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    admitted: dict[int, list[dict[str, Any]]] = {}
    for rule in policy["spec"]["ingress"]:
        for port in rule["ports"]:
            assert port["protocol"] == "TCP"
            admitted.setdefault(port["port"], []).extend(rule["from"])
    return admitted


def test_network_policies_admit_only_the_deployments_own_peers_disaggregated() -> None:
    rendered = _render(DEEPSEEK_SPEC, RDMA_NODES)
    policies = {c["metadata"]["name"]: c for c in rendered.children if c["kind"] == "NetworkPolicy"}
    assert set(policies) == {"llm-prefill", "llm-decode", "llm-router"}
    for name, policy in policies.items():
        component = name.removeprefix("llm-")
        assert policy["spec"]["podSelector"] == _pods(component)[0]["podSelector"]
    # Workers: HTTP from the router and the operator's scrapes; prefill also from decode (remote
    # prefill); the KV port only from the deployment's own prefill/decode pods.
    assert _ingress(rendered, "llm-prefill") == {8000: [*_pods("router"), OPERATOR_PEER, *_pods("decode")]}
    assert _ingress(rendered, "llm-decode") == {
        8000: [*_pods("router"), OPERATOR_PEER],
        8001: _pods("prefill", "decode"),
    }
    # The router: any pod of the namespace by default.
    assert _ingress(rendered, "llm-router") == {8000: [{"podSelector": {}}, OPERATOR_PEER]}


def test_network_policies_unified_narrowed_widened_or_off() -> None:
    rendered = _render(TINY_SPEC)
    assert _ingress(rendered, "llm-unified") == {8000: [*_pods("router"), OPERATOR_PEER]}
    clients = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress"}}}]
    prometheus = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    narrowed = _render(
        with_changes(
            TINY_SPEC, networking={"networkPolicy": {"routerFrom": clients, "metricsFrom": prometheus}}
        )
    )
    assert _ingress(narrowed, "llm-router") == {8000: [*clients, OPERATOR_PEER, *prometheus]}
    assert _ingress(narrowed, "llm-unified") == {8000: [*_pods("router"), OPERATOR_PEER, *prometheus]}
    off = _render(with_changes(TINY_SPEC, networking={"networkPolicy": {"enabled": False}}))
    assert not [c for c in off.children if c["kind"] == "NetworkPolicy"]


def test_the_operator_namespace_of_the_installation_is_admitted() -> None:
    defaults = OperatorDefaults.from_environment({"SOVEREIGN_OPERATOR_NAMESPACE": "ops"})
    rendered = render(
        DeploymentRef("llm", "team-a", "uid-123"),
        LLMDeploymentSpec.model_validate(TINY_SPEC),
        NO_RDMA,
        defaults=defaults,
    )
    (peer,) = [p for p in _ingress(rendered, "llm-unified")[8000] if "namespaceSelector" in p]
    assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "ops"}}


@pytest.mark.parametrize(("spec", "facts"), [(TINY_SPEC, NO_RDMA), (DEEPSEEK_SPEC, RDMA_NODES)])
def test_workers_run_read_only_as_an_explicit_user_with_writable_scratch(
    spec: dict[str, Any], facts: ClusterFacts
) -> None:
    rendered = _render(spec, facts)
    for workload in (c for c in rendered.children if c["kind"] in ("StatefulSet", "Deployment")):
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsUser"] == 65532 and pod["securityContext"]["runAsGroup"] == 65532
        (container,) = pod["containers"]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        if workload["kind"] == "StatefulSet":
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            volumes = {v["name"]: v for v in pod["volumes"]}
            for path in ("/tmp", "/home/sovereign/.cache", "/var/cache/sovereign/jit", "/dev/shm"):
                assert path in mounts, path
                assert "emptyDir" in volumes[mounts[path]] or "persistentVolumeClaim" in volumes[mounts[path]]


def test_router_has_requests_and_a_memory_limit_that_fits_its_request() -> None:
    router = _one(_render(TINY_SPEC), "Deployment", "llm-router")
    resources = router["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources == {"limits": {"memory": "1Gi"}, "requests": {"cpu": "250m", "memory": "256Mi"}}
    bigger = _render(with_changes(TINY_SPEC, router={"resources": {"requests": {"memory": "4Gi"}}}))
    resources = _one(bigger, "Deployment", "llm-router")["spec"]["template"]["spec"]["containers"][0][
        "resources"
    ]
    assert resources == {"limits": {"memory": "4Gi"}, "requests": {"cpu": "250m", "memory": "4Gi"}}


def test_decode_speculative_renders_the_flags_on_decode_only() -> None:
    spec = with_changes(DEEPSEEK_SPEC, decode__speculative={"numDraftTokens": 2, "maxBatchSize": 16})
    rendered = _render(spec)
    decode = _container(_one(rendered, "StatefulSet", "llm-decode"))["args"]
    flags = [
        "--speculative-algorithm",
        "mtp",
        "--speculative-num-draft-tokens",
        "2",
        "--speculative-max-batch-size",
        "16",
    ]
    i = decode.index("--speculative-algorithm")
    assert decode[i : i + len(flags)] == flags
    prefill = _container(_one(rendered, "StatefulSet", "llm-prefill"))["args"]
    assert not any(a.startswith("--speculative") for a in prefill)
    # Unified mode: decode configures the one pool.
    unified = _render(with_changes(TINY_SPEC, decode={"replicas": 1, "speculative": {}}))
    sts = next(c for c in unified.children if c["kind"] == "StatefulSet")
    args = _container(sts)["args"]
    i = args.index("--speculative-algorithm")
    assert args[i : i + 4] == ["--speculative-algorithm", "mtp", "--speculative-num-draft-tokens", "1"]


def test_chat_template_is_a_config_map_the_workers_mount_and_read() -> None:
    from sovereign_operator.render.children import SETTINGS_HASH_ANNOTATION
    from sovereign_runtime.program import build_parser

    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    plain = _render(DEEPSEEK_SPEC)
    rendered = _render(with_changes(DEEPSEEK_SPEC, runtime__chatTemplate=template))
    assert _one(rendered, "ConfigMap", "llm-chat-template")["data"] == {"chat_template.jinja": template}
    for name in ("llm-prefill", "llm-decode"):
        sts = _one(rendered, "StatefulSet", name)
        container = _container(sts)
        assert _arg(container, "--chat-template") == "/etc/sovereign/chat-template/chat_template.jinja"
        mount = {"name": "chat-template", "mountPath": "/etc/sovereign/chat-template", "readOnly": True}
        assert mount in container["volumeMounts"]
        volume = {"name": "chat-template", "configMap": {"name": "llm-chat-template"}}
        assert volume in sts["spec"]["template"]["spec"]["volumes"]
        # The runtime's own parser takes the rendered flags.
        parsed = build_parser().parse_args(container["args"])
        assert str(parsed.chat_template) == "/etc/sovereign/chat-template/chat_template.jinja"
    # Without it: no ConfigMap, no flag, no volume.
    assert not [c for c in plain.children if c["metadata"]["name"] == "llm-chat-template"]
    decode = _one(plain, "StatefulSet", "llm-decode")
    assert "--chat-template" not in _container(decode)["args"]
    assert all(v["name"] != "chat-template" for v in decode["spec"]["template"]["spec"]["volumes"])

    # The pods roll when the template changes: they read it once, at start.
    def settings(r: Rendered) -> str:
        annotations = _one(r, "StatefulSet", "llm-decode")["spec"]["template"]["metadata"]["annotations"]
        return str(annotations[SETTINGS_HASH_ANNOTATION])

    edited = _render(with_changes(DEEPSEEK_SPEC, runtime__chatTemplate=template + "\n"))
    assert len({settings(plain), settings(rendered), settings(edited)}) == 3


def test_a_multi_node_pool_mounts_the_chat_template_too() -> None:
    spec = with_changes(DEEPSEEK_SPEC, decode__nodesPerReplica=2, runtime__chatTemplate="{{ messages }}")
    rendered = _render(spec)
    groups = [c for c in rendered.children if c["kind"] == "LeaderWorkerSet"]
    assert groups
    for lws in groups:
        leader = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
        assert "--chat-template" in leader["spec"]["containers"][0]["args"]
        assert any(v["name"] == "chat-template" for v in leader["spec"]["volumes"])
