"""Decisions as the cluster shows them: the pool's `status.pools.<pool>.autoscaler`, Events and the
`MetricsAvailable` condition. Pure builders: the handler writes what they return."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from sovereign_operator.vocabulary import METRICS_AVAILABLE, condition, rfc3339

from .types import PoolDecision

HISTORY_LIMIT = 10


def _number(value: float | None) -> float | None:
    if value is None or math.isnan(value) or math.isinf(value):
        return None
    return round(value, 6)


def autoscaler_status(decision: PoolDecision, previous: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The pool's `autoscaler` status block (camelCase, as AutoscalerStatus), with the last
    ten replica changes in `history`, newest last."""
    history = list((previous or {}).get("history") or [])
    if decision.desired != decision.previous:
        entry: dict[str, Any] = {
            "time": rfc3339(decision.time),
            "from": decision.previous,
            "to": decision.desired,
            "signal": decision.signal,
        }
        if _number(decision.value) is not None:
            entry["value"] = _number(decision.value)
        history.append(entry)
    out: dict[str, Any] = {
        "desiredReplicas": decision.desired,
        "signal": decision.signal,
        "reason": decision.reason,
        "lastDecisionTime": rfc3339(decision.time),
        "history": history[-HISTORY_LIMIT:],
    }
    if _number(decision.value) is not None:
        out["value"] = _number(decision.value)
    if _number(decision.target) is not None:
        out["target"] = _number(decision.target)
    return out


def scaling_event(decision: PoolDecision) -> dict[str, str] | None:
    """A Kubernetes Event (type, reason, message) for a replica change; None when nothing changed.

    Holds are not Events (they would repeat every interval); they are in status and the condition.
    """
    if decision.desired == decision.previous:
        return None
    if decision.limited_by == "capacity":
        kind, reason = "Warning", "ScaleCapped"
    elif decision.direction == "up":
        kind, reason = "Normal", "ScaledUp"
    else:
        kind, reason = "Normal", "ScaledDown"
    return {
        "type": kind,
        "reason": reason,
        "message": f"{decision.pool}: {decision.previous} -> {decision.desired} replicas: {decision.reason}",
    }


def metrics_condition(
    decisions: Mapping[str, PoolDecision],
    now: float,
    previous: Mapping[str, Any] | None = None,
    observed_generation: int | None = None,
) -> dict[str, Any]:
    """The `MetricsAvailable` condition over all autoscaled pools; the transition time moves only
    when the status flips."""
    missing = {name: d for name, d in decisions.items() if not d.metrics_available}
    if missing:
        status, reason = "False", "MetricsUnavailable"
        message = "; ".join(f"{name}: {d.reason}" for name, d in sorted(missing.items()))
        message += " (no scaling decisions for these pools until metrics return)"
    else:
        status, reason = "True", "MetricsAvailable"
        message = (
            "metrics collected from " + ", ".join(sorted(decisions)) if decisions else "no autoscaled pools"
        )
    return condition(METRICS_AVAILABLE, status, reason, message, rfc3339(now), previous, observed_generation)
