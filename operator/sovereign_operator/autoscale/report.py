"""Decisions as the cluster shows them: the pool's `status.pools.<pool>.autoscaler`, Events and the
`MetricsAvailable` condition. Pure builders: the handler writes what they return."""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from .types import PoolDecision

HISTORY_LIMIT = 10
METRICS_AVAILABLE = "MetricsAvailable"


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


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
    transition = rfc3339(now)
    if previous and previous.get("status") == status and previous.get("lastTransitionTime"):
        transition = previous["lastTransitionTime"]
    cond: dict[str, Any] = {
        "type": METRICS_AVAILABLE,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": transition,
    }
    if observed_generation is not None:
        cond["observedGeneration"] = observed_generation
    return cond
