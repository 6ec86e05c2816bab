"""The base class every API model shares: camelCase field names, unknown fields rejected, and
cross-field rules that also land in the CRD as `x-kubernetes-validations`."""

from __future__ import annotations

from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, GetJsonSchemaHandler, model_validator
from pydantic.alias_generators import to_camel
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema as cs

from sovereign_operator.api.rules import CrossFieldRule, check_rules


class ApiModel(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=False,
    )

    # Rules over this object's own fields; `self` in CEL is this object.
    RULES: ClassVar[tuple[CrossFieldRule, ...]] = ()

    @model_validator(mode="after")
    def _check_cross_field_rules(self) -> Self:
        check_rules(self, type(self).RULES)
        return self

    @classmethod
    def __get_pydantic_json_schema__(
        cls, core_schema: cs.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        schema = handler(core_schema)
        target = handler.resolve_ref_schema(schema)
        if cls.RULES:
            target["x-kubernetes-validations"] = [rule.as_validation() for rule in cls.RULES]
        return schema

    def to_api(self) -> dict[str, Any]:
        """The object as the apiserver stores it: camelCase, unset optional fields left out."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")
