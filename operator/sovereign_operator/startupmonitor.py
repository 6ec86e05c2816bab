"""Watching pods start: the phase each starting runtime reports, so that a restart by its startup probe
can name the phase it cut short; Events for such restarts and for OOM kills.

Fed by the operator's pod watch (the pod informer, handlers.py), so it lists nothing itself; with
`pods_of` it reads the pods from the watch cache instead of keeping copies. Each loop
tick it reads `/health/startup` of the worker pods whose runtime container runs but has not started
(none in steady state, so then it makes no request and writes nothing), remembers per container life
(podstatus.py) the last report and whether the life started, and asks for a status refresh when what
status shows changed: the phase of a starting pod, or the set of pods whose readiness has failed too
long (a time-based fact no pod event announces). Status itself stays the reconciler's, computed from
this memory (Observed.lives).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp

from sovereign_operator.podhttp import get_pod_json
from sovereign_operator.podstatus import (
    OOM_KILLED,
    STARTUP_PROBE_FAILED,
    BudgetFacts,
    LifeMemory,
    StartupReport,
    container_statuses,
    current_life,
    ended_by_startup_probe,
    oom_message,
    previous_life,
    readiness_failing,
    referenced_lives,
    startup_kill_message,
)
from sovereign_operator.vocabulary import INSTANCE_LABEL, WORKER_COMPONENTS, pod_component, pod_url

log = logging.getLogger(__name__)
STARTUP_PATH = "/health/startup"
MAX_CONCURRENT_READS = 16

Key = tuple[str, str]
# post_event(deployment body, type "Normal"|"Warning", reason, message): events.EventPoster.post
PostEvent = Callable[[Mapping[str, Any], str, str, str], None]


def default_startup_url(pod: Mapping[str, Any]) -> str | None:
    return pod_url(pod, STARTUP_PATH)


def parse_report(body: Mapping[str, Any] | None) -> StartupReport | None:
    """A `/health/startup` body (200 ready, 503 starting) as a report; None when it is not one."""
    if not body or not isinstance(body.get("phase"), str):
        return None
    progress = body.get("progress")
    return StartupReport(
        phase=body["phase"],
        progress=float(progress) if isinstance(progress, int | float) else None,
        detail=str(body.get("detail") or ""),
    )


def _budget(body: Mapping[str, Any]) -> BudgetFacts | None:
    budget = (body.get("status") or {}).get("startupBudget") or {}
    seconds = budget.get("seconds")
    if not isinstance(seconds, int):
        return None
    return BudgetFacts(int(seconds), bool(budget.get("overridden")), str(budget.get("source") or "formula"))


class StartupMonitor:
    def __init__(
        self,
        http: Callable[[], aiohttp.ClientSession],
        *,
        post_event: PostEvent | None = None,
        on_change: Callable[[str, str], Awaitable[Any]] | None = None,
        pod_url: Callable[[Mapping[str, Any]], str | None] = default_startup_url,
        clock: Callable[[], float] = time.time,
        timeout_s: float = 2.0,
        pods_of: Callable[[str, str], list[dict[str, Any]]] | None = None,
    ) -> None:
        self.http = http
        self.post_event = post_event
        self.on_change = on_change
        self.pod_url = pod_url
        self.clock = clock
        self.timeout_s = timeout_s
        # The pods of a deployment, from the watch cache; without it, copies kept from pod events.
        self.pods_of = pods_of
        self._pods: dict[Key, dict[str, dict[str, Any]]] = {}
        self._lives: dict[Key, dict[str, LifeMemory]] = {}
        self._reported: dict[Key, set[str]] = {}
        self._overdue: dict[Key, frozenset[str]] = {}
        self._reads = asyncio.Semaphore(MAX_CONCURRENT_READS)

    # ---- fed by the pod watch --------------------------------------------------------------------

    def pod_event(self, event_type: str | None, pod: Mapping[str, Any]) -> None:
        """Keep the pod (or drop it when DELETED) and mark lives that have started."""
        meta = pod.get("metadata") or {}
        instance = (meta.get("labels") or {}).get(INSTANCE_LABEL)
        if not instance or not meta.get("namespace") or not meta.get("name"):
            return
        key = (meta["namespace"], instance)
        if event_type == "DELETED":
            # The last pod of a deployment takes its entry along: nothing stays for a deleted one.
            pods = self._pods.get(key)
            if pods is not None:
                pods.pop(meta["name"], None)
                if not pods:
                    del self._pods[key]
        else:
            if self.pods_of is None:
                self._pods.setdefault(key, {})[meta["name"]] = dict(pod)
            lives = self._lives.setdefault(key, {})
            for status in container_statuses(pod):
                life = current_life(pod, status)
                if life is None:
                    continue
                memory = lives.get(life) or LifeMemory()
                if status.get("started") is True and not memory.started:
                    memory = LifeMemory(memory.last_report, started=True)
                lives[life] = memory

    def _pods_now(self, key: Key) -> list[dict[str, Any]]:
        if self.pods_of is not None:
            return self.pods_of(*key)
        return list((self._pods.get(key) or {}).values())

    def lives(self, namespace: str, name: str) -> dict[str, LifeMemory]:
        """What the reconciler's status reads (Observed.lives)."""
        return dict(self._lives.get((namespace, name)) or {})

    def forget(self, namespace: str, name: str) -> None:
        for memory in (self._pods, self._lives, self._reported, self._overdue):
            memory.pop((namespace, name), None)  # type: ignore[attr-defined]

    # ---- one round ---------------------------------------------------------------------------------

    def starting(self, namespace: str, name: str) -> list[tuple[dict[str, Any], str]]:
        """(pod, life) of worker runtimes that run and have not started."""
        out = []
        for pod in self._pods_now((namespace, name)):
            if pod_component(pod) not in WORKER_COMPONENTS or pod["metadata"].get("deletionTimestamp"):
                continue
            for status in container_statuses(pod):
                life = current_life(pod, status)
                if life is not None and status.get("started") is not True:
                    out.append((pod, life))
        return out

    async def _read(self, url: str) -> StartupReport | None:
        async with self._reads:
            body, error = await get_pod_json(self.http(), url, self.timeout_s)
        return parse_report(body) if error is None else None

    async def tick(self, namespace: str, name: str, body: Mapping[str, Any]) -> None:
        key = (namespace, name)
        lives = self._lives.setdefault(key, {})
        changed = False

        targets = [(life, url) for pod, life in self.starting(namespace, name) if (url := self.pod_url(pod))]
        reports = await asyncio.gather(*(self._read(url) for _, url in targets))
        for (life, _), report in zip(targets, reports, strict=True):
            if report is None:
                continue
            before = lives.get(life) or LifeMemory()
            changed |= before.last_report is None or before.last_report.phase != report.phase
            lives[life] = LifeMemory(report, started=before.started or report.phase == "ready")

        pods = self._pods_now(key)
        self._report_ended_lives(key, body, pods, lives)

        overdue = frozenset(p.pod for p in readiness_failing(pods, self.clock()))
        changed |= overdue != self._overdue.get(key, frozenset())
        self._overdue[key] = overdue

        keep = referenced_lives(pods)
        self._lives[key] = {life: memory for life, memory in lives.items() if life in keep}
        self._reported[key] = {life for life in self._reported.get(key, set()) if life in keep}
        if changed and self.on_change is not None:
            try:
                await self.on_change(namespace, name)
            except Exception as error:  # the next pod event refreshes status anyway
                log.warning("status refresh for %s/%s failed: %s", namespace, name, error)

    def _report_ended_lives(
        self, key: Key, body: Mapping[str, Any], pods: list[dict[str, Any]], lives: Mapping[str, LifeMemory]
    ) -> None:
        """One Event per life this operator saw run that ended by the startup probe or an OOM kill."""
        reported = self._reported.setdefault(key, set())
        for pod in pods:
            for status in container_statuses(pod):
                life = previous_life(pod, status)
                if life is None or life not in lives or life in reported:
                    continue
                ended = (status.get("lastState") or {}).get("terminated") or {}
                if ended.get("reason") == "OOMKilled":
                    self._event(body, OOM_KILLED, oom_message(pod, status))
                    reported.add(life)
                    continue
                kill = ended_by_startup_probe(pod, status, lives)
                if kill is not None:
                    message = startup_kill_message(kill, _budget(body))
                    log.warning("%s/%s %s", key[0], key[1], message)
                    self._event(body, STARTUP_PROBE_FAILED, message)
                    reported.add(life)

    def _event(self, body: Mapping[str, Any], reason: str, message: str) -> None:
        if self.post_event is not None:
            self.post_event(body, "Warning", reason, message)
