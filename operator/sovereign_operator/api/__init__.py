"""The LLMDeployment API: pydantic models of spec and status, and the CRD generated from them."""

from sovereign_operator.api.crd import API_VERSION, GROUP, KIND, PLURAL, VERSION, custom_resource_definition
from sovereign_operator.api.spec import LLMDeploymentSpec
from sovereign_operator.api.status import LLMDeploymentStatus

__all__ = [
    "API_VERSION",
    "GROUP",
    "KIND",
    "PLURAL",
    "VERSION",
    "LLMDeploymentSpec",
    "LLMDeploymentStatus",
    "custom_resource_definition",
]
