"""The Helm chart: lint, render, validate against Kubernetes and CRD schemas, and its contracts.

Tests that only read files (values schema, dashboard, CRD copy) run everywhere; those that
render need helm and kubeconform (built by `make test` into e2e/cluster/bin).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from packaging_helpers import (
    CHART,
    REPO,
    SCHEMA_LOCATION,
    kube_version,
    load_docs,
    write_builtin_schemas,
    write_crd_schemas,
)

RBAC_RULES = CHART / "files" / "operator-rbac-rules.yaml"
ALL_ON = [
    "metrics.serviceMonitor.enabled=true",
    "grafanaDashboard.enabled=true",
    "argocd.healthCheck.enabled=true",
    "rdma.sharedDevicePlugin.enabled=true",
    "admissionPolicy.forbidHostPath=true",
]
# Kinds with no schema offline: the Prometheus Operator's CRDs are not in this repository.
NO_OFFLINE_SCHEMA = {"ServiceMonitor"}


def values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def values_schema() -> dict:
    return json.loads((CHART / "values.schema.json").read_text())


def render(helm: str, *sets: str, include_crds: bool = False, check: bool = True):
    cmd = [helm, "template", "rel", str(CHART), "--namespace", "sov", "--kube-version", kube_version()]
    if include_crds:
        cmd.append("--include-crds")
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if check:
        assert proc.returncode == 0, proc.stderr
        return load_docs(proc.stdout)
    return proc


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str, name_suffix: str = "") -> dict:
    found = [d for d in by_kind(docs, kind) if d["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind} ending in {name_suffix!r}, got {len(found)}"
    return found[0]


# ---------------------------------------------------------------- files only


def test_values_yaml_satisfies_its_schema():
    jsonschema.Draft7Validator.check_schema(values_schema())
    jsonschema.validate(values(), values_schema())


@pytest.mark.parametrize(
    "path,bad",
    [
        (("replicaCount",), 9),
        (("leaderElection", "leaseDurationSeconds"), 0),
        (("image", "pullPolicy"), "Sometimes"),
        (("health", "port"), 70000),
        (("metrics", "serviceMonitor", "interval"), "soon"),
        (("rdma", "resourceName"), "rdma_shared_device_a"),
        (("operator", "watchNamespaces"), ["Not_A_Namespace"]),
        (("image", "tagg"), "typo"),
    ],
)
def test_values_schema_rejects_bad_value(path: tuple[str, ...], bad: Any):
    doc = values()
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = bad
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, values_schema())


def _undocumented(value: Any, schema: dict, path: str = "") -> list[str]:
    """Paths in values.yaml the schema does not describe; free-form objects are described whole."""
    missing = []
    if path and "description" not in schema:
        missing.append(path)
    if isinstance(value, dict) and "properties" in schema:
        for key, child in value.items():
            sub = schema["properties"].get(key)
            if sub is None:
                missing.append(f"{path}.{key}".lstrip("."))
            else:
                missing += _undocumented(child, sub, f"{path}.{key}".lstrip("."))
    return missing


def test_every_value_is_documented_in_the_schema():
    assert _undocumented(values(), values_schema()) == []


def test_chart_crds_equal_generated_crds():
    generated = sorted(p.name for p in (REPO / "crds").glob("*.yaml"))
    shipped = sorted(p.name for p in (CHART / "crds").glob("*.yaml"))
    assert generated, "crds/ holds no CRD"
    assert shipped == generated
    for name in generated:
        assert (CHART / "crds" / name).read_bytes() == (REPO / "crds" / name).read_bytes(), (
            f"charts/sovereign/crds/{name} differs from crds/{name}: run `make crd` and copy it "
            "(cp crds/*.yaml charts/sovereign/crds/)"
        )
        assert not (CHART / "crds" / name).is_symlink()


def test_rdma_default_is_the_operators_default():
    from sovereign_operator.api.spec import DEFAULT_RDMA_RESOURCE

    assert values()["rdma"]["resourceName"] == DEFAULT_RDMA_RESOURCE


def test_runtime_image_default_is_the_operators_default():
    from sovereign_operator.api.spec import DEFAULT_RUNTIME_IMAGE

    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    image = values()["runtimeImage"]
    assert f"{image['repository']}:{image['tag'] or chart['appVersion']}" == DEFAULT_RUNTIME_IMAGE


CONTRACT_CELL = re.compile(r"^\| (`(?:vllm|sovereign):[a-z0-9_]+`(?:, `[a-z0-9_:]+`)*) \|", re.MULTILINE)
# vLLM's older aliases carry the same value as a newer name the dashboard already plots.
ALIASES = {"vllm:gpu_cache_usage_perc", "vllm:time_per_output_token_seconds"}


def test_grafana_dashboard_plots_the_contract_metrics():
    dashboard = json.loads((CHART / "files" / "grafana-dashboard.json").read_text())
    exprs = " ".join(
        t["expr"] for p in dashboard["panels"] if p["type"] != "row" for t in p.get("targets", [])
    )
    used = {
        re.sub(r"_(bucket|sum|count)$", "", m) for m in re.findall(r"(?:vllm|sovereign):[a-z0-9_]+", exprs)
    }
    # A row may name several metrics in its first cell (`a`, `b`).
    cells = CONTRACT_CELL.findall((REPO / "docs" / "CONTRACTS.md").read_text())
    contract = {name for cell in cells for name in re.findall(r"`((?:vllm|sovereign):[a-z0-9_]+)`", cell)}
    assert contract, "no metric table found in docs/CONTRACTS.md"
    assert used <= contract, f"dashboard uses metrics the runtime does not export: {used - contract}"
    assert contract - ALIASES <= used, f"contract metrics missing from the dashboard: {contract - used}"
    # Operator and autoscaler series must be ones the operator's code registers.
    source = " ".join(p.read_text() for p in (REPO / "operator" / "sovereign_operator").rglob("*.py"))
    registered = {
        re.sub(r"_total$", "", n)
        for n in re.findall(r'"(sovereign_(?:operator|autoscaler)_[a-z0-9_]+)"', source)
    }
    operator_used = {
        re.sub(r"_(total|bucket|sum|count)$", "", m)
        for m in re.findall(r"sovereign_(?:operator|autoscaler)_[a-z0-9_]+", exprs)
    }
    assert operator_used, "the dashboard plots no operator metrics"
    assert operator_used <= registered, f"not registered by the operator: {operator_used - registered}"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for p in dashboard["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]


# ---------------------------------------------------------------- rendering


@pytest.fixture(scope="module")
def default_docs(helm: str) -> list[dict]:
    return render(helm)


@pytest.fixture(scope="module")
def all_on_docs(helm: str) -> list[dict]:
    return render(helm, *ALL_ON)


@pytest.mark.parametrize("sets", [[], ALL_ON], ids=["defaults", "all-optional-on"])
def test_helm_lint(helm: str, sets: list[str]):
    cmd = [helm, "lint", str(CHART), "--strict", "--kube-version", kube_version()]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_template_validates_with_kubeconform(helm: str, kubeconform: str, swagger: dict, tmp_path: Path):
    proc = render(helm, *ALL_ON, include_crds=True, check=False)
    assert proc.returncode == 0, proc.stderr
    docs = load_docs(proc.stdout)
    examples = [
        d
        for p in [*sorted((REPO / "examples").glob("*.yaml")), REPO / "e2e" / "kind" / "gpu-tiny.yaml"]
        for d in load_docs(p.read_text())
        if d.get("kind") == "LLMDeployment"
    ]
    kinds = {(d["apiVersion"], d["kind"]) for d in docs}
    schemas = tmp_path / "schemas"
    schemas.mkdir()
    written = write_builtin_schemas(swagger, kinds, schemas)
    written |= write_crd_schemas(
        [d for d in load_docs((REPO / "crds").joinpath("sovereign.ai_llmdeployments.yaml").read_text())],
        schemas,
    )
    missing = {k for _, k in kinds - written}
    assert missing <= NO_OFFLINE_SCHEMA, f"no offline schema for {missing}"
    manifests = tmp_path / "manifests.yaml"
    manifests.write_text(yaml.safe_dump_all(docs + examples, sort_keys=False))
    cmd = [
        kubeconform,
        "-strict",
        "-summary",
        "-kubernetes-version",
        kube_version().lstrip("v"),
        "-schema-location",
        str(schemas / SCHEMA_LOCATION),
    ]
    if missing:
        cmd += ["-skip", ",".join(sorted(missing))]
    result = subprocess.run([*cmd, str(manifests)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"Valid: {len(docs) + len(examples) - len([d for d in docs if d['kind'] in missing])}" in (
        result.stdout
    ), result.stdout


def test_kubeconform_catches_a_broken_manifest(kubeconform: str, swagger: dict, tmp_path: Path):
    # The strict schemas must reject a misspelt field: otherwise the test above proves nothing.
    write_builtin_schemas(swagger, {("apps/v1", "Deployment")}, tmp_path)
    bad = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "x"},
        "spec": {
            "selector": {"matchLabels": {"a": "b"}},
            "template": {
                "metadata": {"labels": {"a": "b"}},
                "spec": {"containers": [{"name": "c", "image": "i", "imagePullPolicyy": "Always"}]},
            },
        },
    }
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    cmd = [kubeconform, "-strict", "-schema-location", str(tmp_path / SCHEMA_LOCATION), str(path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "imagePullPolicyy" in result.stdout + result.stderr


def test_helm_rejects_a_bad_value(helm: str):
    proc = render(helm, "replicaCount=3", "leaderElection.enabled=false", check=False)
    assert proc.returncode != 0
    assert "replicaCount > 1 needs leaderElection.enabled" in proc.stderr
    proc = render(helm, "rdma.sharedDevicePlugin.enabled=true", "rdma.resourceName=nodomain", check=False)
    assert proc.returncode != 0
    assert "resourceName" in proc.stderr


def test_optional_components_are_off_by_default(default_docs: list[dict]):
    kinds = sorted(d["kind"] for d in default_docs)
    assert kinds == [
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
        "Role",
        "RoleBinding",
        "Service",
        "ServiceAccount",
    ]


def test_forbid_host_path_renders_a_policy_and_its_binding(all_on_docs: list[dict]):
    policy = one(all_on_docs, "ValidatingAdmissionPolicy")
    binding = one(all_on_docs, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule["apiGroups"] == ["sovereign.ai"] and rule["resources"] == ["llmdeployments"]
    assert "object.spec.model.source.hostPath" in policy["spec"]["validations"][0]["expression"]


def test_operator_deployment_is_locked_down(default_docs: list[dict]):
    deployment = one(default_docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert "add" not in sc["capabilities"]
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    port = values()["health"]["port"]
    assert container["ports"] == [{"name": "http-metrics", "containerPort": port, "protocol": "TCP"}]
    for probe, path in (("livenessProbe", "livenessPath"), ("readinessProbe", "readinessPath")):
        assert container[probe]["httpGet"] == {"path": values()["health"][path], "port": "http-metrics"}
    assert pod["serviceAccountName"] == one(default_docs, "ServiceAccount")["metadata"]["name"]
    # Two replicas on the leader-election Lease: a rolling update never has two acting at once.
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    assert "--leader-elect" in container["args"]
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in container["env"]}
    assert env["POD_NAME"] == "metadata.name" and env["SOVEREIGN_OPERATOR_NAMESPACE"] == "metadata.namespace"
    anti = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"


def test_leader_election_role_grants_only_the_lease_in_the_release_namespace(default_docs: list[dict]):
    role = one(default_docs, "Role", "-leader-election")
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "update"]}
    ]
    binding = one(default_docs, "RoleBinding", "-leader-election")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["metadata"]["namespace"] == role["metadata"]["namespace"]


def test_a_single_operator_without_leader_election_keeps_recreate(helm: str):
    docs = render(helm, "replicaCount=1", "leaderElection.enabled=false")
    deployment = one(docs, "Deployment")
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    assert "--leader-elect" not in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not by_kind(docs, "Role")


def test_operator_args_parse_with_the_operator_cli(helm: str):
    from sovereign_operator.cli import build_parser

    docs = render(
        helm, "operator.watchNamespaces={llm,team-b}", "operator.logLevel=debug", "health.port=9090"
    )
    (container,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    # The image's entrypoint is `sovereign-operator run`; the chart's args follow `run`.
    parsed = build_parser().parse_args(["run", *container["args"]])
    assert parsed.health_port == 9090 == container["ports"][0]["containerPort"]
    assert parsed.namespace == ["llm", "team-b"]
    assert parsed.verbose is True
    defaults = build_parser().parse_args(
        ["run", *one(render(helm), "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]]
    )
    assert defaults.namespace in (None, []) and defaults.verbose is False


def test_operator_health_endpoints_match_the_operator():
    from sovereign_operator import metrics

    paths = {route.resource.canonical for route in metrics.build_app().router.routes()}
    assert {
        values()["health"]["livenessPath"],
        values()["health"]["readinessPath"],
        values()["metrics"]["path"],
    } <= paths


def test_metrics_service_selects_the_operator(default_docs: list[dict]):
    service = one(default_docs, "Service", "-metrics")
    labels = one(default_docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "http-metrics"


def test_service_monitor_scrapes_the_metrics_service(all_on_docs: list[dict]):
    monitor = one(all_on_docs, "ServiceMonitor")
    service = one(all_on_docs, "Service", "-metrics")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == service["spec"]["ports"][0]["name"]
    assert endpoint["path"] == values()["metrics"]["path"]


def test_cluster_role_rules_equal_the_rules_file(default_docs: list[dict]):
    rules = yaml.safe_load(RBAC_RULES.read_text())
    rules = rules["rules"] if isinstance(rules, dict) else rules
    assert one(default_docs, "ClusterRole")["rules"] == rules
    binding = one(default_docs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == one(default_docs, "ClusterRole")["metadata"]["name"]
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": one(default_docs, "ServiceAccount")["metadata"]["name"],
            "namespace": "sov",
        }
    ]


def test_watched_namespaces_bind_the_rules_there_only(helm: str):
    docs = render(helm, "operator.watchNamespaces={team-a,team-b}")
    rules = yaml.safe_load(RBAC_RULES.read_text())
    rules = rules["rules"] if isinstance(rules, dict) else rules
    main = one(docs, "ClusterRole", "rel-sovereign")
    assert main["rules"] == rules
    # No cluster-wide binding of the main rules: one RoleBinding per watched namespace.
    bindings = [b for b in by_kind(docs, "RoleBinding") if b["roleRef"]["name"] == main["metadata"]["name"]]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    assert all(b["roleRef"]["kind"] == "ClusterRole" for b in bindings)
    (cluster_binding,) = by_kind(docs, "ClusterRoleBinding")
    cluster_role = one(docs, "ClusterRole", "-cluster")
    assert cluster_binding["roleRef"]["name"] == cluster_role["metadata"]["name"]
    # Cluster-wide only what has no namespace, and only reads.
    assert {r for rule in cluster_role["rules"] for r in rule["resources"]} == {
        "nodes",
        "namespaces",
        "customresourcedefinitions",
    }
    assert {v for rule in cluster_role["rules"] for v in rule["verbs"]} <= {"get", "list", "watch"}
    for rule in cluster_role["rules"]:
        (resource,) = rule["resources"]
        assert any(
            resource in r["resources"] and r["verbs"] == rule["verbs"] and r["apiGroups"] == rule["apiGroups"]
            for r in rules
        )


def test_operator_runs_from_its_image_with_the_pull_policy_a_value_sets(helm: str, default_docs: list[dict]):
    (container,) = one(default_docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert container["image"] == f"ghcr.io/sovereign-ai/sovereign-operator:{version}"
    assert container["imagePullPolicy"] == "IfNotPresent" == values()["image"]["pullPolicy"]
    (never,) = one(render(helm, "image.pullPolicy=Never"), "Deployment")["spec"]["template"]["spec"][
        "containers"
    ]
    assert never["imagePullPolicy"] == "Never"


def _operator_env(docs: list[dict]) -> dict[str, Any]:
    (container,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value") for e in container["env"]}


@pytest.mark.parametrize("resource", [None, "example.com/hca_kv"])
def test_rdma_resource_is_one_value(helm: str, resource: str | None):
    sets = ["rdma.sharedDevicePlugin.enabled=true"]
    if resource:
        sets.append(f"rdma.resourceName={resource}")
    docs = render(helm, *sets)
    expected = resource or values()["rdma"]["resourceName"]
    config = json.loads(one(docs, "ConfigMap", "-rdma-devices")["data"]["config.json"])
    (entry,) = config["configList"]
    assert f"{entry['resourcePrefix']}/{entry['resourceName']}" == expected
    assert _operator_env(docs)["SOVEREIGN_RDMA_RESOURCE"] == expected
    # The operator reads its defaults from exactly that environment.
    from sovereign_operator.render.plan import OperatorDefaults

    defaults = OperatorDefaults.from_environment(
        {k: v for k, v in _operator_env(docs).items() if v is not None}
    )
    assert defaults.rdma_resource == expected
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert defaults.runtime_image == f"{values()['runtimeImage']['repository']}:{app_version}"
    daemonset = one(docs, "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == values()["rdma"]["sharedDevicePlugin"]["nodeSelector"]
    assert any(t["key"] == "nvidia.com/gpu" and t["operator"] == "Exists" for t in pod["tolerations"])
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert (
        volumes["config"]["configMap"]["name"] == one(docs, "ConfigMap", "-rdma-devices")["metadata"]["name"]
    )
    # The plugin reads its config from a fixed path and registers through the kubelet's socket dir.
    (container,) = pod["containers"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts["/k8s-rdma-shared-dev-plugin"]]["configMap"]["items"] == [
        {"key": "config.json", "path": "config.json"}
    ]
    plugin_dir = "/var/lib/kubelet/device-plugins"
    assert volumes[mounts[plugin_dir]]["hostPath"]["path"] == plugin_dir
    assert "args" not in container


def test_argocd_snippet_carries_the_health_check(all_on_docs: list[dict]):
    lua = (CHART / "files" / "argocd-health.lua").read_text()
    key = "resource.customizations.health.sovereign.ai_LLMDeployment"
    data = one(all_on_docs, "ConfigMap", "-argocd-health")["data"]
    assert data[key] == lua
    assert yaml.safe_load(data["argocd-cm-patch.yaml"]) == {"data": {key: lua}}


def test_grafana_dashboard_configmap(helm: str):
    docs = render(helm, "grafanaDashboard.enabled=true", "grafanaDashboard.namespace=monitoring")
    cm = one(docs, "ConfigMap", "-dashboard")
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((CHART / "files" / "grafana-dashboard.json").read_text())
    assert json.loads(cm["data"]["sovereign.json"]) == shipped


def test_chart_packages(helm: str, tmp_path: Path):
    # `helm package` is what a release publishes: the CRDs and files must be inside the archive.
    proc = subprocess.run(
        [helm, "package", str(CHART), "-d", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    (archive,) = tmp_path.glob("sovereign-*.tgz")
    listing = subprocess.run(["tar", "-tzf", str(archive)], capture_output=True, text=True, check=True).stdout
    for member in ("crds/sovereign.ai_llmdeployments.yaml", "files/argocd-health.lua", "values.schema.json"):
        assert f"sovereign/{member}" in listing


def test_kubeconform_rejects_a_bad_llmdeployment(kubeconform: str, tmp_path: Path):
    # The CRD-derived schema is strict too: a misspelt field or a bad enum in a user's manifest fails.
    write_crd_schemas(load_docs((REPO / "crds" / "sovereign.ai_llmdeployments.yaml").read_text()), tmp_path)
    doc = yaml.safe_load((REPO / "examples" / "tiny.yaml").read_text())
    doc["spec"]["decode"]["replicaz"] = 1
    doc["spec"]["mode"] = "sideways"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    cmd = [kubeconform, "-strict", "-schema-location", str(tmp_path / SCHEMA_LOCATION), str(path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "replicaz" in result.stdout and "/spec/mode" in result.stdout
