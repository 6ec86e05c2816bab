"""Reading an LLMDeployment document (from a file or the apiserver) into validated models.

Errors come out as one line that names the field and what is valid, for the CLI and for the
Degraded condition alike.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from sovereign_operator.api.crd import API_VERSION, GROUP_NAME_RULE, KIND, NAME_RULES
from sovereign_operator.api.spec import LLMDeploymentSpec


class InvalidDeployment(ValueError):
    """A document the operator cannot realise; `str()` is one line naming the field."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


@dataclass(frozen=True)
class ParsedDeployment:
    name: str
    namespace: str | None
    uid: str | None
    generation: int
    spec: LLMDeploymentSpec


def _field_path(prefix: str, location: tuple[str | int, ...]) -> str:
    path = prefix
    for part in location:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path


_UNION_TAGS = ("int", "str")


def describe_validation_error(error: ValidationError, prefix: str = "spec") -> InvalidDeployment:
    problems = error.errors(include_url=False)
    first = problems[0]
    # Union members (int | str) add their type name to the location; it is noise to a user.
    location = tuple(p for p in first["loc"] if p not in _UNION_TAGS)
    message = str(first["msg"]).removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = "unknown field (check the spelling against docs/api.md)"
    elif location != first["loc"]:
        message = 'must be a Kubernetes quantity: an integer or a string such as "1500m" or "16Gi"'
    elif isinstance(first.get("input"), bool) and first["type"] == "literal_error":
        message += ' (quote true and false in YAML: "true")'
    distinct = {tuple(p for p in problem["loc"] if p not in _UNION_TAGS) for problem in problems}
    if len(distinct) > 1:
        more = len(distinct) - 1
        message += f" (and {more} more problem{'s' if more > 1 else ''})"
    return InvalidDeployment(_field_path(prefix, location), message)


def parse_spec(spec: Any) -> LLMDeploymentSpec:
    if not isinstance(spec, dict):
        raise InvalidDeployment("spec", "must be an object")
    try:
        return LLMDeploymentSpec.model_validate(spec)
    except ValidationError as error:
        raise describe_validation_error(error) from None


def check_name(name: str, spec: LLMDeploymentSpec | None = None) -> None:
    """The name's own rules, and with the spec the rules that depend on it (multi-node pools)."""
    for rule in NAME_RULES:
        if not rule.holds(name):
            raise InvalidDeployment("metadata.name", rule.message.removeprefix("metadata.name "))
    if spec is not None and not GROUP_NAME_RULE.holds((name, spec)):
        raise InvalidDeployment("metadata.name", GROUP_NAME_RULE.message.removeprefix("metadata.name "))


# Namespaces are DNS-1123 labels; the value lands in every child's metadata and in URLs.
NAMESPACE_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
MAX_NAMESPACE_LENGTH = 63


def check_namespace(namespace: Any, field: str = "metadata.namespace") -> None:
    if (
        not isinstance(namespace, str)
        or len(namespace) > MAX_NAMESPACE_LENGTH
        or re.fullmatch(NAMESPACE_PATTERN, namespace) is None
    ):
        raise InvalidDeployment(
            field,
            f"must be a namespace name: at most {MAX_NAMESPACE_LENGTH} characters of a-z, 0-9 and '-',"
            " starting and ending with a letter or digit",
        )


def parse_document(document: Any) -> ParsedDeployment:
    if not isinstance(document, dict):
        raise InvalidDeployment("(document)", "must be a YAML mapping")
    if document.get("apiVersion") != API_VERSION or document.get("kind") != KIND:
        raise InvalidDeployment(
            "apiVersion/kind",
            f"must be {API_VERSION} {KIND}, got {document.get('apiVersion')} {document.get('kind')}",
        )
    metadata = document.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise InvalidDeployment("metadata", "must be a mapping")
    name = metadata.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidDeployment("metadata.name", "is required")
    check_name(name)
    namespace = metadata.get("namespace")
    if namespace is not None:
        check_namespace(namespace)
    uid = metadata.get("uid")
    if uid is not None and not isinstance(uid, str):
        raise InvalidDeployment("metadata.uid", "must be a string")
    generation = metadata.get("generation") or 1
    if not isinstance(generation, int) or isinstance(generation, bool) or generation < 1:
        raise InvalidDeployment("metadata.generation", "must be a positive integer")
    if "spec" not in document:
        raise InvalidDeployment("spec", "is required")
    return ParsedDeployment(
        name=name,
        namespace=namespace,
        uid=uid,
        generation=generation,
        spec=parse_spec(document["spec"]),
    )
