"""Plain data the autoscaling policy reads and writes.

Everything here is a frozen or plain dataclass without I/O so the policy stays a pure function of
(time, observations, config, state). Times are seconds (monotonic or epoch: the policy only subtracts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from sovereign_operator.api.spec import AutoscalingSpec, PoolAutoscaling

Role = Literal["prefill", "decode", "unified"]
Direction = Literal["up", "down", "hold"]

# Signal names, also used as metric label values and in status.
SIGNAL_PROMPT_BACKLOG = "prompt_tokens_waiting"
SIGNAL_TTFT = "ttft"
SIGNAL_ITL = "itl"
SIGNAL_KV_CACHE = "kv_cache_usage"
SIGNAL_RUNNING = "requests_running"
SIGNAL_WAITING = "requests_waiting"
SIGNAL_NONE = "none"


@dataclass(frozen=True)
class PoolMetrics:
    """One pool's runtime metrics, aggregated over the pods that answered a scrape.

    Queue sizes are sums over pods; KV usage is the mean (and max) over pods; latencies are the
    configured quantile (or mean) over the window between two scrapes, ``None`` when no request
    finished the phase in that window (an idle pool, not a missing metric).
    """

    observed_at: float
    pods_reporting: int
    pods_expected: int
    requests_running: float = 0.0
    # Includes ``requests_rejected``: a request refused for load waits too, only not on our pods.
    requests_waiting: float = 0.0
    # Requests refused for load (429) over the window between two observations.
    requests_rejected: float = 0.0
    prompt_tokens_waiting: float = 0.0
    kv_cache_usage_mean: float = 0.0
    kv_cache_usage_max: float = 0.0
    ttft_seconds: float | None = None
    itl_seconds: float | None = None
    # Prompt tokens prefilled per second over the window (summed over pods); None if unknown.
    prompt_tokens_per_s: float | None = None
    errors: tuple[str, ...] = ()


@dataclass(frozen=True)
class PoolReplicas:
    """What the cluster reports for the pool's StatefulSet and its pods.

    ``desired`` is the replica count the StatefulSet currently asks for (last decision applied);
    ``pending_unschedulable`` counts pods the scheduler cannot place (typically: no free GPUs), and
    ``unschedulable_for`` is how long the oldest of them has waited; ``output_failing`` counts running
    pods whose output self-test fails (out of the Service: the policy sizes the pool as if they were
    absent).
    """

    desired: int
    current: int
    ready: int
    pending_unschedulable: int = 0
    unschedulable_for: float = 0.0
    starting: int = 0
    # Running pods whose output self-test fails: no capacity, and not a scale-up still starting.
    output_failing: int = 0


@dataclass(frozen=True)
class PoolInput:
    role: Role
    replicas: PoolReplicas
    metrics: PoolMetrics | None
    # Measured time from pod creation to Ready for recent pods of this pool; None if never seen.
    startup_seconds: float | None = None


def _spec_default(model: type[AutoscalingSpec | PoolAutoscaling], name: str) -> Any:
    """The CRD's default of a field the spec owns: the policy's defaults are the spec's, one source."""
    return model.model_fields[name].default


@dataclass(frozen=True, kw_only=True)
class PoolConfig:
    """Per-pool targets and bounds (mapped from the LLMDeployment's per-pool ``autoscaling``).

    Unset targets are off, as in the spec; the controller gives a decode or unified pool without
    one its KV-cache default (controller.DEFAULT_KV_TARGET)."""

    min_replicas: int = _spec_default(PoolAutoscaling, "min_replicas")
    max_replicas: int  # required, as in the spec
    ttft_target_s: float | None = None
    itl_target_s: float | None = None
    kv_cache_usage_target: float | None = None
    # Per-replica targets for the queue-like signals; None disables that signal. The prompt backlog
    # target, when None, is derived from the TTFT target and the measured prefill rate (tokens a
    # replica clears within the TTFT target), falling back to prompt_tokens_waiting_default.
    prompt_tokens_waiting_target: float | None = None
    prompt_tokens_waiting_default: float | None = 8192.0
    requests_running_target: float | None = None
    requests_waiting_target: float | None = None


@dataclass(frozen=True)
class AutoscalerConfig:
    """Deployment-wide behaviour. Defaults follow what peers found safe: quick up, slow down. The
    first three are spec fields (`spec.autoscaling`) and default as the CRD does; the rest are the
    policy's own (no spec field yet)."""

    scale_up_stabilization_s: float = float(_spec_default(AutoscalingSpec, "scale_up_stabilization_seconds"))
    scale_down_stabilization_s: float = float(
        _spec_default(AutoscalingSpec, "scale_down_stabilization_seconds")
    )
    interval_s: float = float(_spec_default(AutoscalingSpec, "interval_seconds"))
    # Ratio signals inside ±tolerance of their target recommend no change (HPA's 10 %).
    tolerance: float = 0.1
    # Latency below this fraction of its target counts as "room to shrink".
    latency_scale_down_fraction: float = 0.5
    # Step bounds per decision: up by max(pods, percent of current), down by at most this many pods.
    scale_up_max_pods: int = 1
    scale_up_max_percent: float = 50.0
    scale_down_max_pods: int = 1
    # Metrics older than this are stale; None means 3 intervals.
    metrics_max_age_s: float | None = None
    # Lead time used when a pool has no measured startup duration yet.
    default_startup_s: float = 300.0
    # Replicas still starting after this many lead times are considered stuck: stop waiting on them.
    stuck_startup_factor: float = 3.0
    # Pods Pending-unschedulable longer than this cap the pool; the cap lasts capacity_backoff_s,
    # doubling on each repeat up to capacity_backoff_max_s.
    pending_timeout_s: float = 300.0
    capacity_backoff_s: float = 600.0
    capacity_backoff_max_s: float = 3600.0
    # Lead-time forecast of ratio signals: a least-squares line over the last max(lead time,
    # forecast_min_window_s) seconds (at most forecast_max_window_s), extrapolated by the lead time
    # and used only when the slope is significant (t >= forecast_min_t).
    forecast: bool = True
    forecast_min_samples: int = 5
    forecast_min_t: float = 4.0
    forecast_min_window_s: float = 300.0
    forecast_max_window_s: float = 600.0
    # Optional prefill:decode replica ratio bounds, applied across pools of those roles.
    prefill_decode_ratio_min: float | None = None
    prefill_decode_ratio_max: float | None = None

    @property
    def max_metrics_age(self) -> float:
        return self.metrics_max_age_s if self.metrics_max_age_s is not None else 3.0 * self.interval_s


@dataclass
class PoolState:
    """What one pool's autoscaler remembers between ticks (serialisable into status)."""

    # (time, recommendation) pairs, oldest first, trimmed to the longest stabilisation window.
    recommendations: list[tuple[float, int]] = field(default_factory=list)
    # Recent pool-wide totals of each ratio signal, for the lead-time forecast.
    demand: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    # When this controller first saw the pool: scale-down waits for a full window of history.
    first_seen: float | None = None
    last_scale_time: float | None = None
    last_scale_up_time: float | None = None
    # Replica count the last scale-up asked for; in flight until that many pods are ready.
    scale_up_target: int | None = None
    capacity_cap: int | None = None
    capacity_cap_until: float | None = None
    capacity_backoff_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "recommendations": [[t, r] for t, r in self.recommendations],
            "demand": {k: [[t, y] for t, y in v] for k, v in self.demand.items()},
            "firstSeen": self.first_seen,
            "lastScaleTime": self.last_scale_time,
            "lastScaleUpTime": self.last_scale_up_time,
            "scaleUpTarget": self.scale_up_target,
            "capacityCap": self.capacity_cap,
            "capacityCapUntil": self.capacity_cap_until,
            "capacityBackoffSeconds": self.capacity_backoff_s,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> PoolState:
        if not data:
            return cls()
        return cls(
            recommendations=[(float(t), int(r)) for t, r in data.get("recommendations") or []],
            demand={k: [(float(t), float(y)) for t, y in v] for k, v in (data.get("demand") or {}).items()},
            first_seen=data.get("firstSeen"),
            last_scale_time=data.get("lastScaleTime"),
            last_scale_up_time=data.get("lastScaleUpTime"),
            scale_up_target=data.get("scaleUpTarget"),
            capacity_cap=data.get("capacityCap"),
            capacity_cap_until=data.get("capacityCapUntil"),
            capacity_backoff_s=data.get("capacityBackoffSeconds"),
        )


@dataclass(frozen=True)
class SignalReading:
    """One signal's value, target and the replica count it alone would ask for."""

    signal: str
    value: float
    target: float
    recommendation: int
    # Per-replica value expected at the end of the startup lead time, when the signal is rising.
    forecast: float | None = None


@dataclass(frozen=True)
class PoolDecision:
    pool: str
    role: Role
    time: float
    desired: int
    previous: int
    current: int
    ready: int
    direction: Direction
    signal: str
    value: float | None
    target: float | None
    reason: str
    metrics_available: bool
    # What limited the decision, if anything: stabilization, starting, capacity, bounds, ratio, step,
    # metrics, partial-metrics.
    limited_by: str | None = None
    readings: tuple[SignalReading, ...] = ()
