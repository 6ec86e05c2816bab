"""Pure rendering of an LLMDeployment into its child objects."""

from sovereign_operator.render.children import DeploymentRef, Rendered, render
from sovereign_operator.render.plan import (
    ClusterFacts,
    ModePlan,
    OperatorDefaults,
    resolve_mode,
    startup_budget,
)

__all__ = [
    "ClusterFacts",
    "DeploymentRef",
    "ModePlan",
    "OperatorDefaults",
    "Rendered",
    "render",
    "resolve_mode",
    "startup_budget",
]
