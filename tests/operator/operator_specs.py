"""Small LLMDeployment specs the operator tests vary (imported by name: tests/ is not a package)."""

from __future__ import annotations

import copy
from typing import Any

TINY_SPEC: dict[str, Any] = {
    "model": {"name": "tiny", "source": {"builtin": "sovereign-tiny"}},
    "mode": "unified",
    "decode": {"replicas": 1},
}

DEEPSEEK_SPEC: dict[str, Any] = {
    "model": {
        "name": "deepseek-ai/DeepSeek-V3",
        "source": {"pvc": {"claimName": "deepseek-v3-weights", "path": "DeepSeek-V3"}},
        "precision": "fp8",
        "parametersBillions": 671,
    },
    "runtime": {"image": "registry.example/sovereign-runtime:1", "tensorParallelSize": 8},
    "mode": "disaggregated",
    "prefill": {"replicas": 1},
    "decode": {"autoscaling": {"minReplicas": 1, "maxReplicas": 4}},
    "networking": {"rdma": {"enabled": "true", "networks": ["rdma-net"]}},
}


def with_changes(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """A deep copy of base with dotted-path keys set (a value of None removes the key)."""
    spec = copy.deepcopy(base)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = spec
        for key in parents:
            node = node.setdefault(key, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return spec
