"""Helpers for the packaging tests: the Go-built tools and offline Kubernetes JSON schemas.

`make test` builds helm, kubeconform and kubectl into e2e/cluster/bin before pytest runs, so in
CI (CI=true) a missing tool is a failure; on a developer machine without them the tests that need
them are skipped with the reason. Schemas for built-in kinds come from the swagger.json inside
the k8s.io/kubernetes module the control plane is built from (nothing is downloaded here).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "sovereign"
TOOLS_DIR = REPO / "e2e" / "cluster" / "bin"
RBAC_RULES = CHART / "files" / "operator-rbac-rules.yaml"
KUBE_VERSION_FALLBACK = "v1.36.3"


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def unavailable(reason: str) -> None:
    """Fail in CI (where `make test` must have built it), skip elsewhere."""
    if in_ci():
        pytest.fail(f"{reason} (CI=true: `make test` builds it before pytest)")
    pytest.skip(reason)


def find_tool(name: str) -> str:
    built = TOOLS_DIR / name
    if built.is_file() and os.access(built, os.X_OK):
        return str(built)
    found = shutil.which(name)
    if found:
        return found
    unavailable(f"{name} not found in {TOOLS_DIR} or PATH (run `make tools`)")
    raise AssertionError("unreachable")


def kube_version() -> str:
    env = REPO / "e2e" / "cluster" / "versions.env"
    if env.is_file():
        for line in env.read_text().splitlines():
            if line.startswith("KUBE_VERSION="):
                return line.split("=", 1)[1].strip()
    return KUBE_VERSION_FALLBACK


def swagger_path() -> Path | None:
    """swagger.json of the pinned Kubernetes release, from the Go module cache."""
    try:
        modcache = subprocess.run(
            ["go", "env", "GOMODCACHE"], capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    path = Path(modcache) / f"k8s.io/kubernetes@{kube_version()}" / "api/openapi-spec/swagger.json"
    return path if path.is_file() else None


def _strict(node: Any, resolve, stack: tuple[str, ...]) -> Any:
    """Inline $refs and forbid unknown fields, so a typo in a template fails validation."""
    if isinstance(node, list):
        return [_strict(n, resolve, stack) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        if name in stack:  # recursive type (JSONSchemaProps): accept anything below
            return {}
        return _strict(resolve(name), resolve, (*stack, name))
    if node.get("x-kubernetes-int-or-string") or node.get("format") == "int-or-string":
        return {"oneOf": [{"type": "string"}, {"type": "integer"}]}
    out = {}
    for key, value in node.items():
        if key in ("format", "description", "x-kubernetes-group-version-kind"):
            continue  # formats like int32/byte are advisory in Kubernetes' swagger
        if key == "properties":
            out[key] = {k: _strict(v, resolve, stack) for k, v in value.items()}
        elif key in ("items", "additionalProperties", "allOf", "oneOf", "anyOf", "not"):
            out[key] = _strict(value, resolve, stack)
        else:
            out[key] = value
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    open_ended = "additionalProperties" in out or node.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and not open_ended:
        out["additionalProperties"] = False
    return out


def schema_file_name(api_version: str, kind: str) -> str:
    """The file kubeconform looks for under SCHEMA_LOCATION."""
    group = api_version.split("/")[0]
    version = api_version.split("/")[-1]
    return f"{group}-{kind.lower()}-{version}.json"


SCHEMA_LOCATION = "{{ .Group }}-{{ .ResourceKind }}-{{ .ResourceAPIVersion }}.json"


def write_builtin_schemas(swagger: dict, kinds: set[tuple[str, str]], out: Path) -> set[tuple[str, str]]:
    """Write strict standalone schemas for the (apiVersion, kind) pairs found; return those written."""
    definitions = swagger["definitions"]
    written = set()
    for name, definition in definitions.items():
        for gvk in definition.get("x-kubernetes-group-version-kind", []):
            api_version = f"{gvk['group']}/{gvk['version']}" if gvk["group"] else gvk["version"]
            if (api_version, gvk["kind"]) not in kinds:
                continue
            resolved = dict(definitions)
            # resource.Quantity is a string in swagger, but YAML numbers (memory: 1) are valid too.
            quantity = "io.k8s.apimachinery.pkg.api.resource.Quantity"
            resolved[quantity] = {"oneOf": [{"type": "string"}, {"type": "number"}]}
            schema = _strict(definition, resolved.__getitem__, (name,))
            (out / schema_file_name(api_version, gvk["kind"])).write_text(json.dumps(schema))
            written.add((api_version, gvk["kind"]))
    return written


def write_crd_schemas(crd_docs: list[dict], out: Path) -> set[tuple[str, str]]:
    """Convert each served version's openAPIV3Schema of the CRDs into a kubeconform schema."""
    written = set()
    for crd in crd_docs:
        spec = crd["spec"]
        for version in spec["versions"]:
            api_version = f"{spec['group']}/{version['name']}"
            schema = _strict(version["schema"]["openAPIV3Schema"], lambda n: {}, ())
            # A CR is an object with metadata; the apiserver adds these to every CRD schema.
            schema.setdefault("properties", {})
            schema["properties"].update(
                apiVersion={"type": "string"}, kind={"type": "string"}, metadata={"type": "object"}
            )
            (out / schema_file_name(api_version, spec["names"]["kind"])).write_text(json.dumps(schema))
            written.add((api_version, spec["names"]["kind"]))
    return written


def load_docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]
