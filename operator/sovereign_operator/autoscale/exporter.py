"""Operator metrics for the autoscaler: per pool, desired/current/ready replicas and the signals.

Served by whatever exposes the operator's prometheus_client registry (kopf's liveness endpoint does
not; the operator's `/metrics` server should serve `REGISTRY` or the registry passed here).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from .types import PoolDecision

_POOL = ("namespace", "name", "pool")


class AutoscalerMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.desired = Gauge(
            "sovereign_autoscaler_desired_replicas",
            "Replicas the autoscaler decided",
            _POOL,
            registry=registry,
        )
        self.current = Gauge(
            "sovereign_autoscaler_current_replicas", "Replicas the StatefulSet has", _POOL, registry=registry
        )
        self.ready = Gauge("sovereign_autoscaler_ready_replicas", "Ready replicas", _POOL, registry=registry)
        self.signal_value = Gauge(
            "sovereign_autoscaler_signal_value",
            "Each signal's current value (per replica for queues)",
            (*_POOL, "signal"),
            registry=registry,
        )
        self.signal_target = Gauge(
            "sovereign_autoscaler_signal_target",
            "Each signal's target",
            (*_POOL, "signal"),
            registry=registry,
        )
        self.driving = Gauge(
            "sovereign_autoscaler_driving_signal",
            "1 for the signal that drove the latest decision",
            (*_POOL, "signal"),
            registry=registry,
        )
        self.metrics_available = Gauge(
            "sovereign_autoscaler_metrics_available",
            "1 when the pool's metrics were usable at the last tick",
            _POOL,
            registry=registry,
        )
        self.scale_events = Counter(
            "sovereign_autoscaler_scale_events",
            "Replica changes decided, by direction",
            (*_POOL, "direction"),
            registry=registry,
        )
        self._signals: dict[tuple[str, str, str], set[str]] = {}

    def observe(self, namespace: str, name: str, decisions: Iterable[PoolDecision]) -> None:
        for d in decisions:
            key = (namespace, name, d.pool)
            self.desired.labels(*key).set(d.desired)
            self.current.labels(*key).set(d.current)
            self.ready.labels(*key).set(d.ready)
            self.metrics_available.labels(*key).set(1.0 if d.metrics_available else 0.0)
            if d.desired != d.previous:
                self.scale_events.labels(*key, d.direction).inc()
            seen = {r.signal for r in d.readings}
            # Signals that no longer report (metrics gone, latency idle) are removed, not left stale.
            for gone in self._signals.get(key, set()) - seen:
                for gauge in (self.signal_value, self.signal_target, self.driving):
                    gauge.remove(*key, gone)
            for r in d.readings:
                self.signal_value.labels(*key, r.signal).set(r.value)
                self.signal_target.labels(*key, r.signal).set(r.target)
                self.driving.labels(*key, r.signal).set(1.0 if r.signal == d.signal else 0.0)
            self._signals[key] = seen

    def forget(self, namespace: str, name: str) -> None:
        """Drop every series of a deleted LLMDeployment."""
        for key in [k for k in self._signals if k[:2] == (namespace, name)]:
            for gauge in (self.desired, self.current, self.ready, self.metrics_available):
                gauge.remove(*key)
            for signal in self._signals.pop(key):
                for gauge in (self.signal_value, self.signal_target, self.driving):
                    gauge.remove(*key, signal)
