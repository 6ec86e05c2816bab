"""Autoscaling of the prefill, decode and unified pools from the runtime's own metrics.

``policy`` is pure (decisions from observations, config and remembered state); ``metrics`` collects
observations from the runtime pods or a Prometheus API; ``report`` turns decisions into status,
Events and conditions; ``exporter`` publishes them as operator metrics; ``controller`` is the thin
shell that runs one deployment's round. Nothing here knows kopf: the periodic loop that drives the
rounds is ``sovereign_operator.loop``, the KV-health monitor ``sovereign_operator.kvmonitor``.
"""

from .policy import decide, decide_pool, evaluate_signals, metrics_problem
from .types import (
    AutoscalerConfig,
    PoolConfig,
    PoolDecision,
    PoolInput,
    PoolMetrics,
    PoolReplicas,
    PoolState,
    SignalReading,
)

__all__ = [
    "AutoscalerConfig",
    "PoolConfig",
    "PoolDecision",
    "PoolInput",
    "PoolMetrics",
    "PoolReplicas",
    "PoolState",
    "SignalReading",
    "decide",
    "decide_pool",
    "evaluate_signals",
    "metrics_problem",
]
