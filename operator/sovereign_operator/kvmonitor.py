"""Collecting `GET /health/kv` from prefill and decode pods and writing `KVTransferHealthy`.

Driven by the operator's periodic loop (loop.py), sharing the autoscaler's HTTP session; free of
kopf so tests drive it with fakes and loopback servers. Writes only when the condition changed
(steady state: no write, and no apiserver read beyond the pod listing), then asks the reconciler to
refresh status so `Degraded` follows the condition.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from sovereign_operator.kvhealth import (
    KV_COMPONENTS,
    Counters,
    KVReport,
    conditions_patch,
    counters,
    kv_condition,
    kv_condition_fields,
)
from sovereign_operator.podhttp import get_pod_json
from sovereign_operator.vocabulary import (
    KV_TRANSFER_HEALTHY,
    READY,
    find_condition,
    pod_component,
    pod_is_ready,
    pod_serves,
    pod_url,
    same_condition,
)

log = logging.getLogger(__name__)
HEALTH_PATH = "/health/kv"
# Often enough that a fallback shows within a minute; cheap (one small GET per pod).
KV_INTERVAL_S = 15.0


class KubeLike(Protocol):
    async def get_deployment(self, namespace: str, name: str) -> dict[str, Any] | None: ...
    async def observe(self, namespace: str, instance: str) -> Any: ...
    async def patch_status(
        self, namespace: str, name: str, patch: dict[str, Any], resource_version: str | None = None
    ) -> None: ...


def default_health_url(pod: Mapping[str, Any]) -> str | None:
    return pod_url(pod, HEALTH_PATH)


async def read_kv_health(
    session: aiohttp.ClientSession, pod: str, component: str, url: str, timeout_s: float
) -> KVReport:
    """One pod's answer; a 503 still carries the body that says why, so it is a report, not an error."""
    body, error = await get_pod_json(
        session, url, timeout_s, not_found="HTTP 404: the runtime does not serve /health/kv"
    )
    return KVReport(pod, component, body=body, error=error)


def _undetermined(status: Mapping[str, Any]) -> bool:
    if status.get("mode") != "disaggregated":
        return False
    ready = find_condition(status.get("conditions"), READY)
    kv = _kv_condition_of(status)
    return bool(ready and ready.get("status") == "True") and (kv is None or kv.get("status") == "Unknown")


def _kv_condition_of(status: Mapping[str, Any]) -> Mapping[str, Any] | None:
    return find_condition(status.get("conditions"), KV_TRANSFER_HEALTHY)


@dataclass
class _Memory:
    last_tick: float | None = None
    counters: dict[str, Counters] = field(default_factory=dict)


class KVHealthMonitor:
    def __init__(
        self,
        kube: KubeLike,
        http: Callable[[], aiohttp.ClientSession],
        *,
        on_change: Callable[[str, str], Awaitable[Any]] | None = None,
        pod_url: Callable[[Mapping[str, Any]], str | None] = default_health_url,
        clock: Callable[[], float] = time.time,
        timeout_s: float = 2.0,
        interval_s: float = KV_INTERVAL_S,
    ) -> None:
        self.kube = kube
        self.http = http
        self.on_change = on_change
        self.pod_url = pod_url
        self.clock = clock
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self._memory: dict[tuple[str, str], _Memory] = {}

    def due(self, namespace: str, name: str, body: Mapping[str, Any] | None = None) -> bool:
        """Time for a round. With the watched `body`: also every tick while the deployment is
        Ready but KV health is not known yet, so the verdict follows Ready within one tick."""
        if body is not None and _undetermined(body.get("status") or {}):
            return True
        memory = self._memory.get((namespace, name))
        # 1 s slack, as the autoscaler: a timer firing a hair early must not skip a round.
        return (
            memory is None
            or memory.last_tick is None
            or self.clock() - memory.last_tick >= self.interval_s - 1
        )

    def forget(self, namespace: str, name: str) -> None:
        self._memory.pop((namespace, name), None)

    async def collect(self, pods: list[dict[str, Any]]) -> tuple[dict[str, int], list[KVReport]]:
        """Ready pods per component, and the answers of those with an address, read concurrently."""
        ready: dict[str, int] = {c: 0 for c in KV_COMPONENTS}
        targets: list[tuple[str, str, str]] = []
        for pod in pods:
            component = pod_component(pod)
            # A multi-node group's KV goes through its leader; its workers have no KV endpoint.
            if component is None or component not in ready or not pod_is_ready(pod) or not pod_serves(pod):
                continue
            ready[component] += 1
            url = self.pod_url(pod)
            if url:
                targets.append((pod["metadata"]["name"], component, url))
        session = self.http()
        reports = await asyncio.gather(
            *(read_kv_health(session, pod, component, url, self.timeout_s) for pod, component, url in targets)
        )
        return ready, list(reports)

    async def tick(self, namespace: str, name: str, body: Mapping[str, Any]) -> dict[str, Any] | None:
        """One round for one LLMDeployment seen as `body` (the watched object); returns the
        condition it wants (None: absent). Errors reading the cluster propagate."""
        memory = self._memory.setdefault((namespace, name), _Memory())
        now = self.clock()
        memory.last_tick = now
        status = body.get("status") or {}
        generation = body.get("metadata", {}).get("generation")
        generation = int(generation) if isinstance(generation, int) else None
        fields = None
        if status.get("mode") == "disaggregated":
            observed = await self.kube.observe(namespace, name)
            ready, reports = await self.collect(list(observed.pods))
            fields = kv_condition_fields(
                status.get("mode"), status.get("kvTransport"), ready, reports, memory.counters
            )
            seen = {r.pod: c for r in reports if (c := counters(r)) is not None}
        else:
            seen = {}
        wanted = None if fields is None else kv_condition(fields, _kv_condition_of(status), now, generation)
        if same_condition(_kv_condition_of(status), wanted):
            memory.counters = seen
            return wanted
        # The watched body may lag behind our own last write: decide on the live object.
        live = await self.kube.get_deployment(namespace, name)
        if live is None or live["metadata"].get("deletionTimestamp"):
            self.forget(namespace, name)
            return None
        live_status = live.get("status") or {}
        if fields is not None:
            wanted = kv_condition(fields, _kv_condition_of(live_status), now, generation)
        patch = conditions_patch(live_status, wanted)
        if patch is not None:
            # A conflict propagates; the counters stay, so the next round sees the same news.
            await self.kube.patch_status(
                namespace, name, patch, resource_version=live["metadata"].get("resourceVersion")
            )
        memory.counters = seen
        if patch is None:
            return wanted
        if wanted is not None and wanted["status"] == "False":
            log.warning("%s/%s KV transfer unhealthy: %s", namespace, name, wanted["message"])
        if self.on_change is not None:
            try:
                await self.on_change(namespace, name)
            except Exception as error:  # Degraded catches up on the next child event
                log.warning(
                    "status refresh after KV health change of %s/%s failed: %s", namespace, name, error
                )
        return wanted
