"""The scaling policy: a pure function from (time, observations, config, state) to decisions.

Shape of one tick, per pool:
  1. metrics missing, stale or from no pod -> hold (never scale on absent data), reason for a condition;
  2. each signal gives the replica count it alone would want (ratio signals: ceil(base * value/target)
     outside a tolerance band; latency signals: +1 above target, -1 well below it, else hold); the
     pool's recommendation is the largest, and that signal is "the driver";
  3. stabilisation: scale up only to the smallest recommendation seen in the up window, down only to
     the largest seen in the (longer) down window, and only once that much history exists;
  4. guards: no new scale-up while the last one's replicas are still starting (lead time = measured
     startup duration), a capacity cap when pods stay Pending-unschedulable, bounded steps, min/max;
then across pools the prefill:decode ratio bounds, preferring to raise the smaller side.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

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


def _decision(
    name: str,
    inp: PoolInput,
    now: float,
    desired: int,
    reason: str,
    *,
    driver: SignalReading | None,
    readings: list[SignalReading],
    metrics_available: bool = True,
    limited_by: str | None = None,
) -> PoolDecision:
    prev = inp.replicas.desired
    direction: Direction = "up" if desired > prev else "down" if desired < prev else "hold"
    return PoolDecision(
        pool=name,
        role=inp.role,
        time=now,
        desired=desired,
        previous=prev,
        current=inp.replicas.current,
        ready=inp.replicas.ready,
        direction=direction,
        signal=driver.signal if driver else SIGNAL_NONE,
        value=driver.value if driver else None,
        target=driver.target if driver else None,
        reason=reason,
        metrics_available=metrics_available,
        limited_by=limited_by,
        readings=tuple(readings),
    )


def _describe(reading: SignalReading) -> str:
    text = f"{reading.signal} {reading.value:.3g} vs target {reading.target:.3g}"
    if reading.forecast is not None and reading.forecast > reading.value:
        text += f" (rising: {reading.forecast:.3g} expected within the startup lead time)"
    return text


def decide_pool(
    name: str,
    inp: PoolInput,
    pool: PoolConfig,
    config: AutoscalerConfig,
    state: PoolState,
    now: float,
) -> tuple[PoolDecision, PoolState]:
    """One pool's decision before cross-pool ratio bounds. Returns a new state; the input is untouched."""
    state = replace(state, recommendations=list(state.recommendations))
    if state.first_seen is None:
        state.first_seen = now
    reps = inp.replicas
    prev = reps.desired
    lo, hi = pool.min_replicas, max(pool.min_replicas, pool.max_replicas)

    # Capacity cap: it binds until capacity_cap_until; the backoff resets only once the pool has
    # grown past the old cap with every pod ready (GPUs were found after all).
    if state.capacity_cap_until is not None and now >= state.capacity_cap_until:
        state.capacity_cap_until = None
    if (
        state.capacity_cap is not None
        and state.capacity_cap_until is None
        and reps.pending_unschedulable == 0
        and reps.ready > state.capacity_cap
    ):
        state.capacity_cap = None
        state.capacity_backoff_s = None
    cap = state.capacity_cap if state.capacity_cap_until is not None else None

    # Bounds changed by the user act at once, whatever the metrics say.
    if prev < lo or prev > hi:
        desired = _clamp(prev, lo, hi)
        return _decision(
            name,
            inp,
            now,
            desired,
            f"replicas {prev} outside bounds [{lo}, {hi}]",
            driver=None,
            readings=[],
            limited_by="bounds",
            metrics_available=metrics_problem(inp.metrics, now, config) is None,
        ), state

    # Pods the scheduler cannot place for too long: stop asking for them (reported, retried later).
    # Not when minReplicas itself asks for them: then there is nothing to give back.
    new_cap = max(lo, prev - reps.pending_unschedulable)
    if (
        reps.pending_unschedulable > 0
        and reps.unschedulable_for >= config.pending_timeout_s
        and new_cap < prev
    ):
        backoff = (
            config.capacity_backoff_s
            if state.capacity_backoff_s is None
            else min(config.capacity_backoff_max_s, state.capacity_backoff_s * 2)
        )
        state.capacity_cap, state.capacity_cap_until, state.capacity_backoff_s = (
            new_cap,
            now + backoff,
            backoff,
        )
        state.scale_up_target = None
        return _decision(
            name,
            inp,
            now,
            new_cap,
            f"{reps.pending_unschedulable} pod(s) Pending unschedulable for {reps.unschedulable_for:.0f}s "
            f"(no free GPUs?): capped at {new_cap} replicas, retry in {backoff:.0f}s",
            driver=None,
            readings=[],
            limited_by="capacity",
            metrics_available=metrics_problem(inp.metrics, now, config) is None,
        ), state

    problem = metrics_problem(inp.metrics, now, config)
    if problem is not None or inp.metrics is None:
        return _decision(
            name,
            inp,
            now,
            prev,
            f"holding at {prev}: {problem}",
            driver=None,
            readings=[],
            metrics_available=False,
            limited_by="metrics",
        ), state
    metrics = inp.metrics

    # Lead-time forecast: remember each ratio signal's pool-wide total and, if it rises
    # significantly, size for where it will be when a pod started now becomes ready.
    lead = inp.startup_seconds or config.default_startup_s
    base = max(1, metrics.pods_reporting)
    forecasts: dict[str, float] = {}
    demand = {k: list(v) for k, v in state.demand.items()}
    horizon = min(max(lead, config.forecast_min_window_s), config.forecast_max_window_s)
    for signal, value, _target in ratio_values(inp, pool, metrics):
        series = [(t, y) for t, y in demand.get(signal, []) if t >= now - horizon]
        series.append((now, value * base))
        demand[signal] = series
        if config.forecast:
            total = forecast_total(series, now, lead, config)
            if total is not None:
                # Never more than double the measured load: a forecast nudges, it does not invent.
                forecasts[signal] = min(total, 2 * value * base) / base
    state.demand = demand
    readings = evaluate_signals(inp, pool, config, metrics, forecasts)
    if not readings:
        return _decision(
            name,
            inp,
            now,
            prev,
            f"holding at {prev}: no signal configured for this pool",
            driver=None,
            readings=[],
        ), state
    driver = max(readings, key=lambda r: r.recommendation)
    rec = _clamp(driver.recommendation, lo, hi)
    state.recommendations.append((now, rec))
    keep = max(config.scale_up_stabilization_s, config.scale_down_stabilization_s) + config.interval_s
    state.recommendations = [(t, r) for t, r in state.recommendations if t >= now - keep]

    # A window only counts once it is covered by history (also after an operator restart).
    history = now - state.first_seen
    up_to = min(_window(state, now, config.scale_up_stabilization_s))
    if history + 1e-6 < config.scale_up_stabilization_s:
        up_to = min(up_to, prev)
    down_to = max(_window(state, now, config.scale_down_stabilization_s))
    why = _describe(driver)

    # In-flight scale-up: done once enough pods are ready, or if we have since scaled below it.
    if state.scale_up_target is not None and (
        reps.ready >= state.scale_up_target or prev < state.scale_up_target
    ):
        state.scale_up_target = None

    if up_to > prev:
        target, limited = up_to, None
        if cap is not None and target > cap:
            target, limited = cap, "capacity"
            if target <= prev:
                return _decision(
                    name,
                    inp,
                    now,
                    prev,
                    f"{why} wants {up_to}, but capped at {cap} until pods can be scheduled",
                    driver=driver,
                    readings=readings,
                    limited_by="capacity",
                ), state
        if state.scale_up_target is not None and state.last_scale_up_time is not None:
            lead = inp.startup_seconds or config.default_startup_s
            elapsed = now - state.last_scale_up_time
            if elapsed < lead * config.stuck_startup_factor:
                waiting = max(0, state.scale_up_target - reps.ready)
                return _decision(
                    name,
                    inp,
                    now,
                    prev,
                    f"{why} wants {up_to}; waiting for {waiting} replica(s) still starting "
                    f"({elapsed:.0f}s of ~{lead:.0f}s lead time)",
                    driver=driver,
                    readings=readings,
                    limited_by="starting",
                ), state
        step = max(config.scale_up_max_pods, math.ceil(prev * config.scale_up_max_percent / 100.0))
        if target > prev + step:
            target, limited = prev + step, "step"
        return _decision(
            name,
            inp,
            now,
            target,
            f"scale up {prev}->{target}: {why}"
            + (f" (wants {up_to}, step-limited)" if limited == "step" else ""),
            driver=driver,
            readings=readings,
            limited_by=limited,
        ), state

    if down_to < prev:
        if history + 1e-6 < config.scale_down_stabilization_s:
            return _decision(
                name,
                inp,
                now,
                prev,
                f"holding at {prev}: {why} suggests {down_to}, but scale-down waits for "
                f"{config.scale_down_stabilization_s:.0f}s of history ({history:.0f}s so far)",
                driver=driver,
                readings=readings,
                limited_by="stabilization",
            ), state
        if metrics.pods_reporting < metrics.pods_expected:
            return _decision(
                name,
                inp,
                now,
                prev,
                f"holding at {prev}: only {metrics.pods_reporting}/{metrics.pods_expected} pods reported "
                "metrics; not scaling down on partial data",
                driver=driver,
                readings=readings,
                limited_by="partial-metrics",
            ), state
        target = max(down_to, prev - config.scale_down_max_pods)
        limited = "step" if target != down_to else None
        return _decision(
            name,
            inp,
            now,
            target,
            f"scale down {prev}->{target}: highest recommendation over "
            f"{config.scale_down_stabilization_s:.0f}s is {down_to} ({why})",
            driver=driver,
            readings=readings,
            limited_by=limited,
        ), state

    limited = "stabilization" if rec != prev else None
    if rec > prev and cap is not None and prev >= cap:
        return _decision(
            name,
            inp,
            now,
            prev,
            f"{why} wants {rec}, but capped at {cap} until pods can be scheduled",
            driver=driver,
            readings=readings,
            limited_by="capacity",
        ), state
    return _decision(
        name,
        inp,
        now,
        prev,
        f"holding at {prev}: {why}" + (f" (recommends {rec}, not yet stable)" if limited else ""),
        driver=driver,
        readings=readings,
        limited_by=limited,
    ), state


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
