"""The API models, the generated CRD, and the CEL rules agreeing with pydantic."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import pytest
from operator_specs import DEEPSEEK_SPEC, TINY_SPEC, with_changes
from pydantic import ValidationError
from sovereign_operator import yamlio
from sovereign_operator.api import LLMDeploymentSpec, custom_resource_definition

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "sovereign.ai_llmdeployments.yaml"


def _schema() -> dict[str, Any]:
    return custom_resource_definition()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_committed_crd_matches_the_models() -> None:
    generated = yamlio.dump(custom_resource_definition())
    assert CRD_FILE.read_text() == generated, "CRD drifted: run `make crd` and commit the result"


def test_crd_names_and_subresources() -> None:
    crd = custom_resource_definition()
    assert crd["metadata"]["name"] == "llmdeployments.sovereign.ai"
    names = crd["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == (
        "LLMDeployment",
        "llmdeployments",
        ["llmd"],
    )
    assert crd["spec"]["scope"] == "Namespaced"
    version = crd["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns[:4] == ["Mode", "Prefill", "Decode", "Ready"] and columns[-1] == "Age"


def _walk(node: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
    found = [(path, node)]
    for name, child in node.get("properties", {}).items():
        found += _walk(child, f"{path}.{name}")
    if "items" in node:
        found += _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        found += _walk(node["additionalProperties"], f"{path}{{}}")
    return found


def test_schema_is_structural() -> None:
    for path, node in _walk(_schema(), ""):
        assert "$ref" not in node and "anyOf" not in node and "title" not in node, path
        escape = node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields")
        assert "type" in node or escape, f"{path} has no type"
        assert not ("properties" in node and "additionalProperties" in node), path


def test_every_field_has_a_description_for_kubectl_explain() -> None:
    # Fields, not the element schemas of lists and maps (kubectl explain shows the field's text);
    # metadata is the apiserver's ObjectMeta, which a CRD may not describe.
    fields = [
        (path, node)
        for path, node in _walk(_schema(), "")
        if path not in ("", ".metadata") and not path.endswith(("[]", "{}"))
    ]
    undescribed = [path for path, node in fields if not str(node.get("description", "")).strip()]
    assert not undescribed, f"add a description (Field(description=...)) to: {', '.join(undescribed)}"
    assert len(fields) > 150  # every field of spec and status, nested ones included


def test_schema_carries_enums_minimums_and_required() -> None:
    spec = _schema()["properties"]["spec"]
    assert spec["required"] == ["model"]
    assert spec["properties"]["mode"]["enum"] == ["unified", "disaggregated", "auto"]
    runtime = spec["properties"]["runtime"]["properties"]
    assert runtime["tensorParallelSize"]["minimum"] == 1
    rdma = spec["properties"]["networking"]["properties"]["rdma"]["properties"]
    # Filled by the operator from its installation's settings, so the apiserver stores none.
    assert "default" not in rdma["resourceName"] and "default" not in runtime["image"]
    assert rdma["count"]["default"] == 1
    assert rdma["enabled"]["enum"] == ["auto", "true", "false"]


# ---- CEL rules vs pydantic -------------------------------------------------------------------


def _apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """What the apiserver does before CEL runs: fill scalar defaults of present objects."""
    if isinstance(value, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = _apply_defaults(sub, value[name])
    elif isinstance(value, list) and "items" in schema:
        return [_apply_defaults(schema["items"], item) for item in value]
    return value


def _cel_violations(schema: dict[str, Any], value: Any, env: celpy.Environment) -> list[str]:
    messages = []
    for rule in schema.get("x-kubernetes-validations", []):
        program = env.program(env.compile(rule["rule"]))
        if not bool(program.evaluate({"self": celpy.json_to_cel(value)})):
            messages.append(rule["message"])
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                messages += _cel_violations(sub, value[name], env)
        if isinstance(schema.get("additionalProperties"), dict):
            for item in value.values():
                messages += _cel_violations(schema["additionalProperties"], item, env)
    if isinstance(value, list) and "items" in schema:
        for item in value:
            messages += _cel_violations(schema["items"], item, env)
    return messages


CASES: list[tuple[str, dict[str, Any], str | None]] = [
    ("tiny", TINY_SPEC, None),
    ("deepseek", DEEPSEEK_SPEC, None),
    ("auto without pools", with_changes(TINY_SPEC, mode="auto", decode=None), None),
    ("two sources", with_changes(TINY_SPEC, model__source__hostPath={"path": "/w"}), "exactly one of pvc"),
    ("no source", with_changes(TINY_SPEC, model__source={}), "exactly one of pvc"),
    ("no size", with_changes(DEEPSEEK_SPEC, model__parametersBillions=None), "parametersBillions"),
    ("size in GiB", with_changes(DEEPSEEK_SPEC, model__parametersBillions=None, model__weightsGiB=642), None),
    (
        "disaggregated no prefill",
        with_changes(DEEPSEEK_SPEC, prefill=None),
        "both the prefill and the decode",
    ),
    ("unified with prefill", with_changes(TINY_SPEC, prefill={"replicas": 1}), "remove prefill"),
    (
        "replicas and autoscaling",
        with_changes(DEEPSEEK_SPEC, decode={"replicas": 2, "autoscaling": {"maxReplicas": 3}}),
        "either replicas or autoscaling",
    ),
    (
        "min above max",
        with_changes(DEEPSEEK_SPEC, decode={"autoscaling": {"minReplicas": 5, "maxReplicas": 3}}),
        "minReplicas must be less than or equal to maxReplicas",
    ),
    ("rdma count 0", with_changes(DEEPSEEK_SPEC, networking__rdma__count=0), "count must be at least 1"),
    (
        "rdma off count 0",
        with_changes(DEEPSEEK_SPEC, networking__rdma={"enabled": "false", "count": 0}),
        None,
    ),
    (
        "builtin with tp 2",
        with_changes(TINY_SPEC, runtime={"tensorParallelSize": 2}),
        "tensorParallelSize must be 1",
    ),
    ("jit cache both", with_changes(TINY_SPEC, startup={"jitCache": {}}), "exactly one of pvc or emptyDir"),
    ("jit cache pvc", with_changes(TINY_SPEC, startup={"jitCache": {"pvc": {"claimName": "jit"}}}), None),
    (
        "prometheus without url",
        with_changes(TINY_SPEC, autoscaling={"metrics": {"source": "prometheus"}}),
        "prometheusUrl is required",
    ),
    (
        "ratio inverted",
        with_changes(TINY_SPEC, autoscaling={"prefillDecodeRatio": {"min": 2, "max": 1}}),
        "min must be less than or equal to max",
    ),
    (
        "restart on output failure",
        with_changes(TINY_SPEC, remediation={"restartOnOutputFailure": True, "restartBackoffSeconds": 30}),
        None,
    ),
    (
        "restart backoff above its cap",
        with_changes(TINY_SPEC, remediation={"restartBackoffSeconds": 600, "maxRestartBackoffSeconds": 300}),
        "restartBackoffSeconds must be less than or equal to maxRestartBackoffSeconds",
    ),
    (
        "negative cpu",
        with_changes(TINY_SPEC, runtime={"resources": {"requests": {"cpu": -4}}}),
        "non-negative Kubernetes quantity",
    ),
    (
        "memory with a shell command",
        with_changes(TINY_SPEC, runtime={"resources": {"limits": {"memory": "2Gi; rm -rf"}}}),
        "non-negative Kubernetes quantity",
    ),
    (
        "negative quantity string",
        with_changes(DEEPSEEK_SPEC, decode={"replicas": 1, "resources": {"requests": {"memory": "-1Gi"}}}),
        "non-negative Kubernetes quantity",
    ),
    (
        "emptyDir size not a quantity",
        with_changes(TINY_SPEC, startup={"jitCache": {"emptyDir": {"sizeLimit": "lots"}}}),
        "non-negative Kubernetes quantity",
    ),
    (
        "valid quantities",
        with_changes(
            TINY_SPEC,
            runtime={"resources": {"requests": {"cpu": "1.5", "memory": "16Gi"}, "limits": {"cpu": 4}}},
            router={"resources": {"requests": {"cpu": "500m", "memory": "1e9"}}},
        ),
        None,
    ),
    (
        "pvc path climbing out",
        with_changes(DEEPSEEK_SPEC, model__source={"pvc": {"claimName": "w", "path": "../../../etc"}}),
        "no '..' segments",
    ),
    (
        "image path climbing out",
        with_changes(DEEPSEEK_SPEC, model__source={"image": {"reference": "r/w:1", "path": "a/../../b"}}),
        "no '..' segments",
    ),
    (
        "speculative decode",
        with_changes(DEEPSEEK_SPEC, decode__speculative={"algorithm": "mtp", "numDraftTokens": 2}),
        None,
    ),
    (
        "speculative on prefill",
        with_changes(DEEPSEEK_SPEC, prefill__speculative={"numDraftTokens": 1}),
        "not on prefill",
    ),
    (
        "speculative flags twice",
        with_changes(
            DEEPSEEK_SPEC, decode__speculative={}, runtime__args=["--speculative-num-draft-tokens", "2"]
        ),
        "remove them from runtime.args",
    ),
    (
        "chat template",
        with_changes(
            DEEPSEEK_SPEC, runtime__chatTemplate="{{ messages }}", runtime__args=["--max-num-seqs", "8"]
        ),
        None,
    ),
    (
        "chat template twice",
        with_changes(
            DEEPSEEK_SPEC, runtime__chatTemplate="{{ messages }}", runtime__args=["--chat-template=/t"]
        ),
        "remove it from runtime.args",
    ),
    (
        "chat template flag alone",
        with_changes(DEEPSEEK_SPEC, runtime__args=["--chat-template", "/models/t.jinja"]),
        None,
    ),
    (
        "speculative flags in args alone",
        with_changes(DEEPSEEK_SPEC, runtime__args=["--speculative-algorithm", "mtp"]),
        None,
    ),
    (
        "paths inside",
        with_changes(DEEPSEEK_SPEC, model__source={"pvc": {"claimName": "w", "path": "/models/..v3/a..b"}}),
        None,
    ),
    ("two nodes per replica", with_changes(DEEPSEEK_SPEC, decode__nodesPerReplica=2), None),
    (
        "tensor parallelism over nodes",
        with_changes(DEEPSEEK_SPEC, prefill__nodesPerReplica=2, prefill__nodeParallelism="tensor"),
        None,
    ),
    (
        "node parallelism on one node",
        with_changes(DEEPSEEK_SPEC, decode__nodeParallelism="pipeline"),
        "set nodesPerReplica above 1",
    ),
    (
        "group flags twice",
        with_changes(DEEPSEEK_SPEC, decode__nodesPerReplica=2, runtime__args=["--nnodes=2"]),
        "nodesPerReplica renders --nnodes",
    ),
    (
        "group flags on one node",
        with_changes(DEEPSEEK_SPEC, runtime__args=["--pipeline-parallel-size", "2"]),
        None,
    ),
]


@pytest.mark.parametrize(("name", "spec", "expected"), CASES, ids=[c[0] for c in CASES])
def test_cel_rules_and_pydantic_agree(name: str, spec: dict[str, Any], expected: str | None) -> None:
    spec_schema = _schema()["properties"]["spec"]
    cel = _cel_violations(spec_schema, _apply_defaults(spec_schema, copy.deepcopy(spec)), celpy.Environment())
    try:
        LLMDeploymentSpec.model_validate(spec)
        pydantic_error = None
    except ValidationError as error:
        pydantic_error = str(error)
    if expected is None:
        assert cel == [] and pydantic_error is None
    else:
        assert any(expected in message for message in cel), cel
        assert pydantic_error is not None and expected in pydantic_error


def test_every_number_in_the_schema_has_bounds_the_apiserver_can_store() -> None:
    # An unbounded integer overflows the apiserver's int32/int64 handling and the operator's arithmetic
    # (maxReplicas: 1000000000000 was accepted); an unbounded float admits .inf.
    for path, node in _walk(_schema()["properties"]["spec"], "spec"):
        if node.get("type") in ("integer", "number"):
            assert "maximum" in node and "minimum" in node, f"{path} is unbounded"
            if node["type"] == "integer":
                assert node["maximum"] <= 2**31 - 1, path


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"decode": {"autoscaling": {"maxReplicas": 1_000_000_000_000}}}, "less than or equal to 1024"),
        ({"router": {"disaggregationThresholdChars": 2**31}}, "less than or equal to 2147483647"),
        ({"model__weightsGiB": float("inf")}, "less than or equal to"),
    ],
)
def test_out_of_range_numbers_are_rejected_by_pydantic_and_the_schema(
    changes: dict[str, Any], fragment: str
) -> None:
    spec = with_changes(DEEPSEEK_SPEC, **changes)
    with pytest.raises(ValidationError, match=fragment):
        LLMDeploymentSpec.model_validate(spec)
    assert not jsonschema.Draft7Validator(_schema()["properties"]["spec"]).is_valid(spec)


def test_unknown_fields_and_bad_enums_are_rejected() -> None:
    with pytest.raises(ValidationError, match="replica"):
        LLMDeploymentSpec.model_validate(with_changes(TINY_SPEC, decode={"replica": 2}))
    with pytest.raises(ValidationError, match="'auto', 'true' or 'false'"):
        LLMDeploymentSpec.model_validate(with_changes(TINY_SPEC, networking={"rdma": {"enabled": True}}))


def test_round_trip_keeps_camel_case_and_drops_unset() -> None:
    spec = LLMDeploymentSpec.model_validate(DEEPSEEK_SPEC)
    dumped = spec.to_api()
    assert dumped["runtime"]["tensorParallelSize"] == 8
    assert "replicas" not in dumped["decode"]
    assert LLMDeploymentSpec.model_validate(dumped) == spec


@pytest.mark.parametrize(
    ("name", "valid"), [("llm", True), ("a" * 40, True), ("a" * 41, False), ("with.dot", False)]
)
def test_name_rule_in_cel_and_python(name: str, valid: bool) -> None:
    from sovereign_operator.api.crd import NAME_RULES

    env = celpy.Environment()
    obj = {"metadata": {"name": name}, "spec": copy.deepcopy(TINY_SPEC)}
    for rule in _schema()["x-kubernetes-validations"][: len(NAME_RULES)]:
        program = env.program(env.compile(rule["rule"]))
        assert bool(program.evaluate({"self": celpy.json_to_cel(obj)})) == valid
    assert all(rule.holds(name) for rule in NAME_RULES) == valid


@pytest.mark.parametrize(
    ("name", "nodes", "valid"), [("a" * 32, 2, True), ("a" * 33, 2, False), ("a" * 40, 1, True)]
)
def test_a_multi_node_pool_needs_a_shorter_name_in_cel_and_python(name: str, nodes: int, valid: bool) -> None:
    from sovereign_operator.api.crd import GROUP_NAME_RULE

    spec = with_changes(DEEPSEEK_SPEC, decode__nodesPerReplica=nodes)
    schema = _schema()
    obj = _apply_defaults(schema, {"metadata": {"name": name}, "spec": spec})
    violations = _cel_violations(
        {"x-kubernetes-validations": schema["x-kubernetes-validations"]}, obj, celpy.Environment()
    )
    assert (violations == []) == valid, violations
    assert GROUP_NAME_RULE.holds((name, LLMDeploymentSpec.model_validate(spec))) == valid


@pytest.mark.parametrize("example", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_pass_the_crd_rules(example: Path) -> None:
    for document in yamlio.load_all(example.read_text()):
        schema = _schema()
        obj = _apply_defaults(schema, copy.deepcopy(document))
        assert _cel_violations(schema, obj, celpy.Environment()) == []
        # Types, enums, bounds and required fields as OpenAPI states them.
        jsonschema.Draft7Validator(schema).validate(obj)
        LLMDeploymentSpec.model_validate(document["spec"])


def test_openapi_schema_rejects_what_the_apiserver_would() -> None:
    validator = jsonschema.Draft7Validator(_schema()["properties"]["spec"])
    assert validator.is_valid(copy.deepcopy(DEEPSEEK_SPEC))
    assert not validator.is_valid(with_changes(DEEPSEEK_SPEC, networking={"rdma": {"enabled": True}}))
    assert not validator.is_valid(with_changes(DEEPSEEK_SPEC, runtime={"tensorParallelSize": 0}))
    assert not validator.is_valid(
        with_changes(DEEPSEEK_SPEC, model__source={"hostPath": {"path": "relative"}})
    )
    assert not validator.is_valid(with_changes(DEEPSEEK_SPEC, model=None))
