"""Generate the LLMDeployment CustomResourceDefinition from the pydantic models.

Pydantic writes JSON Schema (2020-12, with $defs, anyOf for optionals, titles); the apiserver wants
a structural OpenAPI v3 schema. `structural` closes that gap: it inlines references, turns
`X | None` into an optional X, turns `int | str` into int-or-string, drops what OpenAPI v3 does not
know, and marks free-form maps (`dict[str, Any]`) with `x-kubernetes-preserve-unknown-fields`.
"""

from __future__ import annotations

import re
from typing import Any

from sovereign_operator.api.rules import CrossFieldRule
from sovereign_operator.api.spec import LLMDeploymentSpec
from sovereign_operator.api.status import LLMDeploymentStatus
from sovereign_operator.vocabulary import READY

GROUP = "sovereign.ai"
VERSION = "v1alpha1"
KIND = "LLMDeployment"
PLURAL = "llmdeployments"
SINGULAR = "llmdeployment"
SHORT_NAMES = ["llmd"]
API_VERSION = f"{GROUP}/{VERSION}"

# Children are named `<name>-unified` etc. and Services need DNS-1035 labels; StatefulSet names
# must leave room for the controller-revision-hash label (63 characters in all). The apiserver
# already enforces a lowercase DNS subdomain; CEL adds the length and "no dots" (a regex on an
# unbounded string would exceed CEL's estimated cost budget), pydantic also the leading letter.
MAX_NAME_LENGTH = 40
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
NAME_RULES = (
    CrossFieldRule(
        cel=f"size(self.metadata.name) <= {MAX_NAME_LENGTH} && !self.metadata.name.contains('.')",
        message=f"metadata.name must be at most {MAX_NAME_LENGTH} characters of a-z, 0-9 and '-',"
        " starting with a letter (it prefixes Service and StatefulSet names)",
        holds=lambda name: len(name) <= MAX_NAME_LENGTH and re.fullmatch(NAME_PATTERN, name) is not None,
    ),
)

# A multi-node pool's LeaderWorkerSet is `<name>-<component>-group`; its per-group worker StatefulSets add
# `-<group index>` and their controller-revision-hash label another 11 characters (63 in all).
MAX_GROUP_NAME_LENGTH = 32
_SINGLE_NODE = " && ".join(
    f"(!has(self.spec.{pool}) || !has(self.spec.{pool}.nodesPerReplica) || self.spec.{pool}.nodesPerReplica == 1)"
    for pool in ("prefill", "decode")
)
GROUP_NAME_RULE = CrossFieldRule(
    cel=f"size(self.metadata.name) <= {MAX_GROUP_NAME_LENGTH} || ({_SINGLE_NODE})",
    message=f"metadata.name must be at most {MAX_GROUP_NAME_LENGTH} characters when a pool has nodesPerReplica"
    " above 1 (it prefixes the LeaderWorkerSet, its StatefulSets and their pods)",
    holds=lambda named: (
        len(named[0]) <= MAX_GROUP_NAME_LENGTH
        or not any(pool is not None and pool.multi_node for pool in (named[1].prefill, named[1].decode))
    ),
)


def structural(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Convert one pydantic JSON Schema node into a structural OpenAPI v3 node."""
    if "$ref" in schema:
        target = defs[schema["$ref"].rsplit("/", 1)[-1]]
        outer = {k: v for k, v in schema.items() if k != "$ref"}
        return structural({**target, **outer}, defs)
    if "anyOf" in schema:
        variants = [v for v in schema["anyOf"] if v.get("type") != "null"]
        outer = {k: v for k, v in schema.items() if k != "anyOf"}
        if len(variants) == 1:
            return structural({**variants[0], **outer}, defs)
        types = {v.get("type") for v in variants}
        if types == {"integer", "string"}:
            node = _common(outer)
            node["x-kubernetes-int-or-string"] = True
            return node
        raise ValueError(f"cannot express anyOf {variants} structurally")

    node = _common(schema)
    kind = schema.get("type")
    if kind is None:
        raise ValueError(f"schema node without a type: {schema}")
    node["type"] = kind
    if "const" in schema:
        node["enum"] = [schema["const"]]
    if kind == "object":
        properties = schema.get("properties")
        extra = schema.get("additionalProperties")
        if properties:
            node["properties"] = {name: structural(sub, defs) for name, sub in properties.items()}
            if schema.get("required"):
                node["required"] = list(schema["required"])
        elif isinstance(extra, dict) and extra:
            node["additionalProperties"] = structural(extra, defs)
        else:
            # dict[str, Any]: a free-form Kubernetes object (affinity, valueFrom).
            node["x-kubernetes-preserve-unknown-fields"] = True
    elif kind == "array":
        node["items"] = structural(schema["items"], defs)
    return node


def _common(schema: dict[str, Any]) -> dict[str, Any]:
    """Copy the keys OpenAPI v3 shares with JSON Schema, in a fixed order."""
    node: dict[str, Any] = {}
    for key in ("description", "enum", "minimum", "maximum", "minLength", "maxLength", "pattern"):
        if key in schema:
            node[key] = schema[key]
    for key in ("minItems", "maxItems", "minProperties", "maxProperties", "x-kubernetes-validations"):
        if key in schema:
            node[key] = schema[key]
    # JSON Schema 2020 numeric exclusive bounds become OpenAPI v3 boolean flags.
    if "exclusiveMinimum" in schema:
        node["minimum"], node["exclusiveMinimum"] = schema["exclusiveMinimum"], True
    if "exclusiveMaximum" in schema:
        node["maximum"], node["exclusiveMaximum"] = schema["exclusiveMaximum"], True
    if schema.get("default") is not None:
        node["default"] = schema["default"]
    return node


def _schema_of(model: type) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")  # type: ignore[attr-defined]
    return structural(raw, raw.get("$defs", {}))


def openapi_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "description": "LLMDeployment serves one LLM with prefill/decode pools behind a router.",
        "required": ["spec"],
        "x-kubernetes-validations": [rule.as_validation() for rule in (*NAME_RULES, GROUP_NAME_RULE)],
        "properties": {
            "apiVersion": {"type": "string", "description": f"The API version, {API_VERSION}."},
            "kind": {"type": "string", "description": f"The kind, {KIND}."},
            # The apiserver allows nothing here but the type; `kubectl explain` describes ObjectMeta.
            "metadata": {"type": "object"},
            "spec": _schema_of(LLMDeploymentSpec),
            "status": _schema_of(LLMDeploymentStatus),
        },
    }


PRINTER_COLUMNS = [
    {"name": "Mode", "type": "string", "jsonPath": ".status.mode"},
    {
        "name": "Prefill",
        "type": "string",
        "jsonPath": ".status.prefillReplicas",
        "description": "ready/desired",
    },
    {
        "name": "Decode",
        "type": "string",
        "jsonPath": ".status.decodeReplicas",
        "description": "ready/desired",
    },
    {"name": "Ready", "type": "string", "jsonPath": f'.status.conditions[?(@.type=="{READY}")].status'},
    {
        "name": "Download",
        "type": "string",
        "jsonPath": ".status.model.progress",
        "description": "the huggingFace source's download",
    },
    {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def custom_resource_definition() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": SHORT_NAMES,
                "categories": ["sovereign"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                }
            ],
        },
    }
