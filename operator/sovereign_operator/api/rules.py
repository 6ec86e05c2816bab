"""Cross-field rules written once and enforced twice: as CEL in the CRD and in pydantic.

Each rule carries its CEL expression (what the apiserver evaluates), the message a person reads
when it fails, and a Python predicate over the validated model (what `render` and the operator
evaluate). A test evaluates the CEL with a CEL interpreter against the same cases as the
predicates, so the two cannot silently disagree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CrossFieldRule:
    cel: str
    message: str
    holds: Callable[[Any], bool]

    def as_validation(self) -> dict[str, str]:
        return {"rule": self.cel, "message": self.message}


def check_rules(model: Any, rules: tuple[CrossFieldRule, ...]) -> None:
    """Raise ValueError with the message of the first rule the model breaks."""
    for rule in rules:
        if not rule.holds(model):
            raise ValueError(rule.message)
