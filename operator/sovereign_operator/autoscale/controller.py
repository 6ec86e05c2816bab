"""The autoscaler's shell: one tick per LLMDeployment, free of kopf so tests drive it with fakes.

A tick reads the live object and its pods, collects each autoscaled pool's metrics, runs the pure
policy, writes `status.pools.<pool>.autoscaler` and the `MetricsAvailable` condition (never
`spec`), posts an Event per replica change, and asks the reconciler to re-render so the new
replica counts reach the StatefulSets (rendering reads them back from status as overrides).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from sovereign_operator.api.document import InvalidDeployment, parse_spec
from sovereign_operator.api.spec import LLMDeploymentSpec, PoolAutoscaling
from sovereign_operator.gone import DeploymentGone
from sovereign_operator.render.plan import components_for
from sovereign_operator.vocabulary import (
    METRICS_AVAILABLE,
    READY,
    find_condition,
    parse_rfc3339,
    pod_component,
    pod_condition,
    pod_is_ready,
    pod_serves,
    pod_url,
    pool_name,
    with_condition,
)

from .exporter import AutoscalerMetrics
from .metrics import PodScraper, query_prometheus_pool
from .policy import decide
from .report import autoscaler_status, metrics_condition, scaling_event
from .types import AutoscalerConfig, PoolConfig, PoolDecision, PoolInput, PoolMetrics, PoolReplicas, PoolState

log = logging.getLogger(__name__)
# The KV-cache usage target of a decode or unified pool whose spec names no decode-side target.
DEFAULT_KV_TARGET = 0.75
# Write an unchanged decision at least this often, so `lastDecisionTime` shows the loop is alive.
HEARTBEAT_S = 300.0


class ObservedLike(Protocol):
    pods: list[dict[str, Any]]

    def pool_set(self, component: str) -> dict[str, Any] | None: ...


class KubeLike(Protocol):
    async def get_deployment(self, namespace: str, name: str) -> dict[str, Any] | None: ...
    async def observe(self, namespace: str, instance: str) -> Any: ...
    async def patch_status(self, namespace: str, name: str, patch: dict[str, Any]) -> None: ...


def pool_replicas(
    statefulset: Mapping[str, Any] | None,
    pods: list[dict[str, Any]],
    now: float,
    output_failing: set[str] | frozenset[str] = frozenset(),
) -> PoolReplicas:
    """Replica facts of one pool from its StatefulSet and pods (plain apiserver dicts); pods named in
    ``output_failing`` (their self-test fails) are counted apart, not as starting."""
    spec = (statefulset or {}).get("spec") or {}
    status = (statefulset or {}).get("status") or {}
    desired = int(spec.get("replicas") or 0)
    ready = sum(1 for p in pods if pod_is_ready(p))
    unschedulable_ages: list[float] = []
    starting = failing = 0
    for p in pods:
        phase = (p.get("status") or {}).get("phase")
        scheduled = pod_condition(p, "PodScheduled")
        if (
            phase == "Pending"
            and scheduled
            and scheduled.get("status") == "False"
            and scheduled.get("reason") == "Unschedulable"
        ):
            since = parse_rfc3339(scheduled.get("lastTransitionTime")) or parse_rfc3339(
                p["metadata"].get("creationTimestamp")
            )
            unschedulable_ages.append(max(0.0, now - since) if since else 0.0)
            continue
        if p["metadata"]["name"] in output_failing:
            failing += 1
        elif not pod_is_ready(p):
            starting += 1
    return PoolReplicas(
        desired=desired,
        current=int(status.get("replicas") or len(pods)),
        ready=ready,
        pending_unschedulable=len(unschedulable_ages),
        unschedulable_for=max(unschedulable_ages, default=0.0),
        starting=starting,
        output_failing=failing,
    )


def measured_startup_seconds(pods: list[dict[str, Any]]) -> float | None:
    """Median time from creation to Ready over the pool's ready pods (the scale-up lead time)."""
    durations = []
    for p in pods:
        cond = pod_condition(p, READY)
        created = parse_rfc3339(p["metadata"].get("creationTimestamp"))
        became = (
            parse_rfc3339(cond.get("lastTransitionTime")) if cond and cond.get("status") == "True" else None
        )
        if created is not None and became is not None and became >= created:
            durations.append(became - created)
    return statistics.median(durations) if durations else None


def pool_config(bounds: PoolAutoscaling, role: str) -> PoolConfig:
    """The policy's view of a pool's `autoscaling` block; unset targets get role defaults."""
    kv = bounds.kv_cache_usage_target
    if kv is None and role != "prefill" and not bounds.itl_target_ms:
        kv = DEFAULT_KV_TARGET  # a decode pool needs some signal; KV pressure is the universal one
    return PoolConfig(
        min_replicas=bounds.min_replicas,
        max_replicas=bounds.max_replicas,
        ttft_target_s=bounds.ttft_target_ms / 1000 if bounds.ttft_target_ms else None,
        itl_target_s=bounds.itl_target_ms / 1000 if bounds.itl_target_ms else None,
        kv_cache_usage_target=kv,
        requests_waiting_target=bounds.waiting_requests_target,
    )


def autoscaler_config(spec: LLMDeploymentSpec) -> AutoscalerConfig:
    a = spec.autoscaling
    ratio = a.prefill_decode_ratio
    return AutoscalerConfig(
        scale_up_stabilization_s=a.scale_up_stabilization_seconds,
        scale_down_stabilization_s=a.scale_down_stabilization_seconds,
        interval_s=a.interval_seconds,
        prefill_decode_ratio_min=ratio.min if ratio else None,
        prefill_decode_ratio_max=ratio.max if ratio else None,
    )


def autoscaled_pools(spec: LLMDeploymentSpec, mode: str | None) -> dict[str, PoolAutoscaling]:
    """Component -> autoscaling bounds, for the pools of the resolved mode that are autoscaled."""
    if mode not in ("unified", "disaggregated"):
        return {}
    pools = {c: spec.pool_for(c) for c in components_for(mode)}
    return {c: p.autoscaling for c, p in pools.items() if p is not None and p.autoscaling is not None}


def restore_state(previous: Mapping[str, Any] | None, replicas: PoolReplicas, now: float) -> PoolState:
    """State for a pool this process has not seen (operator restart): conservative, so a restart
    never causes a burst: any not-ready replicas count as an in-flight scale-up."""
    state = PoolState()
    history = (previous or {}).get("history") or []
    last = parse_rfc3339(history[-1].get("time")) if history else None
    if replicas.ready < replicas.desired:
        state.scale_up_target = replicas.desired
        state.last_scale_up_time = last if last is not None else now
    return state


def stale_status_patch(status: Mapping[str, Any], autoscaled: set[str]) -> dict[str, Any] | None:
    """A merge patch removing autoscaler blocks of pools that are no longer autoscaled, and the
    MetricsAvailable condition when nothing is; None when there is nothing stale."""
    patch: dict[str, Any] = {}
    pools = status.get("pools") or {}
    stale = [c for c, p in pools.items() if c not in autoscaled and (p or {}).get("autoscaler") is not None]
    if stale:
        patch["pools"] = {c: {"autoscaler": None} for c in stale}
    conditions = status.get("conditions")
    if not autoscaled and find_condition(conditions, METRICS_AVAILABLE) is not None:
        patch["conditions"] = with_condition(conditions, METRICS_AVAILABLE, None)
    return patch or None


def _pods_of(pods: list[dict[str, Any]], component: str) -> list[dict[str, Any]]:
    """The pool's serving pods: a multi-node group counts once, by its leader (ready only when every
    rank is), which also serves the group's metrics."""
    return [p for p in pods if pod_component(p) == component and pod_serves(p)]


def default_pod_url(pod: Mapping[str, Any]) -> str | None:
    return pod_url(pod, "/metrics")


@dataclass
class _Memory:
    states: dict[str, PoolState] = field(default_factory=dict)
    last_tick: float | None = None
    written: dict[str, Any] | None = None
    written_at: float = 0.0


class AutoscaleController:
    """Keeps per-deployment autoscaler state in memory; a restart rebuilds it conservatively
    (scale-down waits for a full window of fresh history; starting pods block new scale-ups)."""

    def __init__(
        self,
        kube: KubeLike,
        reconcile: Callable[[Mapping[str, Any]], Awaitable[Any]],
        *,
        post_event: Callable[[Mapping[str, Any], dict[str, str]], None] | None = None,
        exporter: AutoscalerMetrics | None = None,
        pod_url: Callable[[Mapping[str, Any]], str | None] = default_pod_url,
        clock: Callable[[], float] = time.time,
        scrape_timeout_s: float = 2.0,
    ) -> None:
        self.kube = kube
        self.reconcile = reconcile
        self.post_event = post_event or (lambda body, event: None)
        self.exporter = exporter
        self.pod_url = pod_url
        self.clock = clock
        self.scraper = PodScraper(timeout_s=scrape_timeout_s, clock=clock)
        # (namespace, name) -> component -> pods whose output self-test fails (outputmonitor.py):
        # started but serving nothing, so they count as neither capacity nor a scale-up in flight.
        self.output_failing: Callable[[str, str], Mapping[str, set[str]]] | None = None
        self._memory: dict[tuple[str, str], _Memory] = {}
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def forget(self, namespace: str, name: str) -> None:
        self._memory.pop((namespace, name), None)
        if self.exporter is not None:
            self.exporter.forget(namespace, name)

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return self._session

    def http_session(self) -> aiohttp.ClientSession:
        """The session pods are scraped with (the KV-health monitor shares it)."""
        return self._http()

    async def _collect(
        self,
        spec: LLMDeploymentSpec,
        namespace: str,
        name: str,
        component: str,
        pods: list[dict[str, Any]],
        config: AutoscalerConfig,
    ) -> PoolMetrics:
        now = self.clock()
        serving = [p for p in pods if pod_is_ready(p)]
        source = spec.autoscaling.metrics
        if source.source == "prometheus" and source.prometheus_url:
            selector = f'namespace="{namespace}",pod=~"{pool_name(name, component)}-[0-9]+"'
            return await query_prometheus_pool(
                self._http(),
                source.prometheus_url,
                selector,
                pods_expected=len(serving),
                window_s=max(60.0, 2 * config.interval_s),
                clock=self.clock,
            )
        urls = [u for u in (self.pod_url(p) for p in serving) if u]
        if not urls:
            return PoolMetrics(
                observed_at=now, pods_reporting=0, pods_expected=0, errors=("no ready pod to scrape",)
            )
        return await self.scraper.scrape_pool(self._http(), f"{namespace}/{name}/{component}", urls)

    def due(self, namespace: str, name: str, interval_s: float) -> bool:
        memory = self._memory.get((namespace, name))
        # 1 s slack: a loop tick firing a hair early must not skip a whole interval.
        return memory is None or memory.last_tick is None or self.clock() - memory.last_tick >= interval_s - 1

    async def tick(self, namespace: str, name: str, force: bool = False) -> dict[str, PoolDecision] | None:
        """One autoscaling round for one LLMDeployment; None when nothing is autoscaled or it is
        not time yet. Errors reading the cluster propagate (the loop retries next round); DeploymentGone
        when the object is gone."""
        live = await self.kube.get_deployment(namespace, name)
        if live is None:
            # Deleted, or its namespace is: the loop drops every part's memory of it (gone.py).
            self.forget(namespace, name)
            raise DeploymentGone(namespace, name, None)
        if live["metadata"].get("deletionTimestamp"):
            self.forget(namespace, name)
            return None
        try:
            spec = parse_spec(live.get("spec"))
        except InvalidDeployment:
            return None  # the reconciler reports it; nothing to scale
        status = live.get("status") or {}
        bounds = autoscaled_pools(spec, status.get("mode"))
        leftovers = stale_status_patch(status, set(bounds))
        if leftovers is not None:
            # A pool went back to fixed replicas (or the mode changed): drop what no longer holds.
            await self.kube.patch_status(namespace, name, leftovers)
        if not bounds:
            self.forget(namespace, name)
            # Remember the round so the loop does not re-read this object every few seconds.
            self._memory[(namespace, name)] = _Memory(last_tick=self.clock())
            return None
        config = autoscaler_config(spec)
        if not force and not self.due(namespace, name, config.interval_s):
            return None
        memory = self._memory.setdefault((namespace, name), _Memory())
        now = self.clock()
        memory.last_tick = now

        observed = await self.kube.observe(namespace, name)
        old_pools = status.get("pools") or {}
        inputs: dict[str, PoolInput] = {}
        configs: dict[str, PoolConfig] = {}
        for component, pool_bounds in bounds.items():
            pods = _pods_of(observed.pods, component)
            failing = (
                self.output_failing(namespace, name).get(component, set()) if self.output_failing else set()
            )
            replicas = pool_replicas(observed.pool_set(component), pods, now, failing)
            previous = (old_pools.get(component) or {}).get("autoscaler")
            if component not in memory.states:
                memory.states[component] = restore_state(previous, replicas, now)
            if replicas.desired == 0 and previous and isinstance(previous.get("desiredReplicas"), int):
                # StatefulSet not created yet: decide from what was last decided.
                replicas = PoolReplicas(desired=previous["desiredReplicas"], current=0, ready=0)
            metrics = await self._collect(spec, namespace, name, component, pods, config)
            inputs[component] = PoolInput(
                role=component,  # type: ignore[arg-type]
                replicas=replicas,
                metrics=metrics,
                startup_seconds=measured_startup_seconds(pods),
            )
            configs[component] = pool_config(pool_bounds, component)

        decisions, memory.states = decide(now, inputs, configs, config, memory.states)
        if self.exporter is not None:
            self.exporter.observe(namespace, name, decisions.values())

        patch = self._status_patch(status, decisions, now, live["metadata"].get("generation"))
        changed = any(d.desired != d.previous for d in decisions.values())
        comparable = _comparable(decisions)
        if changed or comparable != memory.written or now - memory.written_at >= HEARTBEAT_S:
            await self.kube.patch_status(namespace, name, patch)
            memory.written, memory.written_at = comparable, now
        for decision in decisions.values():
            event = scaling_event(decision)
            if event is not None:
                self.post_event(live, event)
                log.info("%s/%s %s", namespace, name, event["message"])
        if changed:
            # Re-render with the decided replicas (read back from status as overrides).
            merged = {**status, "pools": {**old_pools}}
            for component, pool_patch in patch["pools"].items():
                merged["pools"][component] = {**(old_pools.get(component) or {}), **pool_patch}
            await self.reconcile({**live, "status": merged})
        return decisions

    def _status_patch(
        self, status: Mapping[str, Any], decisions: Mapping[str, PoolDecision], now: float, generation: Any
    ) -> dict[str, Any]:
        old_pools = status.get("pools") or {}
        pools = {
            c: {"autoscaler": autoscaler_status(d, (old_pools.get(c) or {}).get("autoscaler"))}
            for c, d in decisions.items()
        }
        conditions = status.get("conditions")
        mine = metrics_condition(
            decisions,
            now,
            find_condition(conditions, METRICS_AVAILABLE),
            int(generation) if isinstance(generation, int) else None,
        )
        # A merge patch replaces the list: keep every other writer's conditions as they are.
        return {"pools": pools, "conditions": with_condition(conditions, METRICS_AVAILABLE, mine)}


def _comparable(decisions: Mapping[str, PoolDecision]) -> dict[str, Any]:
    """What makes a decision worth writing again: not times, and values rounded to two significant
    digits, so a steady pool is not rewritten every interval."""

    def rounded(v: float | None) -> float | None:
        if v is None or v == 0 or not math.isfinite(v):
            return v
        return round(v, 1 - math.floor(math.log10(abs(v))))

    return {
        c: (d.desired, d.signal, rounded(d.value), d.limited_by, d.metrics_available)
        for c, d in decisions.items()
    }
