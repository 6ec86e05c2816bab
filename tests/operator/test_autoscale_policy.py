"""The autoscaling policy over synthetic metric series."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import pytest
from sovereign_operator.autoscale import (
    AutoscalerConfig,
    PoolConfig,
    PoolDecision,
    PoolInput,
    PoolMetrics,
    PoolReplicas,
    PoolState,
    decide,
)
from sovereign_operator.autoscale.policy import forecast_total

INTERVAL = 15.0
# The replays below are written for a short up window (the spec's default is 180 s).
UP_WINDOW = 30.0
DECODE = PoolConfig(
    min_replicas=1,
    max_replicas=10,
    ttft_target_s=None,
    itl_target_s=None,
    kv_cache_usage_target=0.7,
    prompt_tokens_waiting_target=None,
)
PREFILL = PoolConfig(
    min_replicas=1,
    max_replicas=10,
    ttft_target_s=1.0,
    itl_target_s=None,
    kv_cache_usage_target=None,
    prompt_tokens_waiting_target=4000.0,
)


def kv_metrics(now: float, pods: int, load: float) -> PoolMetrics:
    """Decode pool whose total KV demand is `load` pods' worth at 100 % usage, spread over `pods`."""
    return PoolMetrics(
        observed_at=now,
        pods_reporting=pods,
        pods_expected=pods,
        kv_cache_usage_mean=load / pods,
        kv_cache_usage_max=load / pods,
    )


def run(
    series: Callable[[float, int], PoolMetrics | None],
    ticks: int,
    *,
    pool: PoolConfig = DECODE,
    config: AutoscalerConfig | None = None,
    start: int = 2,
    startup_ticks: int = 0,
    role: str = "decode",
) -> list[PoolDecision]:
    """Replay a series; pods become ready `startup_ticks` ticks after they are asked for."""
    config = config or AutoscalerConfig(interval_s=INTERVAL, scale_up_stabilization_s=UP_WINDOW)
    state: dict[str, PoolState] = {}
    desired = start
    ready_at: list[float] = [0.0] * start
    out: list[PoolDecision] = []
    for i in range(ticks):
        now = i * INTERVAL
        ready = sum(1 for t in ready_at if t <= now)
        inp = PoolInput(
            role=role,  # type: ignore[arg-type]
            replicas=PoolReplicas(desired=desired, current=desired, ready=ready, starting=desired - ready),
            metrics=series(now, max(1, ready)),
            startup_seconds=startup_ticks * INTERVAL or None,
        )
        decisions, state = decide(now, {"p": inp}, {"p": pool}, config, state)
        dec = decisions["p"]
        out.append(dec)
        if dec.desired > desired:
            ready_at += [now + startup_ticks * INTERVAL] * (dec.desired - desired)
        else:
            ready_at = ready_at[: dec.desired]
        desired = dec.desired
    return out


def direction_changes(decisions: list[PoolDecision]) -> int:
    dirs = [d.direction for d in decisions if d.direction != "hold"]
    return sum(1 for a, b in itertools.pairwise(dirs) if a != b)


def test_steps_up_under_load_after_the_up_window() -> None:
    decs = run(lambda now, pods: kv_metrics(now, pods, load=3.5), ticks=12)
    # 30 s window: the first scale-up comes once three consecutive samples agree, and by one step.
    assert [d.desired for d in decs[:2]] == [2, 2]
    assert decs[2].direction == "up" and decs[2].desired == 3
    assert decs[2].signal == "kv_cache_usage"
    assert "scale up 2->3" in decs[2].reason
    # 3.5 / 0.7 = 5 replicas needed; it gets there and stays.
    assert decs[-1].desired == 5
    assert max(d.desired for d in decs) == 5


def test_steps_down_only_after_the_down_window() -> None:
    decs = run(lambda now, pods: kv_metrics(now, pods, load=0.3), ticks=60, start=4)
    first_down = next(i for i, d in enumerate(decs) if d.direction == "down")
    assert first_down * INTERVAL >= 300.0
    assert all(d.limited_by == "stabilization" for d in decs[:first_down])
    # Bounded step: -1 at a time, and each further step waits for the window again.
    downs = [d for d in decs if d.direction == "down"]
    assert all(d.previous - d.desired == 1 for d in downs)
    assert decs[-1].desired == 1  # min replicas


def test_no_oscillation_under_steady_noisy_load() -> None:
    for seed in range(5):
        rng = random.Random(seed)
        # Load sits near a rounding boundary (2.05 / 0.7 ≈ 2.9 replicas) with ±15 % noise.
        decs = run(
            lambda now, pods, rng=rng: kv_metrics(now, pods, load=2.05 * (1 + rng.uniform(-0.15, 0.15))),
            ticks=480,  # two hours
            start=3,
        )
        assert direction_changes(decs) <= 1, seed
        assert {d.desired for d in decs} <= {2, 3, 4}


def test_respects_min_and_max() -> None:
    high = run(lambda now, pods: kv_metrics(now, pods, load=50.0), ticks=60)
    assert max(d.desired for d in high) == DECODE.max_replicas
    low = run(lambda now, pods: kv_metrics(now, pods, load=0.0), ticks=200, start=3)
    assert min(d.desired for d in low) == DECODE.min_replicas
    # A replica count outside the (user-changed) bounds is corrected at once.
    out = run(lambda now, pods: kv_metrics(now, pods, load=1.0), ticks=1, start=14)
    assert out[0].desired == 10 and out[0].limited_by == "bounds"


def test_holds_while_replicas_start() -> None:
    # Startup takes 8 ticks (120 s); the load needs 6 replicas.
    decs = run(lambda now, pods: kv_metrics(now, pods, load=4.2), ticks=40, startup_ticks=8)
    ups = [i for i, d in enumerate(decs) if d.direction == "up"]
    assert len(ups) >= 2
    for a, b in itertools.pairwise(ups):
        assert b - a >= 8  # never a new scale-up before the last one's pods are ready
    held = [d for d in decs if d.limited_by == "starting"]
    assert held and "still starting" in held[0].reason
    # No overshoot: it converges on what the load needs.
    assert max(d.desired for d in decs) == 6


def test_missing_or_stale_metrics_are_no_decision() -> None:
    # With no metrics nothing changes, however long, and the reason says why.
    decs = run(lambda now, pods: None, ticks=40, start=3)
    assert all(d.desired == 3 and not d.metrics_available for d in decs)
    assert "no metrics" in decs[0].reason
    stale = run(lambda now, pods: kv_metrics(now - 600, pods, load=0.0), ticks=40, start=3)
    assert all(d.desired == 3 and not d.metrics_available for d in stale)
    assert "stale" in stale[0].reason
    silent = run(
        lambda now, pods: PoolMetrics(
            observed_at=now, pods_reporting=0, pods_expected=3, errors=("timeout",)
        ),
        ticks=40,
        start=3,
    )
    assert all(d.desired == 3 for d in silent) and "timeout" in silent[0].reason

    # After a long idle history, a metrics outage still never scales down.
    def gap(now: float, pods: int) -> PoolMetrics | None:
        return None if now >= 600 else kv_metrics(now, pods, load=2.0)

    decs = run(gap, ticks=80, start=3)
    assert all(d.desired == 3 for d in decs)


def test_partial_metrics_block_scale_down() -> None:
    decs = run(
        lambda now, pods: PoolMetrics(
            observed_at=now, pods_reporting=1, pods_expected=3, kv_cache_usage_mean=0.1
        ),
        ticks=40,
        start=3,
    )
    assert all(d.desired == 3 for d in decs)
    assert decs[-1].limited_by == "partial-metrics"


def test_pending_pods_are_capped_and_retried_with_backoff() -> None:
    config = AutoscalerConfig(interval_s=INTERVAL, pending_timeout_s=120, capacity_backoff_s=600)
    state: dict[str, PoolState] = {}
    # 5 asked for, 3 ready, 2 unschedulable for 150 s.
    inp = PoolInput(
        role="decode",
        replicas=PoolReplicas(desired=5, current=5, ready=3, pending_unschedulable=2, unschedulable_for=150),
        metrics=kv_metrics(0.0, 3, load=5.0),
    )
    decisions, state = decide(0.0, {"p": inp}, {"p": DECODE}, config, state)
    dec = decisions["p"]
    assert dec.desired == 3 and dec.limited_by == "capacity"
    assert "Pending" in dec.reason and "retry in 600s" in dec.reason
    # Load still wants more, but the cap holds until the backoff ends.
    for i in range(1, 60):
        now = i * INTERVAL
        inp = PoolInput(
            role="decode",
            replicas=PoolReplicas(desired=3, current=3, ready=3),
            metrics=kv_metrics(now, 3, load=5.0),
        )
        decisions, state = decide(now, {"p": inp}, {"p": DECODE}, config, state)
        if now < 600:
            assert decisions["p"].desired == 3, now
            assert decisions["p"].limited_by == "capacity"
        else:
            break
    # One retry after the backoff (3 -> 5: the up step is max(1 pod, 50 %)).
    assert decisions["p"].desired == 5
    # Still unschedulable: capped again, with a doubled backoff.
    inp = PoolInput(
        role="decode",
        replicas=PoolReplicas(desired=5, current=5, ready=3, pending_unschedulable=2, unschedulable_for=130),
        metrics=kv_metrics(800.0, 3, load=5.0),
    )
    decisions, state = decide(800.0, {"p": inp}, {"p": DECODE}, config, state)
    assert decisions["p"].desired == 3 and "retry in 1200s" in decisions["p"].reason


def test_prefill_scales_on_backlog_and_ttft() -> None:
    def backlog(now: float, pods: int) -> PoolMetrics:
        return PoolMetrics(
            observed_at=now, pods_reporting=pods, pods_expected=pods, prompt_tokens_waiting=16000
        )

    decs = run(backlog, ticks=20, pool=PREFILL, role="prefill")
    assert decs[-1].desired == 4 and decs[-1].signal == "prompt_tokens_waiting"

    def slow(now: float, pods: int) -> PoolMetrics:
        return PoolMetrics(observed_at=now, pods_reporting=pods, pods_expected=pods, ttft_seconds=3.0)

    decs = run(slow, ticks=4, pool=PREFILL, role="prefill")
    assert decs[2].direction == "up" and decs[2].signal == "ttft" and decs[2].value == 3.0


def test_decode_scales_on_itl_and_ignores_prefill_signals() -> None:
    pool = PoolConfig(min_replicas=1, max_replicas=8, itl_target_s=0.05, kv_cache_usage_target=0.8)

    def series(now: float, pods: int) -> PoolMetrics:
        # A big prompt backlog would scale a prefill pool; a decode pool must not care.
        return PoolMetrics(
            observed_at=now,
            pods_reporting=pods,
            pods_expected=pods,
            kv_cache_usage_mean=0.8,
            itl_seconds=0.09,
            prompt_tokens_waiting=1e6,
        )

    decs = run(series, ticks=4, pool=pool)
    assert decs[2].signal == "itl" and decs[2].desired == 3
    assert all(r.signal != "prompt_tokens_waiting" for r in decs[2].readings)


def test_ratio_bounds_raise_the_smaller_side() -> None:
    config = AutoscalerConfig(interval_s=INTERVAL, prefill_decode_ratio_min=0.5, prefill_decode_ratio_max=1.0)
    pools = {"prefill": PREFILL, "decode": DECODE}
    inputs = {
        "prefill": PoolInput(
            role="prefill",
            replicas=PoolReplicas(desired=2, current=2, ready=2),
            metrics=PoolMetrics(
                observed_at=0, pods_reporting=2, pods_expected=2, prompt_tokens_waiting=24000
            ),
        ),
        "decode": PoolInput(
            role="decode",
            replicas=PoolReplicas(desired=2, current=2, ready=2),
            metrics=kv_metrics(0, 2, load=1.4),
        ),
    }
    config0 = AutoscalerConfig(
        interval_s=INTERVAL,
        scale_up_stabilization_s=0,
        prefill_decode_ratio_min=0.5,
        prefill_decode_ratio_max=1.0,
    )
    decisions, _ = decide(0.0, inputs, pools, config0, {})
    # Prefill goes 2->3 (step-limited); decode would hold at 2, but 3:2 > 1.0 so decode rises to 3.
    assert decisions["prefill"].desired == 3
    assert decisions["decode"].desired == 3 and decisions["decode"].limited_by == "ratio"
    assert "ratio" in decisions["decode"].reason
    # Decode at its max: prefill is lowered instead.
    small_decode = {"prefill": PREFILL, "decode": PoolConfig(min_replicas=1, max_replicas=2)}
    decisions, _ = decide(0.0, inputs, small_decode, config0, {})
    assert decisions["prefill"].desired == 2 and decisions["decode"].desired == 2
    # Below the minimum ratio: prefill is raised.
    inputs["decode"] = PoolInput(
        role="decode",
        replicas=PoolReplicas(desired=8, current=8, ready=8),
        metrics=kv_metrics(0, 8, load=5.6),
    )
    inputs["prefill"] = PoolInput(
        role="prefill",
        replicas=PoolReplicas(desired=2, current=2, ready=2),
        metrics=PoolMetrics(observed_at=0, pods_reporting=2, pods_expected=2, prompt_tokens_waiting=8000),
    )
    decisions, _ = decide(0.0, inputs, pools, config, {})
    assert decisions["prefill"].desired == 4 and decisions["decode"].desired == 8


def test_state_round_trips_through_status() -> None:
    decs_state: dict[str, PoolState] = {}
    inp = PoolInput(
        role="decode",
        replicas=PoolReplicas(desired=2, current=2, ready=2),
        metrics=kv_metrics(0, 2, load=3.0),
    )
    config = AutoscalerConfig(interval_s=INTERVAL, scale_up_stabilization_s=0)
    _, decs_state = decide(0.0, {"p": inp}, {"p": DECODE}, config, decs_state)
    restored = PoolState.from_dict(decs_state["p"].to_dict())
    assert restored == decs_state["p"]
    assert restored.scale_up_target == 3 and restored.recommendations == [(0.0, 5)]


def test_backlog_target_derives_from_ttft_and_measured_prefill_rate() -> None:
    pool = PoolConfig(min_replicas=1, max_replicas=10, ttft_target_s=2.0, kv_cache_usage_target=None)
    config = AutoscalerConfig(interval_s=INTERVAL, scale_up_stabilization_s=0)
    # 2 pods prefill 10k tokens/s together: one replica clears 5k/s * 2 s = 10k tokens within target.
    metrics = PoolMetrics(
        observed_at=0,
        pods_reporting=2,
        pods_expected=2,
        prompt_tokens_waiting=60000,
        prompt_tokens_per_s=10000,
    )
    inp = PoolInput(role="prefill", replicas=PoolReplicas(desired=2, current=2, ready=2), metrics=metrics)
    decisions, _ = decide(0.0, {"p": inp}, {"p": pool}, config, {})
    reading = next(r for r in decisions["p"].readings if r.signal == "prompt_tokens_waiting")
    assert reading.target == pytest.approx(10000) and reading.recommendation == 6
    assert decisions["p"].desired == 3  # step-limited from 2


def test_forecast_only_for_a_significant_rise() -> None:
    config = AutoscalerConfig(interval_s=INTERVAL)
    rng = random.Random(7)
    flat = [(i * INTERVAL, 5.0 * (1 + rng.gauss(0, 0.05))) for i in range(20)]
    assert forecast_total(flat, 19 * INTERVAL, 180.0, config) is None
    ramp = [(i * INTERVAL, 2.0 + 0.01 * i * INTERVAL) for i in range(20)]
    total = forecast_total(ramp, 19 * INTERVAL, 180.0, config)
    assert total == pytest.approx(2.0 + 0.01 * (19 * INTERVAL + 180.0))
    assert forecast_total(ramp[:3], 2 * INTERVAL, 180.0, config) is None  # too few samples


def test_rising_load_is_sized_for_the_lead_time() -> None:
    # KV demand rises 0.12 replica-units per minute; startup takes 3 minutes.
    def rising(now: float, pods: int) -> PoolMetrics:
        return kv_metrics(now, pods, load=1.0 + 0.002 * now)

    with_forecast = run(rising, ticks=40, startup_ticks=12)
    without = run(
        rising, ticks=40, startup_ticks=12, config=AutoscalerConfig(interval_s=INTERVAL, forecast=False)
    )
    first = next(d for d in with_forecast if d.direction == "up")
    first_without = next(d for d in without if d.direction == "up")
    # The forecast scales before the measured value leaves the tolerance band; without it, only after.
    assert first.time + 120 <= first_without.time
    assert first.readings[0].forecast is not None and first.readings[0].forecast > first.readings[0].value
    assert "rising" in first.reason


def test_pending_pods_required_by_min_replicas_are_not_capped_again_and_again() -> None:
    pool = PoolConfig(min_replicas=3, max_replicas=6, kv_cache_usage_target=0.7)
    config = AutoscalerConfig(interval_s=INTERVAL, pending_timeout_s=60)
    state: dict[str, PoolState] = {}
    for i in range(10):
        now = i * INTERVAL
        inp = PoolInput(
            role="decode",
            replicas=PoolReplicas(
                desired=3, current=3, ready=2, pending_unschedulable=1, unschedulable_for=120 + now
            ),
            metrics=kv_metrics(now, 2, load=1.4),
        )
        decisions, state = decide(now, {"p": inp}, {"p": pool}, config, state)
        assert decisions["p"].desired == 3 and decisions["p"].limited_by != "capacity"
    assert state["p"].capacity_backoff_s is None


def test_capacity_backoff_resets_once_gpus_are_found() -> None:
    config = AutoscalerConfig(interval_s=INTERVAL, pending_timeout_s=60, capacity_backoff_s=100)
    stuck = PoolInput(
        role="decode",
        replicas=PoolReplicas(desired=4, current=4, ready=2, pending_unschedulable=2, unschedulable_for=90),
        metrics=kv_metrics(0.0, 2, load=3.0),
    )
    _, state = decide(0.0, {"p": stuck}, {"p": DECODE}, config, {})
    assert state["p"].capacity_cap == 2 and state["p"].capacity_backoff_s == 100
    # After the backoff the pool grows past the old cap and every pod becomes Ready.
    healthy = PoolInput(
        role="decode",
        replicas=PoolReplicas(desired=3, current=3, ready=3),
        metrics=kv_metrics(200.0, 3, load=1.8),
    )
    _, state = decide(200.0, {"p": healthy}, {"p": DECODE}, config, state)
    assert state["p"].capacity_cap is None and state["p"].capacity_backoff_s is None
