"""Status, Event, condition and operator-metric output of autoscaling decisions."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from sovereign_operator.api.status import AutoscalerStatus, Condition
from sovereign_operator.autoscale import PoolDecision, SignalReading
from sovereign_operator.autoscale.exporter import AutoscalerMetrics
from sovereign_operator.autoscale.report import autoscaler_status, metrics_condition, scaling_event


def decision(previous: int, desired: int, *, t: float = 1_700_000_000.0, **kw: object) -> PoolDecision:
    fields: dict[str, object] = {
        "pool": "decode",
        "role": "decode",
        "time": t,
        "desired": desired,
        "previous": previous,
        "current": previous,
        "ready": previous,
        "direction": "up" if desired > previous else "down" if desired < previous else "hold",
        "signal": "kv_cache_usage",
        "value": 0.93,
        "target": 0.75,
        "reason": f"scale {previous}->{desired}",
        "metrics_available": True,
        "readings": (
            SignalReading("kv_cache_usage", 0.93, 0.75, desired),
            SignalReading("itl", 0.02, 0.05, previous),
        ),
    }
    fields.update(kw)
    return PoolDecision(**fields)  # type: ignore[arg-type]


def test_status_matches_the_api_model_and_keeps_ten_changes() -> None:
    status: dict[str, object] | None = None
    for i in range(14):
        status = autoscaler_status(decision(i + 1, i + 2, t=1_700_000_000.0 + 15 * i), status)
    assert status is not None
    parsed = AutoscalerStatus.model_validate(status)
    assert parsed.desired_replicas == 15 and parsed.signal == "kv_cache_usage" and parsed.target == 0.75
    assert len(parsed.history) == 10 and parsed.history[-1].to == 15 and parsed.history[0].from_ == 5
    assert parsed.last_decision_time == "2023-11-14T22:16:35Z"
    # A hold updates the decision fields but adds no history entry.
    held = autoscaler_status(decision(15, 15, reason="holding at 15"), status)
    assert len(held["history"]) == 10 and held["reason"] == "holding at 15"


def test_events_only_for_changes() -> None:
    assert scaling_event(decision(3, 3)) is None
    up = scaling_event(decision(2, 3))
    assert (
        up is not None and up["reason"] == "ScaledUp" and up["type"] == "Normal" and "2 -> 3" in up["message"]
    )
    down = scaling_event(decision(3, 2))
    assert down is not None and down["reason"] == "ScaledDown"
    capped = scaling_event(decision(5, 3, limited_by="capacity"))
    assert capped is not None and capped["type"] == "Warning" and capped["reason"] == "ScaleCapped"


def test_metrics_condition_flips_and_keeps_transition_time() -> None:
    ok = metrics_condition({"decode": decision(2, 2)}, now=100.0)
    Condition.model_validate(ok)
    assert ok["status"] == "True"
    bad = metrics_condition(
        {
            "decode": decision(2, 2),
            "prefill": decision(1, 1, metrics_available=False, reason="no pod answered"),
        },
        now=200.0,
        previous=ok,
    )
    assert bad["status"] == "False" and "prefill: no pod answered" in bad["message"]
    assert bad["lastTransitionTime"] != ok["lastTransitionTime"]
    again = metrics_condition({"prefill": decision(1, 1, metrics_available=False)}, now=300.0, previous=bad)
    assert again["lastTransitionTime"] == bad["lastTransitionTime"]


def test_operator_metrics_expose_pool_replicas_and_signals() -> None:
    registry = CollectorRegistry()
    m = AutoscalerMetrics(registry)
    m.observe("llm", "v3", [decision(2, 3)])
    labels = {"namespace": "llm", "name": "v3", "pool": "decode"}
    assert registry.get_sample_value("sovereign_autoscaler_desired_replicas", labels) == 3
    assert registry.get_sample_value("sovereign_autoscaler_current_replicas", labels) == 2
    sig = {**labels, "signal": "kv_cache_usage"}
    assert registry.get_sample_value("sovereign_autoscaler_signal_value", sig) == 0.93
    assert registry.get_sample_value("sovereign_autoscaler_driving_signal", sig) == 1
    assert registry.get_sample_value("sovereign_autoscaler_driving_signal", {**labels, "signal": "itl"}) == 0
    assert (
        registry.get_sample_value("sovereign_autoscaler_scale_events_total", {**labels, "direction": "up"})
        == 1
    )
    # Signals that stop reporting disappear instead of freezing at their last value.
    m.observe("llm", "v3", [decision(3, 3, readings=(SignalReading("kv_cache_usage", 0.7, 0.75, 3),))])
    assert registry.get_sample_value("sovereign_autoscaler_signal_value", {**labels, "signal": "itl"}) is None
    m.forget("llm", "v3")
    assert registry.get_sample_value("sovereign_autoscaler_desired_replicas", labels) is None
