"""Sovereign operator: LLMDeployment API, rendering, autoscaling and kopf handlers."""
