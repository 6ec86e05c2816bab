"""Reading the pods' output self-test (`GET /health/startup`) and writing `OutputHealthy`; restarting a
failing pod when `spec.remediation.restartOnOutputFailure` allows it.

Driven by the operator's periodic loop beside the KV monitor, sharing its HTTP session; free of kopf so
tests drive it with fakes and loopback servers. Every running pod is read, Ready or not: a pod whose
self-test fails is not Ready (its readiness answers 503), and that is exactly the pod to report. Writes
status only when the condition changed, posts an Event when it turns False and for each restart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from sovereign_operator.outputhealth import (
    OutputReport,
    RestartMemory,
    choose_restarts,
    failing_pods,
    output_condition_fields,
)
from sovereign_operator.podhttp import get_pod_json
from sovereign_operator.speculation import (
    SPECULATIVE_DECODING,
    condition_fields,
    pool_summary,
    requested_pool,
)
from sovereign_operator.vocabulary import (
    OUTPUT_HEALTHY,
    WORKER_COMPONENTS,
    condition,
    conditions_patch,
    find_condition,
    pod_component,
    pod_serves,
    pod_url,
    rfc3339,
    same_condition,
)

log = logging.getLogger(__name__)
STARTUP_PATH = "/health/startup"
OUTPUT_INTERVAL_S = 15.0

# post_event(deployment body, type "Normal"|"Warning", reason, message): events.EventPoster.post
PostEvent = Callable[[Mapping[str, Any], str, str, str], None]


class KubeLike(Protocol):
    async def get_deployment(self, namespace: str, name: str) -> dict[str, Any] | None: ...
    async def observe(self, namespace: str, instance: str) -> Any: ...
    async def patch_status(
        self, namespace: str, name: str, patch: dict[str, Any], resource_version: str | None = None
    ) -> None: ...
    async def delete_pod(self, namespace: str, name: str) -> None: ...


def default_startup_url(pod: Mapping[str, Any]) -> str | None:
    return pod_url(pod, STARTUP_PATH)


def _running(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") == "Running" and not pod["metadata"].get(
        "deletionTimestamp"
    )


async def read_startup(
    session: aiohttp.ClientSession, pod: str, component: str, uid: str, url: str, timeout_s: float
) -> OutputReport:
    """One pod's `/health/startup` body; a 503 carries the phase and the self-test too."""
    body, error = await get_pod_json(session, url, timeout_s)
    return OutputReport(pod, component, body=body, error=error, uid=uid)


def _output_condition(status: Mapping[str, Any]) -> Mapping[str, Any] | None:
    return find_condition(status.get("conditions"), OUTPUT_HEALTHY)


@dataclass
class _Memory:
    last_tick: float | None = None
    restarts: RestartMemory = field(default_factory=RestartMemory)
    failing: dict[str, set[str]] = field(default_factory=dict)  # component -> failing pod names


class OutputHealthMonitor:
    def __init__(
        self,
        kube: KubeLike,
        http: Callable[[], aiohttp.ClientSession],
        *,
        post_event: PostEvent | None = None,
        on_change: Callable[[str, str], Awaitable[Any]] | None = None,
        pod_url: Callable[[Mapping[str, Any]], str | None] = default_startup_url,
        clock: Callable[[], float] = time.time,
        timeout_s: float = 2.0,
        interval_s: float = OUTPUT_INTERVAL_S,
    ) -> None:
        self.kube = kube
        self.http = http
        self.post_event = post_event
        self.on_change = on_change
        self.pod_url = pod_url
        self.clock = clock
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self._memory: dict[tuple[str, str], _Memory] = {}

    def due(self, namespace: str, name: str) -> bool:
        memory = self._memory.get((namespace, name))
        return (
            memory is None
            or memory.last_tick is None
            or self.clock() - memory.last_tick >= self.interval_s - 1
        )

    def forget(self, namespace: str, name: str) -> None:
        self._memory.pop((namespace, name), None)

    def failing(self, namespace: str, name: str) -> dict[str, set[str]]:
        """Component -> pods whose last self-test failed (the autoscaler counts them as no capacity)."""
        memory = self._memory.get((namespace, name))
        return {c: set(p) for c, p in memory.failing.items()} if memory else {}

    async def collect(self, pods: list[dict[str, Any]]) -> list[OutputReport]:
        targets = []
        for pod in pods:
            meta = pod["metadata"]
            component = pod_component(pod)
            # A multi-node group's self-test runs on its leader (over every rank); workers serve no API.
            if component not in WORKER_COMPONENTS or not _running(pod) or not pod_serves(pod):
                continue
            url = self.pod_url(pod)
            if url:
                targets.append((meta["name"], component, str(meta.get("uid") or ""), url))
        session = self.http()
        return list(
            await asyncio.gather(
                *(read_startup(session, p, c, u, url, self.timeout_s) for p, c, u, url in targets)
            )
        )

    async def tick(self, namespace: str, name: str, body: Mapping[str, Any]) -> dict[str, Any] | None:
        """One round for one LLMDeployment; returns the condition it wants (None: no worker pod runs)."""
        memory = self._memory.setdefault((namespace, name), _Memory())
        now = self.clock()
        memory.last_tick = now
        observed = await self.kube.observe(namespace, name)
        reports = await self.collect(list(observed.pods))
        memory.failing = {c: {r.pod for r in rs} for c, rs in failing_pods(reports).items()}
        await self._remediate(namespace, body, reports, memory, now)
        status = body.get("status") or {}
        generation = body.get("metadata", {}).get("generation")
        generation = int(generation) if isinstance(generation, int) else None
        await self._speculation(namespace, name, body, reports, now, generation)
        fields = output_condition_fields(reports) if reports else None

        def wanted_for(current: Mapping[str, Any] | None) -> dict[str, Any] | None:
            if fields is None:
                return None
            return condition(OUTPUT_HEALTHY, *fields, rfc3339(now), current, generation)

        if same_condition(_output_condition(status), wanted_for(_output_condition(status))):
            return wanted_for(_output_condition(status))
        # The watched body may lag behind our own last write: decide on the live object.
        live = await self.kube.get_deployment(namespace, name)
        if live is None or live["metadata"].get("deletionTimestamp"):
            self.forget(namespace, name)
            return None
        live_status = live.get("status") or {}
        current = _output_condition(live_status)
        wanted = wanted_for(current)
        patch = conditions_patch(live_status, OUTPUT_HEALTHY, wanted)
        if patch is None:
            return wanted
        await self.kube.patch_status(
            namespace, name, patch, resource_version=live["metadata"].get("resourceVersion")
        )
        if wanted is not None and wanted["status"] == "False":
            log.warning("%s/%s output unhealthy: %s", namespace, name, wanted["message"])
            self._event(live, "Warning", "OutputUnhealthy", wanted["message"])
        elif (
            wanted is not None and wanted["status"] == "True" and current and current.get("status") == "False"
        ):
            self._event(live, "Normal", "OutputHealthy", wanted["message"])
        if self.on_change is not None:
            try:
                await self.on_change(namespace, name)
            except Exception as error:  # Degraded catches up on the next child event
                log.warning(
                    "status refresh after output health change of %s/%s failed: %s", namespace, name, error
                )
        return wanted

    async def _speculation(
        self,
        namespace: str,
        name: str,
        body: Mapping[str, Any],
        reports: list[OutputReport],
        now: float,
        generation: int | None,
    ) -> None:
        """Write the SpeculativeDecoding condition and the speculating pool's summary when they changed."""

        def wanted_for(status: Mapping[str, Any], spec: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
            current = find_condition(status.get("conditions"), SPECULATIVE_DECODING)
            asked = requested_pool(spec, status.get("mode") or spec.get("mode"))
            pools: dict[str, Any] = {
                c: None for c, pool in (status.get("pools") or {}).items() if (pool or {}).get("speculative")
            }
            if asked is None:
                return None, pools
            component, wanted = asked
            summary = pool_summary([r for r in reports if r.component == component], wanted)
            pools[component] = summary
            fields = condition_fields(component, summary)
            return condition(SPECULATIVE_DECODING, *fields, rfc3339(now), current, generation), pools

        def patch_for(status: Mapping[str, Any], spec: Mapping[str, Any]) -> dict[str, Any] | None:
            cond, pools = wanted_for(status, spec)
            have = status.get("pools") or {}
            pool_patch = {
                c: {"speculative": v} for c, v in pools.items() if (have.get(c) or {}).get("speculative") != v
            }
            patch = conditions_patch(status, SPECULATIVE_DECODING, cond) or {}
            if pool_patch:
                patch["pools"] = pool_patch
            return patch or None

        if patch_for(body.get("status") or {}, body.get("spec") or {}) is None:
            return
        live = await self.kube.get_deployment(namespace, name)
        if live is None or live["metadata"].get("deletionTimestamp"):
            return
        patch = patch_for(live.get("status") or {}, live.get("spec") or {})
        if patch is not None:
            await self.kube.patch_status(
                namespace, name, patch, resource_version=live["metadata"].get("resourceVersion")
            )

    async def _remediate(
        self,
        namespace: str,
        body: Mapping[str, Any],
        reports: list[OutputReport],
        memory: _Memory,
        now: float,
    ) -> None:
        remediation = (body.get("spec") or {}).get("remediation") or {}
        if not remediation.get("restartOnOutputFailure"):
            return
        base = float(remediation.get("restartBackoffSeconds", 60))
        cap = float(remediation.get("maxRestartBackoffSeconds", 1800))
        for victim in choose_restarts(reports, memory.restarts, now, base, cap):
            message = f"deleting {victim.pod} ({victim.component}): output self-test fails {victim.failing_check} ({victim.reason}); a fresh start re-compiles its kernels"
            log.warning("%s/%s %s", namespace, body.get("metadata", {}).get("name"), message)
            try:
                await self.kube.delete_pod(namespace, victim.pod)
            except Exception as error:  # the next round tries again (memory keeps the backoff)
                log.warning("deleting %s/%s failed: %s", namespace, victim.pod, error)
                memory.restarts.in_progress.pop(victim.component, None)
                continue
            self._event(body, "Warning", "RestartingForOutput", message)

    def _event(self, body: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
        if self.post_event is not None:
            self.post_event(body, kind, reason, message)
