"""The `status` of an LLMDeployment: everything the operator and the autoscaler decide.

The operator never writes `spec` (GitOps tools own it); decided replica counts live here, in
`pools.<pool>.autoscaler.desiredReplicas`, and rendering reads them back as overrides.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sovereign_operator.api.base import ApiModel

ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(ApiModel):
    type: str = Field(min_length=1)
    status: ConditionStatus
    reason: str = Field(min_length=1)
    message: str = ""
    last_transition_time: str = Field(description="RFC 3339 time the status last changed.")
    observed_generation: int | None = None


class ScalingEvent(ApiModel):
    time: str
    from_: int = Field(alias="from")
    to: int
    signal: str
    value: float | None = None


class AutoscalerStatus(ApiModel):
    """The autoscaler's latest decision for one pool (written by the autoscaler)."""

    desired_replicas: int | None = Field(None, ge=0)
    signal: str | None = None
    value: float | None = None
    target: float | None = None
    reason: str | None = None
    last_decision_time: str | None = None
    history: list[ScalingEvent] = Field(default_factory=list, max_length=10)


class PoolStatus(ApiModel):
    desired_replicas: int = 0
    replicas: int = 0
    ready_replicas: int = 0
    updated_replicas: int = 0
    autoscaler: AutoscalerStatus | None = None


class PoolsStatus(ApiModel):
    prefill: PoolStatus | None = None
    decode: PoolStatus | None = None
    unified: PoolStatus | None = None


class StartupBudget(ApiModel):
    """How the startup probe's budget was computed (see docs/startup.md)."""

    seconds: int
    base_seconds: int
    weight_load_seconds: int
    jit_seconds: int
    overridden: bool = False


class LLMDeploymentStatus(ApiModel):
    observed_generation: int | None = None
    conditions: list[Condition] = Field(default_factory=list, max_length=16)
    mode: Literal["unified", "disaggregated"] | None = Field(None, description="The resolved mode.")
    mode_reason: str | None = None
    kv_transport: Literal["rdma", "tcp"] | None = None
    endpoint: str | None = Field(None, description="The OpenAI base URL of the router Service.")
    startup_budget_seconds: int | None = None
    startup_budget: StartupBudget | None = None
    pools: PoolsStatus | None = None
    # "ready/desired" summaries for the printer columns; in unified mode decode shows the pool.
    prefill_replicas: str | None = None
    decode_replicas: str | None = None
