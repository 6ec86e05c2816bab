"""Replay a noisy load ramp (up, plateau, down) against Sovereign's autoscaling policy and a plain
HPA-style rule, on the same series, with simulated startup lead time.

    .venv/bin/python bench/autoscale_ramp.py [--seeds 5] [--plot docs/autoscale-ramp.png]

Model: demand D(t) is measured in "replicas at 100 % KV-cache usage"; every ready replica serves
one unit; a pool's KV-cache usage is min(1, D / ready) averaged over the ready pods (the signal
both autoscalers read, target 0.7). A new pod is counted at once but serves only after its startup
time (Pending + weights + warm JIT cache). Scale-down removes a pod after it drains (not modelled:
the drain happens outside the replica count).

The peer is what a user gets from an HPA on the same metric: desired = ceil(current * metric /
target) with HPA's 10 % tolerance, no up window, 300 s down window, HPA's default rate limits
(up: max(4 pods, 100 %) per 15 s), and no notion of pods that are still starting.
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from sovereign_operator.autoscale import (
    AutoscalerConfig,
    PoolConfig,
    PoolInput,
    PoolMetrics,
    PoolReplicas,
    PoolState,
    decide,
)

DT = 15.0
TARGET = 0.7
MIN_REPLICAS, MAX_REPLICAS = 1, 16
STARTUP_S = 180.0  # a warm JIT cache; cold FP8 starts are 10-30 min and make the gap larger
BASE, PEAK = 1.4, 7.0
NEEDED_AT_PEAK = math.ceil(PEAK / TARGET)
RAMP_START = 600.0


def demand_series(seed: int) -> list[float]:
    """10 min base, 20 min ramp up, 40 min plateau, 20 min ramp down, 30 min base; ±10 % noise and
    occasional 30 s bursts."""
    rng = random.Random(seed)
    phases = [
        (600, BASE, BASE),
        (1200, BASE, PEAK),
        (2400, PEAK, PEAK),
        (1200, PEAK, BASE),
        (1800, BASE, BASE),
    ]
    out: list[float] = []
    burst = 0
    for seconds, a, b in phases:
        steps = int(seconds / DT)
        for i in range(steps):
            level = a + (b - a) * i / steps
            if burst == 0 and rng.random() < 0.02:
                burst = 2
            factor = 1.25 if burst > 0 else 1.0
            burst = max(0, burst - 1)
            out.append(max(0.0, level * factor * (1 + rng.gauss(0, 0.05))))
    return out


@dataclass
class Trace:
    name: str
    desired: list[int] = field(default_factory=list)
    ready: list[int] = field(default_factory=list)
    first_up: float | None = None

    def summary(self, demand: list[float], ramp_start: float) -> dict[str, float]:
        dirs: list[int] = []
        for a, b in zip(self.desired, self.desired[1:], strict=False):
            if b != a:
                dirs.append(1 if b > a else -1)
        changes = sum(1 for a, b in itertools.pairwise(dirs) if a != b)
        overloaded = sum(DT for d, r in zip(demand, self.ready, strict=True) if d > r)
        over_target = sum(DT for d, r in zip(demand, self.ready, strict=True) if d > TARGET * max(r, 1) * 1.1)
        # Ready capacity for 90 % of the plateau's need, counted from the start of the ramp.
        reach = next(
            (
                i * DT - ramp_start
                for i, r in enumerate(self.ready)
                if i * DT >= ramp_start and r >= 0.9 * NEEDED_AT_PEAK
            ),
            float("nan"),
        )
        return {
            "react_s": self.first_up if self.first_up is not None else float("nan"),
            "reach_s": reach,
            "peak": float(max(self.desired)),
            "overshoot": float(max(self.desired) - NEEDED_AT_PEAK),
            "direction_changes": float(changes),
            "scale_events": float(len(dirs)),
            "overloaded_s": overloaded,
            "over_target_s": over_target,
            "replica_hours": sum(self.desired) * DT / 3600,
        }


Decider = Callable[[float, int, int, float], int]


def simulate(name: str, demand: list[float], decider: Decider, react_from: float) -> Trace:
    """Run one autoscaler over the demand series; `decider(now, desired, ready, kv_usage)`."""
    trace = Trace(name)
    desired = 2
    ready_at = [0.0, 0.0]
    for i, d in enumerate(demand):
        now = i * DT
        ready = sum(1 for t in ready_at if t <= now)
        kv = min(1.0, d / max(1, ready))
        new = decider(now, desired, ready, kv)
        if new > desired:
            ready_at += [now + STARTUP_S] * (new - desired)
            if trace.first_up is None and now >= react_from:
                trace.first_up = now - react_from
        elif new < desired:
            # A StatefulSet removes the highest ordinals first: the newest (maybe still starting) pods.
            ready_at = ready_at[:new]
        desired = new
        trace.desired.append(desired)
        trace.ready.append(ready)
    return trace


def sovereign(up_window: float, hold_while_starting: bool = True) -> Decider:
    pool = PoolConfig(
        min_replicas=MIN_REPLICAS,
        max_replicas=MAX_REPLICAS,
        ttft_target_s=None,
        itl_target_s=None,
        kv_cache_usage_target=TARGET,
        prompt_tokens_waiting_default=None,
    )
    config = AutoscalerConfig(
        interval_s=DT,
        scale_up_stabilization_s=up_window,
        scale_down_stabilization_s=300,
        # 0 lead times: never wait on starting replicas (the ablation column only).
        stuck_startup_factor=3.0 if hold_while_starting else 0.0,
    )
    states: dict[str, PoolState] = {}

    def step(now: float, desired: int, ready: int, kv: float) -> int:
        nonlocal states
        inp = PoolInput(
            role="decode",
            replicas=PoolReplicas(desired=desired, current=desired, ready=ready, starting=desired - ready),
            metrics=PoolMetrics(
                observed_at=now,
                pods_reporting=max(1, ready),
                pods_expected=max(1, ready),
                kv_cache_usage_mean=kv,
                kv_cache_usage_max=kv,
            ),
            startup_seconds=STARTUP_S,
        )
        decisions, states = decide(now, {"decode": inp}, {"decode": pool}, config, states)
        return decisions["decode"].desired

    return step


def hpa() -> Decider:
    history: list[tuple[float, int]] = []

    def step(now: float, desired: int, ready: int, kv: float) -> int:
        ratio = kv / TARGET
        rec = desired if abs(ratio - 1) <= 0.1 else math.ceil(desired * ratio)
        rec = max(MIN_REPLICAS, min(MAX_REPLICAS, rec))
        history.append((now, rec))
        down_floor = max(r for t, r in history if t >= now - 300)
        new = rec if rec > desired else min(desired, down_floor)
        return min(new, desired + max(4, desired))

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--plot", default="docs/autoscale-ramp.png")
    args = parser.parse_args()

    react_from = RAMP_START
    contenders: list[tuple[str, Callable[[], Decider]]] = [
        ("HPA-style rule", hpa),
        ("sovereign, 30 s up window", lambda: sovereign(30.0)),
        ("sovereign, spec default 180 s up window", lambda: sovereign(180.0)),
        ("ablation: 30 s up, no hold while starting", lambda: sovereign(30.0, hold_while_starting=False)),
    ]
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _ in contenders}
    first: dict[str, Trace] = {}
    demand0: list[float] = []
    for seed in range(args.seeds):
        demand = demand_series(seed)
        for name, make in contenders:
            trace = simulate(name, demand, make(), react_from)
            results[name].append(trace.summary(demand, RAMP_START))
            if seed == 0:
                first[name], demand0 = trace, demand

    keys = [
        ("react_s", "time to react: first scale-up after the ramp starts (s)"),
        ("reach_s", "time to 90 % of plateau capacity, ready (s from ramp start)"),
        ("peak", f"peak replicas (need {NEEDED_AT_PEAK})"),
        ("overshoot", "overshoot (replicas)"),
        ("direction_changes", "direction changes"),
        ("scale_events", "scale events"),
        ("overloaded_s", "time overloaded, demand > ready (s)"),
        ("over_target_s", "time >10 % over target (s)"),
        ("replica_hours", "replica-hours"),
    ]
    names = [n for n, _ in contenders]
    print(
        f"load ramp {BASE}->{PEAK}->{BASE} units, startup {STARTUP_S:.0f}s, target {TARGET}, {args.seeds} seeds (mean)"
    )
    print("| metric | " + " | ".join(names) + " |")
    print("| --- |" + " --- |" * len(names))
    for key, label in keys:
        cells = [f"{statistics.fmean(r[key] for r in results[n]):.1f}" for n in names]
        print(f"| {label} | " + " | ".join(cells) + " |")

    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        minutes = [i * DT / 60 for i in range(len(demand0))]
        fig, ax = plt.subplots(figsize=(10, 5))
        ax.plot(
            minutes,
            [d / TARGET for d in demand0],
            color="0.6",
            lw=1,
            label="replicas needed (demand / target)",
        )
        styles = {names[0]: ("tab:red", "-"), names[1]: ("tab:blue", "-"), names[2]: ("tab:green", "--")}
        for name in names[:3]:
            color, ls = styles[name]
            ax.step(
                minutes,
                first[name].desired,
                where="post",
                color=color,
                ls=ls,
                lw=1.6,
                label=f"{name}: desired",
            )
        ax.step(
            minutes,
            first[names[1]].ready,
            where="post",
            color="tab:blue",
            lw=0.8,
            alpha=0.5,
            label=f"{names[1]}: ready",
        )
        ax.set_xlabel("minutes")
        ax.set_ylabel("replicas")
        ax.set_title(f"Load ramp, startup lead time {STARTUP_S:.0f}s, KV-usage target {TARGET} (seed 0)")
        ax.legend(loc="upper left", fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
