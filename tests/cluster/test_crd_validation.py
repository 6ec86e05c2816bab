"""The apiserver itself rejects invalid LLMDeployments, naming the field: schema and every CEL rule.

These need only the apiserver and the committed CRD (no operator): `kubectl create` goes through
the real structural-schema validation, strict field validation and CEL evaluation.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster_helpers import CRD_DIR, Kubectl

pytestmark = pytest.mark.cluster

CPU_SPEC: dict[str, Any] = {"model": {"name": "tiny", "source": {"builtin": "sovereign-tiny"}}}
HF_SPEC: dict[str, Any] = {
    "model": {"name": "deepseek-v3", "source": {"huggingFace": {"repo": "deepseek-ai/DeepSeek-V3"}}},
    "runtime": {"tensorParallelSize": 8},
}
GPU_SPEC: dict[str, Any] = {
    "model": {"name": "deepseek-v3", "source": {"pvc": {"claimName": "weights"}}, "weightsGiB": 700},
    "runtime": {"tensorParallelSize": 8},
    "mode": "disaggregated",
    "prefill": {"replicas": 1},
    "decode": {"replicas": 1},
}


def llmd(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "sovereign.ai/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": name},
        "spec": spec,
    }


def patched(base: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of base with the dotted path set to value (None deletes it)."""
    out = copy.deepcopy(base)
    node = out
    keys = path.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    if value is None:
        node.pop(keys[-1], None)
    else:
        node[keys[-1]] = value
    return out


@dataclass(frozen=True)
class Case:
    id: str
    spec: dict[str, Any]
    field: str  # the field path the apiserver must name
    says: str  # a phrase of the message it must give
    name: str = "bad"
    cel: bool = False  # whether this exercises an x-kubernetes-validations rule


CASES = [
    # ---- structural schema, enums, bounds, strict fields -----------------------------------
    Case("model-required", {"runtime": {"tensorParallelSize": 1}}, "spec.model", "Required value"),
    Case("mode-enum", patched(CPU_SPEC, "mode", "fast"), "spec.mode", 'Unsupported value: "fast"'),
    Case(
        "precision-enum",
        patched(CPU_SPEC, "model.precision", "int4"),
        "spec.model.precision",
        "Unsupported value",
    ),
    Case(
        "tp-minimum",
        patched(GPU_SPEC, "runtime.tensorParallelSize", 0),
        "spec.runtime.tensorParallelSize",
        "should be greater than or equal to 1",
    ),
    Case(
        "replicas-negative",
        patched(GPU_SPEC, "decode.replicas", -1),
        "spec.decode.replicas",
        "should be greater than or equal to 0",
    ),
    Case(
        "hostpath-absolute",
        patched(CPU_SPEC, "model.source", {"hostPath": {"path": "models/ds"}}),
        "spec.model.source.hostPath.path",
        "should match '^/'",
    ),
    Case(
        "drain-timeout-max",
        patched(CPU_SPEC, "runtime.drainTimeoutSeconds", 7200),
        "spec.runtime.drainTimeoutSeconds",
        "should be less than or equal to 3600",
    ),
    Case("unknown-field", patched(CPU_SPEC, "replicas", 3), "spec.replicas", 'unknown field "spec.replicas"'),
    Case(
        "hf-repo-pattern",
        patched(HF_SPEC, "model.source.huggingFace.repo", "deepseek-ai/DeepSeek V3"),
        "spec.model.source.huggingFace.repo",
        "should match",
    ),
    Case(
        "hf-endpoint-url",
        patched(HF_SPEC, "model.source.huggingFace.endpoint", "hub.internal"),
        "spec.model.source.huggingFace.endpoint",
        "should match '^https?://",
    ),
    Case(
        "hf-retention-enum",
        patched(HF_SPEC, "model.source.huggingFace.cache", {"retention": "Forever"}),
        "spec.model.source.huggingFace.cache.retention",
        "Unsupported value",
    ),
    Case(
        "router-policy-enum",
        patched(CPU_SPEC, "router.policy", "random"),
        "spec.router.policy",
        "Unsupported value",
    ),
    # ---- every CEL rule ----------------------------------------------------------------
    Case("name-too-long", CPU_SPEC, "metadata.name", "at most 40 characters", name="a" * 41, cel=True),
    Case(
        "source-exactly-one",
        patched(CPU_SPEC, "model.source", {"builtin": "sovereign-tiny", "pvc": {"claimName": "w"}}),
        "spec.model.source",
        "set exactly one of pvc, hostPath, image, builtin or huggingFace",
        cel=True,
    ),
    Case(
        "size-the-budget",
        patched(GPU_SPEC, "model.weightsGiB", None),
        "spec.model",
        "set parametersBillions or weightsGiB",
        cel=True,
    ),
    Case(
        "disaggregated-needs-pools",
        patched(GPU_SPEC, "prefill", None),
        "spec",
        "mode disaggregated needs both the prefill and the decode pool",
        cel=True,
    ),
    Case(
        "unified-no-prefill",
        patched(GPU_SPEC, "mode", "unified"),
        "spec",
        "mode unified runs one pool configured by decode",
        cel=True,
    ),
    Case(
        "builtin-tp-1",
        patched(CPU_SPEC, "runtime", {"tensorParallelSize": 2}),
        "spec",
        "runtime.tensorParallelSize must be 1",
        cel=True,
    ),
    Case(
        "prefill-replicas-xor-autoscaling",
        patched(GPU_SPEC, "prefill", {"replicas": 2, "autoscaling": {"maxReplicas": 4}}),
        "spec.prefill",
        "set either replicas or autoscaling, not both",
        cel=True,
    ),
    Case(
        "decode-replicas-xor-autoscaling",
        patched(GPU_SPEC, "decode", {"replicas": 2, "autoscaling": {"maxReplicas": 4}}),
        "spec.decode",
        "set either replicas or autoscaling, not both",
        cel=True,
    ),
    Case(
        "autoscaling-min-le-max",
        patched(GPU_SPEC, "decode", {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}),
        "spec.decode.autoscaling",
        "minReplicas must be less than or equal to maxReplicas",
        cel=True,
    ),
    Case(
        "rdma-count",
        patched(GPU_SPEC, "networking", {"rdma": {"enabled": "true", "count": 0}}),
        "spec.networking.rdma",
        "count must be at least 1 when RDMA is enabled or auto",
        cel=True,
    ),
    Case(
        "jit-cache-exactly-one",
        patched(GPU_SPEC, "startup", {"jitCache": {}}),
        "spec.startup.jitCache",
        "set exactly one of pvc or emptyDir",
        cel=True,
    ),
    Case(
        "prometheus-url",
        patched(GPU_SPEC, "autoscaling", {"metrics": {"source": "prometheus"}}),
        "spec.autoscaling.metrics",
        "prometheusUrl is required when source is prometheus",
        cel=True,
    ),
    Case(
        "max-replicas-int32-overflow",
        patched(GPU_SPEC, "decode", {"autoscaling": {"maxReplicas": 1_000_000_000_000}}),
        "spec.decode.autoscaling.maxReplicas",
        "should be less than or equal to 1024",
    ),
    Case(
        "quantity-negative-int",
        patched(CPU_SPEC, "runtime.resources", {"requests": {"cpu": -4}}),
        "spec.runtime.resources.requests[cpu]",
        "must be a non-negative Kubernetes quantity",
        cel=True,
    ),
    Case(
        "quantity-shell-string",
        patched(CPU_SPEC, "router.resources", {"limits": {"memory": "2Gi; rm -rf"}}),
        "spec.router.resources.limits[memory]",
        "must be a non-negative Kubernetes quantity",
        cel=True,
    ),
    Case(
        "pvc-path-inside-the-volume",
        patched(GPU_SPEC, "model.source", {"pvc": {"claimName": "w", "path": "../../../etc"}}),
        "spec.model.source.pvc",
        "path must stay inside the volume: no '..' segments",
        cel=True,
    ),
    Case(
        "ratio-min-le-max",
        patched(GPU_SPEC, "autoscaling", {"prefillDecodeRatio": {"min": 2, "max": 1}}),
        "spec.autoscaling.prefillDecodeRatio",
        "min must be less than or equal to max",
        cel=True,
    ),
    Case(
        "speculative-draft-tokens-max",
        patched(GPU_SPEC, "decode.speculative", {"numDraftTokens": 5}),
        "spec.decode.speculative.numDraftTokens",
        "should be less than or equal to 4",
    ),
    Case(
        "speculative-not-on-prefill",
        patched(GPU_SPEC, "prefill.speculative", {"numDraftTokens": 1}),
        "spec",
        "speculative decoding drafts while decoding: set it on decode",
        cel=True,
    ),
    Case(
        "speculative-flags-once",
        patched(
            patched(GPU_SPEC, "decode.speculative", {"algorithm": "mtp"}),
            "runtime.args",
            ["--speculative-algorithm", "mtp"],
        ),
        "spec",
        "decode.speculative renders the --speculative-* flags",
        cel=True,
    ),
    Case(
        "chat-template-flag-once",
        patched(
            patched(GPU_SPEC, "runtime.chatTemplate", "{{ messages }}"),
            "runtime.args",
            ["--chat-template=/models/t.jinja"],
        ),
        "spec",
        "runtime.chatTemplate renders the --chat-template flag",
        cel=True,
    ),
    Case(
        "chat-template-not-empty",
        patched(GPU_SPEC, "runtime.chatTemplate", ""),
        "spec.runtime.chatTemplate",
        "should be at least 1 chars long",
    ),
    Case(
        "node-parallelism-needs-nodes",
        patched(GPU_SPEC, "decode.nodeParallelism", "tensor"),
        "spec.decode",
        "nodeParallelism splits a replica over its nodes: set nodesPerReplica above 1",
        cel=True,
    ),
    Case(
        "group-flags-rendered-once",
        patched(patched(GPU_SPEC, "decode.nodesPerReplica", 2), "runtime.args", ["--nnodes", "2"]),
        "spec",
        "nodesPerReplica renders --nnodes",
        cel=True,
    ),
    Case(
        "group-name-length",
        patched(GPU_SPEC, "prefill.nodesPerReplica", 2),
        "metadata.name",
        "at most 32 characters when a pool has nodesPerReplica above 1",
        name="a" * 33,
        cel=True,
    ),
    Case(
        "nodes-per-replica-maximum",
        patched(GPU_SPEC, "decode.nodesPerReplica", 65),
        "spec.decode.nodesPerReplica",
        "should be less than or equal to 64",
    ),
    Case(
        "restart-backoff-le-cap",
        patched(CPU_SPEC, "remediation", {"restartBackoffSeconds": 600, "maxRestartBackoffSeconds": 300}),
        "spec.remediation",
        "restartBackoffSeconds must be less than or equal to maxRestartBackoffSeconds",
        cel=True,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_invalid_llmdeployment_is_rejected_naming_the_field(
    kube: Kubectl, module_namespace: str, case: Case
) -> None:
    namespace = module_namespace
    result = kube.try_create(llmd(case.name, case.spec), namespace)
    assert result.returncode != 0, f"{case.id}: the apiserver accepted an invalid LLMDeployment"
    message = result.stderr
    assert case.field in message, f"{case.id}: rejection does not name {case.field}: {message}"
    assert case.says in message, f"{case.id}: rejection does not say {case.says!r}: {message}"
    # Nothing was stored.
    assert kube.get_or_none("llmdeployments", case.name, "-n", namespace) is None


@pytest.mark.parametrize(
    "spec", [CPU_SPEC, GPU_SPEC, HF_SPEC], ids=["cpu-builtin", "gpu-disaggregated", "huggingface-unsized"]
)
def test_the_valid_bases_are_accepted(kube: Kubectl, module_namespace: str, spec: dict[str, Any]) -> None:
    # The invalid cases above are one change away from these, so each rejection is that change's.
    result = kube.run(
        "create",
        "--dry-run=server",
        "-n",
        module_namespace,
        "-f",
        "-",
        stdin=yaml.safe_dump(llmd("ok", spec)),
    )
    assert result.returncode == 0


def _cel_messages(crd_dir: Path) -> set[str]:
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for rule in node.get("x-kubernetes-validations", []) or []:
                found.add(" ".join(str(rule["message"]).split()))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for path in sorted(crd_dir.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            walk(doc)
    return found


def test_every_cel_rule_of_the_crd_has_a_rejection_case() -> None:
    messages = _cel_messages(CRD_DIR)
    assert messages, "the CRD has no CEL rules"
    uncovered = sorted(m for m in messages if not any(c.cel and c.says in m for c in CASES))
    assert not uncovered, f"CEL rules without a case in CASES: {uncovered}"
    assert len(CASES) >= 10
