"""The scaling policy: a pure function from (time, observations, config, state) to decisions.

Shape of one tick, per pool (`decide_pool`, one function per stage):
  0. first what acts whatever the metrics say: replicas outside the spec's bounds are clamped
     (`_outside_bounds`), pods Pending-unschedulable too long cap the pool (`_cap_unschedulable`);
  1. metrics missing, stale or from no pod -> hold (never scale on absent data), reason for a
     condition (`_without_metrics`);
  2. each signal gives the replica count it alone would want (ratio signals: ceil(base * value/target)
     outside a tolerance band, sized for the lead-time forecast; latency signals: +1 above target,
     -1 well below it, else hold); the pool's recommendation is the largest, and that signal is
     "the driver" (`_signals`);
  3. stabilisation: scale up only to the smallest recommendation seen in the up window, down only to
     the largest seen in the (longer) down window, and only once that much history exists
     (`_stabilise`);
  4. guards: no new scale-up while the last one's replicas are still starting (lead time = measured
     startup duration), the capacity cap, bounded steps, no scale-down on partial data
     (`_guarded`, `_scale_up`, `_scale_down`);
then across pools the prefill:decode ratio bounds, preferring to raise the smaller side.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from .types import (
    SIGNAL_ITL,
    SIGNAL_KV_CACHE,
    SIGNAL_NONE,
    SIGNAL_PROMPT_BACKLOG,
    SIGNAL_RUNNING,
    SIGNAL_TTFT,
    SIGNAL_WAITING,
    AutoscalerConfig,
    Direction,
    PoolConfig,
    PoolDecision,
    PoolInput,
    PoolMetrics,
    PoolState,
    SignalReading,
)

_ROLE_SIGNALS: dict[str, tuple[str, ...]] = {
    "prefill": (SIGNAL_PROMPT_BACKLOG, SIGNAL_TTFT, SIGNAL_WAITING),
    "decode": (SIGNAL_KV_CACHE, SIGNAL_RUNNING, SIGNAL_ITL, SIGNAL_WAITING),
    "unified": (
        SIGNAL_PROMPT_BACKLOG,
        SIGNAL_TTFT,
        SIGNAL_KV_CACHE,
        SIGNAL_RUNNING,
        SIGNAL_ITL,
        SIGNAL_WAITING,
    ),
}


def _clamp(value: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, value))


def metrics_problem(metrics: PoolMetrics | None, now: float, config: AutoscalerConfig) -> str | None:
    """Why these metrics cannot drive a decision, or None when they can."""
    if metrics is None:
        return "no metrics collected for this pool"
    if metrics.pods_reporting <= 0:
        detail = f" ({metrics.errors[0]})" if metrics.errors else ""
        return f"no pod answered the metrics scrape{detail}"
    age = now - metrics.observed_at
    if age > config.max_metrics_age:
        return f"metrics are stale ({age:.0f}s old, limit {config.max_metrics_age:.0f}s)"
    return None


def _ratio_reading(
    signal: str,
    value: float,
    target: float,
    base: int,
    current: int,
    tolerance: float,
    forecast: float | None = None,
) -> SignalReading:
    # Size for the larger of now and the forecast at the end of the lead time.
    sized = max(value, forecast) if forecast is not None else value
    ratio = sized / target
    # Inside the tolerance band: no change. The epsilon keeps float noise on exact multiples
    # (2.0000000001) from rounding up a whole replica.
    rec = current if abs(ratio - 1.0) <= tolerance else math.ceil(base * ratio - 1e-9)
    return SignalReading(signal, value, target, rec, forecast)


def forecast_total(
    samples: list[tuple[float, float]], now: float, lead_s: float, config: AutoscalerConfig
) -> float | None:
    """The pool-wide total of a signal expected `lead_s` from now, from a least-squares line over
    recent samples; None unless the rise is significant (|t| of the slope >= forecast_min_t), so
    noise on a steady load never forecasts growth."""
    n = len(samples)
    if n < config.forecast_min_samples:
        return None
    mean_t = sum(t for t, _ in samples) / n
    mean_y = sum(y for _, y in samples) / n
    sxx = sum((t - mean_t) ** 2 for t, _ in samples)
    if sxx <= 0:
        return None
    slope = sum((t - mean_t) * (y - mean_y) for t, y in samples) / sxx
    if slope <= 0:
        return None
    residual = sum((y - (mean_y + slope * (t - mean_t))) ** 2 for t, y in samples)
    stderr = math.sqrt(residual / (n - 2) / sxx) if n > 2 else 0.0
    if stderr > 0 and slope / stderr < config.forecast_min_t:
        return None
    return mean_y + slope * (now + lead_s - mean_t)


def _latency_reading(
    signal: str, value: float, target: float, current: int, config: AutoscalerConfig
) -> SignalReading:
    # Latency is not proportional to replicas (it has a floor), so it nudges rather than sizes.
    if value > target * (1.0 + config.tolerance):
        rec = current + 1
    elif value < target * config.latency_scale_down_fraction:
        rec = current - 1
    else:
        rec = current
    return SignalReading(signal, value, target, rec)


# A derived backlog target below this is noise (a nearly idle pool's prefill rate), not capacity.
_MIN_DERIVED_BACKLOG = 1024.0


def backlog_target(pool: PoolConfig, metrics: PoolMetrics) -> float | None:
    """Prompt tokens one replica may have waiting: explicit, else what it prefills within the TTFT
    target at the measured rate (the rate approaches capacity exactly when a backlog builds)."""
    if pool.prompt_tokens_waiting_target:
        return pool.prompt_tokens_waiting_target
    if pool.ttft_target_s and metrics.prompt_tokens_per_s and metrics.pods_reporting > 0:
        per_replica = metrics.prompt_tokens_per_s / metrics.pods_reporting
        return max(_MIN_DERIVED_BACKLOG, per_replica * pool.ttft_target_s)
    return pool.prompt_tokens_waiting_default


def ratio_values(inp: PoolInput, pool: PoolConfig, metrics: PoolMetrics) -> list[tuple[str, float, float]]:
    """(signal, per-replica value, per-replica target) of the pool's configured ratio signals."""
    # Per-replica values are averaged over the pods that reported: those are the ones serving.
    base = max(1, metrics.pods_reporting)
    out: list[tuple[str, float, float]] = []
    for signal in _ROLE_SIGNALS[inp.role]:
        if signal == SIGNAL_PROMPT_BACKLOG:
            target = backlog_target(pool, metrics)
            if target:
                out.append((signal, metrics.prompt_tokens_waiting / base, target))
        elif signal == SIGNAL_WAITING and pool.requests_waiting_target:
            out.append((signal, metrics.requests_waiting / base, pool.requests_waiting_target))
        elif signal == SIGNAL_RUNNING and pool.requests_running_target:
            out.append((signal, metrics.requests_running / base, pool.requests_running_target))
        elif signal == SIGNAL_KV_CACHE and pool.kv_cache_usage_target:
            out.append((signal, metrics.kv_cache_usage_mean, pool.kv_cache_usage_target))
    return out


def evaluate_signals(
    inp: PoolInput,
    pool: PoolConfig,
    config: AutoscalerConfig,
    metrics: PoolMetrics,
    forecasts: Mapping[str, float] | None = None,
) -> list[SignalReading]:
    """Every configured signal of this pool's role with the replica count it alone asks for;
    `forecasts` holds per-replica values expected at the end of the lead time (ratio signals)."""
    base = max(1, metrics.pods_reporting)
    current = inp.replicas.desired
    forecasts = forecasts or {}
    readings = [
        _ratio_reading(signal, value, target, base, current, config.tolerance, forecasts.get(signal))
        for signal, value, target in ratio_values(inp, pool, metrics)
    ]
    if SIGNAL_TTFT in _ROLE_SIGNALS[inp.role] and pool.ttft_target_s and metrics.ttft_seconds is not None:
        readings.append(
            _latency_reading(SIGNAL_TTFT, metrics.ttft_seconds, pool.ttft_target_s, current, config)
        )
    if SIGNAL_ITL in _ROLE_SIGNALS[inp.role] and pool.itl_target_s and metrics.itl_seconds is not None:
        readings.append(_latency_reading(SIGNAL_ITL, metrics.itl_seconds, pool.itl_target_s, current, config))
    return readings


def _window(state: PoolState, now: float, seconds: float) -> list[int]:
    return [r for t, r in state.recommendations if t >= now - seconds - 1e-6]


def _describe(reading: SignalReading) -> str:
    text = f"{reading.signal} {reading.value:.3g} vs target {reading.target:.3g}"
    if reading.forecast is not None and reading.forecast > reading.value:
        text += f" (rising: {reading.forecast:.3g} expected within the startup lead time)"
    return text


@dataclass
class _Tick:
    """One pool's tick: what it decides from, and the state it builds (a copy of the caller's)."""

    name: str
    inp: PoolInput
    pool: PoolConfig
    config: AutoscalerConfig
    state: PoolState
    now: float

    @property
    def prev(self) -> int:
        return self.inp.replicas.desired

    @property
    def lo(self) -> int:
        return self.pool.min_replicas

    @property
    def hi(self) -> int:
        return max(self.pool.min_replicas, self.pool.max_replicas)

    @property
    def lead(self) -> float:
        """Startup lead time: measured for this pool, else the configured default."""
        return self.inp.startup_seconds or self.config.default_startup_s

    def decision(
        self,
        desired: int,
        reason: str,
        *,
        driven: _Driven | None = None,
        metrics_available: bool = True,
        limited_by: str | None = None,
    ) -> PoolDecision:
        prev, driver = self.prev, driven.driver if driven else None
        direction: Direction = "up" if desired > prev else "down" if desired < prev else "hold"
        return PoolDecision(
            pool=self.name,
            role=self.inp.role,
            time=self.now,
            desired=desired,
            previous=prev,
            current=self.inp.replicas.current,
            ready=self.inp.replicas.ready,
            direction=direction,
            signal=driver.signal if driver else SIGNAL_NONE,
            value=driver.value if driver else None,
            target=driver.target if driver else None,
            reason=reason,
            metrics_available=metrics_available,
            limited_by=limited_by,
            readings=tuple(driven.readings) if driven else (),
        )

    def metrics_usable(self) -> bool:
        return metrics_problem(self.inp.metrics, self.now, self.config) is None


@dataclass(frozen=True)
class _Driven:
    """Stage 2's outcome: the readings and the one that drives (the largest recommendation)."""

    readings: list[SignalReading]
    driver: SignalReading

    @property
    def why(self) -> str:
        return _describe(self.driver)


@dataclass(frozen=True)
class _Windows:
    """Stage 3's outcome: where the stabilisation windows allow the pool to go."""

    recommendation: int  # the driver's, within bounds
    up_to: int
    down_to: int
    history_s: float


def decide_pool(
    name: str,
    inp: PoolInput,
    pool: PoolConfig,
    config: AutoscalerConfig,
    state: PoolState,
    now: float,
) -> tuple[PoolDecision, PoolState]:
    """One pool's decision before cross-pool ratio bounds, in the stages of the module docstring.
    Returns a new state; the input is untouched."""
    tick = _Tick(name, inp, pool, config, replace(state, recommendations=list(state.recommendations)), now)
    if tick.state.first_seen is None:
        tick.state.first_seen = now
    cap = _capacity_cap(tick)
    early = _outside_bounds(tick) or _cap_unschedulable(tick) or _without_metrics(tick)
    if early is not None:
        return early, tick.state
    assert inp.metrics is not None  # _without_metrics held otherwise
    driven = _signals(tick, inp.metrics)
    if driven is None:
        return tick.decision(
            tick.prev, f"holding at {tick.prev}: no signal configured for this pool"
        ), tick.state
    windows = _stabilise(tick, driven.driver)
    return _guarded(tick, cap, driven, windows, inp.metrics), tick.state


def _capacity_cap(tick: _Tick) -> int | None:
    """The capacity cap in force. It binds until capacity_cap_until; the backoff resets only once
    the pool has grown past the old cap with every pod ready (GPUs were found after all)."""
    state, reps = tick.state, tick.inp.replicas
    if state.capacity_cap_until is not None and tick.now >= state.capacity_cap_until:
        state.capacity_cap_until = None
    if (
        state.capacity_cap is not None
        and state.capacity_cap_until is None
        and reps.pending_unschedulable == 0
        and reps.ready > state.capacity_cap
    ):
        state.capacity_cap = None
        state.capacity_backoff_s = None
    return state.capacity_cap if state.capacity_cap_until is not None else None


def _outside_bounds(tick: _Tick) -> PoolDecision | None:
    """Bounds changed by the user act at once, whatever the metrics say."""
    prev, lo, hi = tick.prev, tick.lo, tick.hi
    if lo <= prev <= hi:
        return None
    return tick.decision(
        _clamp(prev, lo, hi),
        f"replicas {prev} outside bounds [{lo}, {hi}]",
        limited_by="bounds",
        metrics_available=tick.metrics_usable(),
    )


def _cap_unschedulable(tick: _Tick) -> PoolDecision | None:
    """Pods the scheduler cannot place for too long: stop asking for them (reported, retried
    later). Not when minReplicas itself asks for them: then there is nothing to give back."""
    reps, config, state, prev = tick.inp.replicas, tick.config, tick.state, tick.prev
    new_cap = max(tick.lo, prev - reps.pending_unschedulable)
    if not (
        reps.pending_unschedulable > 0
        and reps.unschedulable_for >= config.pending_timeout_s
        and new_cap < prev
    ):
        return None
    backoff = (
        config.capacity_backoff_s
        if state.capacity_backoff_s is None
        else min(config.capacity_backoff_max_s, state.capacity_backoff_s * 2)
    )
    state.capacity_cap, state.capacity_cap_until, state.capacity_backoff_s = (
        new_cap,
        tick.now + backoff,
        backoff,
    )
    state.scale_up_target = None
    return tick.decision(
        new_cap,
        f"{reps.pending_unschedulable} pod(s) Pending unschedulable for {reps.unschedulable_for:.0f}s "
        f"(no free GPUs?): capped at {new_cap} replicas, retry in {backoff:.0f}s",
        limited_by="capacity",
        metrics_available=tick.metrics_usable(),
    )


def _without_metrics(tick: _Tick) -> PoolDecision | None:
    """Stage 1: metrics missing, stale or from no pod hold the pool."""
    problem = metrics_problem(tick.inp.metrics, tick.now, tick.config)
    if problem is None and tick.inp.metrics is not None:
        return None
    return tick.decision(
        tick.prev, f"holding at {tick.prev}: {problem}", metrics_available=False, limited_by="metrics"
    )


def _signals(tick: _Tick, metrics: PoolMetrics) -> _Driven | None:
    """Stage 2: every configured signal's recommendation, ratio signals sized for the lead-time
    forecast; None when the pool has no signal. Remembers each ratio signal's pool-wide total and,
    if it rises significantly, sizes for where it will be when a pod started now becomes ready."""
    config, now, lead = tick.config, tick.now, tick.lead
    base = max(1, metrics.pods_reporting)
    forecasts: dict[str, float] = {}
    demand = {k: list(v) for k, v in tick.state.demand.items()}
    horizon = min(max(lead, config.forecast_min_window_s), config.forecast_max_window_s)
    for signal, value, _target in ratio_values(tick.inp, tick.pool, metrics):
        series = [(t, y) for t, y in demand.get(signal, []) if t >= now - horizon]
        series.append((now, value * base))
        demand[signal] = series
        if config.forecast:
            total = forecast_total(series, now, lead, config)
            if total is not None:
                # Never more than double the measured load: a forecast nudges, it does not invent.
                forecasts[signal] = min(total, 2 * value * base) / base
    tick.state.demand = demand
    readings = evaluate_signals(tick.inp, tick.pool, config, metrics, forecasts)
    if not readings:
        return None
    return _Driven(readings, max(readings, key=lambda r: r.recommendation))


def _stabilise(tick: _Tick, driver: SignalReading) -> _Windows:
    """Stage 3: remember the recommendation; up only to the smallest of the up window, down only to
    the largest of the down window. A window only counts once it is covered by history (also after
    an operator restart)."""
    config, state, now = tick.config, tick.state, tick.now
    # Signals size the pods that serve; a pod failing its output self-test holds a replica and serves
    # nothing, so the pool needs one more replica for each while it fails.
    rec = _clamp(driver.recommendation + tick.inp.replicas.output_failing, tick.lo, tick.hi)
    state.recommendations.append((now, rec))
    keep = max(config.scale_up_stabilization_s, config.scale_down_stabilization_s) + config.interval_s
    state.recommendations = [(t, r) for t, r in state.recommendations if t >= now - keep]
    history = now - (state.first_seen if state.first_seen is not None else now)
    up_to = min(_window(state, now, config.scale_up_stabilization_s))
    if history + 1e-6 < config.scale_up_stabilization_s:
        up_to = min(up_to, tick.prev)
    down_to = max(_window(state, now, config.scale_down_stabilization_s))
    return _Windows(rec, up_to, down_to, history)


def _guarded(
    tick: _Tick, cap: int | None, driven: _Driven, windows: _Windows, metrics: PoolMetrics
) -> PoolDecision:
    """Stage 4: the guards between what the windows allow and the decision."""
    state, reps, prev = tick.state, tick.inp.replicas, tick.prev
    # In-flight scale-up: done once enough pods are ready (or started and failing their self-test:
    # they will not become ready by waiting), or if we have since scaled below it.
    if state.scale_up_target is not None and (
        reps.ready + reps.output_failing >= state.scale_up_target or prev < state.scale_up_target
    ):
        state.scale_up_target = None
    if windows.up_to > prev:
        return _scale_up(tick, cap, driven, windows.up_to)
    if windows.down_to < prev:
        return _scale_down(tick, driven, windows, metrics)
    rec = windows.recommendation
    if rec > prev and cap is not None and prev >= cap:
        return _capped(tick, driven, rec, cap)
    limited = "stabilization" if rec != prev else None
    return tick.decision(
        prev,
        f"holding at {prev}: {driven.why}" + (f" (recommends {rec}, not yet stable)" if limited else ""),
        driven=driven,
        limited_by=limited,
    )


def _capped(tick: _Tick, driven: _Driven, wants: int, cap: int) -> PoolDecision:
    return tick.decision(
        tick.prev,
        f"{driven.why} wants {wants}, but capped at {cap} until pods can be scheduled",
        driven=driven,
        limited_by="capacity",
    )


def _scale_up(tick: _Tick, cap: int | None, driven: _Driven, up_to: int) -> PoolDecision:
    """Up to the capacity cap, not while the last scale-up's replicas are still starting (until
    they are stuck), by a bounded step."""
    config, state, prev = tick.config, tick.state, tick.prev
    target, limited = up_to, None
    if cap is not None and target > cap:
        target, limited = cap, "capacity"
        if target <= prev:
            return _capped(tick, driven, up_to, cap)
    if state.scale_up_target is not None and state.last_scale_up_time is not None:
        elapsed = tick.now - state.last_scale_up_time
        if elapsed < tick.lead * config.stuck_startup_factor:
            waiting = max(0, state.scale_up_target - tick.inp.replicas.ready)
            return tick.decision(
                prev,
                f"{driven.why} wants {up_to}; waiting for {waiting} replica(s) still starting "
                f"({elapsed:.0f}s of ~{tick.lead:.0f}s lead time)",
                driven=driven,
                limited_by="starting",
            )
    step = max(config.scale_up_max_pods, math.ceil(prev * config.scale_up_max_percent / 100.0))
    if target > prev + step:
        target, limited = prev + step, "step"
    return tick.decision(
        target,
        f"scale up {prev}->{target}: {driven.why}"
        + (f" (wants {up_to}, step-limited)" if limited == "step" else ""),
        driven=driven,
        limited_by=limited,
    )


def _scale_down(tick: _Tick, driven: _Driven, windows: _Windows, metrics: PoolMetrics) -> PoolDecision:
    """Down once the down window is covered by history, never on partial data, one step at a time."""
    config, prev, down_to, history = tick.config, tick.prev, windows.down_to, windows.history_s
    if history + 1e-6 < config.scale_down_stabilization_s:
        return tick.decision(
            prev,
            f"holding at {prev}: {driven.why} suggests {down_to}, but scale-down waits for "
            f"{config.scale_down_stabilization_s:.0f}s of history ({history:.0f}s so far)",
            driven=driven,
            limited_by="stabilization",
        )
    if metrics.pods_reporting < metrics.pods_expected:
        return tick.decision(
            prev,
            f"holding at {prev}: only {metrics.pods_reporting}/{metrics.pods_expected} pods reported "
            "metrics; not scaling down on partial data",
            driven=driven,
            limited_by="partial-metrics",
        )
    target = max(down_to, prev - config.scale_down_max_pods)
    return tick.decision(
        target,
        f"scale down {prev}->{target}: highest recommendation over "
        f"{config.scale_down_stabilization_s:.0f}s is {down_to} ({driven.why})",
        driven=driven,
        limited_by="step" if target != down_to else None,
    )


def _apply_ratio(
    decisions: dict[str, PoolDecision],
    pools: Mapping[str, PoolConfig],
    config: AutoscalerConfig,
) -> None:
    """Keep prefill:decode within [min, max], raising the smaller side first (never cut capacity
    for a ratio unless the other side is at its maximum)."""
    lo_ratio, hi_ratio = config.prefill_decode_ratio_min, config.prefill_decode_ratio_max
    if lo_ratio is None and hi_ratio is None:
        return
    p_name = next((n for n, d in decisions.items() if d.role == "prefill"), None)
    d_name = next((n for n, d in decisions.items() if d.role == "decode"), None)
    if p_name is None or d_name is None:
        return
    p, d = decisions[p_name].desired, decisions[d_name].desired
    p_cfg, d_cfg = pools[p_name], pools[d_name]
    new_p, new_d = p, d
    if hi_ratio is not None and d > 0 and p / d > hi_ratio + 1e-9:
        need = math.ceil(p / hi_ratio - 1e-9)
        if need <= d_cfg.max_replicas:
            new_d = need
        else:
            new_d = d_cfg.max_replicas
            new_p = max(p_cfg.min_replicas, math.floor(new_d * hi_ratio + 1e-9))
    elif lo_ratio is not None and d > 0 and p / d < lo_ratio - 1e-9:
        need = math.ceil(d * lo_ratio - 1e-9)
        if need <= p_cfg.max_replicas:
            new_p = need
        else:
            new_p = p_cfg.max_replicas
            new_d = max(d_cfg.min_replicas, math.floor(new_p / lo_ratio + 1e-9))
    for pool_name, old, new in ((p_name, p, new_p), (d_name, d, new_d)):
        if new == old:
            continue
        dec = decisions[pool_name]
        direction: Direction = "up" if new > dec.previous else "down" if new < dec.previous else "hold"
        decisions[pool_name] = replace(
            dec,
            desired=new,
            direction=direction,
            limited_by="ratio",
            reason=f"{dec.reason}; prefill:decode ratio bounds "
            f"[{lo_ratio if lo_ratio is not None else '-'}, {hi_ratio if hi_ratio is not None else '-'}] "
            f"set {pool_name} to {new}",
        )


def decide(
    now: float,
    inputs: Mapping[str, PoolInput],
    pools: Mapping[str, PoolConfig],
    config: AutoscalerConfig,
    states: Mapping[str, PoolState],
) -> tuple[dict[str, PoolDecision], dict[str, PoolState]]:
    """Decide every pool of one deployment. Pure: returns decisions and the new per-pool state."""
    decisions: dict[str, PoolDecision] = {}
    new_states: dict[str, PoolState] = {}
    for name, inp in inputs.items():
        decisions[name], new_states[name] = decide_pool(
            name, inp, pools[name], config, states.get(name) or PoolState(), now
        )
    _apply_ratio(decisions, pools, config)
    for name, dec in decisions.items():
        st = new_states[name]
        if dec.desired != dec.previous:
            st.last_scale_time = now
            if dec.desired > dec.previous:
                st.last_scale_up_time = now
                st.scale_up_target = dec.desired
    return decisions, new_states
