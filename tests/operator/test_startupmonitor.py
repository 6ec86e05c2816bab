"""The startup monitor against loopback `/health/startup` answers, fed with pod events as the kopf
watch delivers them: phases remembered per container life, one Event per restart naming the phase,
nothing read or written in steady state, and a status refresh only when what status shows changed."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import aiohttp
from aiohttp import web
from loopback import serve_app
from sovereign_operator.podstatus import LifeMemory, StartupReport
from sovereign_operator.startupmonitor import StartupMonitor, parse_report
from sovereign_operator.vocabulary import parse_rfc3339, rfc3339

T0 = parse_rfc3339("2026-03-01T10:00:00Z") or 0.0
BODY = {
    "metadata": {"name": "llm", "namespace": "ns", "uid": "u-llm"},
    "status": {"startupBudget": {"seconds": 30, "overridden": True}},
}


def _pod(
    life: str,
    *,
    started: bool = False,
    ready: bool = False,
    last: dict[str, Any] | None = None,
    name: str = "llm-unified-0",
    component: str = "unified",
) -> dict[str, Any]:
    status: dict[str, Any] = {
        "name": "runtime",
        "containerID": life,
        "started": started,
        "ready": ready,
        "state": {"running": {"startedAt": rfc3339(T0)}},
        "lastState": {"terminated": last} if last else {},
    }
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": f"uid-{name}",
            "labels": {"app.kubernetes.io/instance": "llm", "app.kubernetes.io/component": component},
        },
        "spec": {
            "terminationGracePeriodSeconds": 165,
            "containers": [
                {
                    "name": "runtime",
                    "resources": {"limits": {"memory": "4Gi"}},
                    "startupProbe": {"periodSeconds": 10, "failureThreshold": 3},
                }
            ],
        },
        "status": {
            "phase": "Running",
            "podIP": "10.0.0.9",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": [status],
        },
    }


def _ended(life: str, reason: str, code: int, ran_s: float) -> dict[str, Any]:
    return {
        "containerID": life,
        "reason": reason,
        "exitCode": code,
        "startedAt": rfc3339(T0 - ran_s),
        "finishedAt": rfc3339(T0),
    }


class Runtime:
    """`/{pod}/health/startup` as the runtime answers it while it starts (503 + phase) and once ready."""

    def __init__(self) -> None:
        self.phase = "loading_weights"
        self.progress = 0.2
        self.reads = 0
        self.app = web.Application()
        self.app.router.add_get("/{pod}/health/startup", self.startup)

    async def startup(self, request: web.Request) -> web.Response:
        self.reads += 1
        body = {"phase": self.phase, "elapsed_s": 3.0}
        if self.phase != "ready":
            body |= {"progress": self.progress, "detail": "held by --debug-hold-compiling-s (test only)"}
        return web.json_response(body, status=200 if self.phase == "ready" else 503)


def test_reports_parse_the_runtimes_startup_body() -> None:
    report = parse_report({"phase": "compiling", "progress": 0.5, "detail": "d", "elapsed_s": 1})
    assert report == StartupReport("compiling", 0.5, "d")
    assert parse_report({"phase": "ready", "elapsed_s": 9}) == StartupReport("ready", None, "")
    assert parse_report({"status": "ok"}) is None and parse_report(None) is None


def test_a_startup_probe_restart_is_one_event_naming_the_phase_and_steady_state_reads_nothing() -> None:
    async def scenario() -> None:
        runtime = Runtime()
        events: list[tuple[str, str, str]] = []
        refreshes: list[tuple[str, str]] = []

        async def refresh(namespace: str, name: str) -> None:
            refreshes.append((namespace, name))

        async with serve_app(runtime.app) as base, aiohttp.ClientSession() as session:
            monitor = StartupMonitor(
                lambda: session,
                post_event=lambda body, kind, reason, message: events.append((kind, reason, message)),
                on_change=refresh,
                pod_url=lambda pod: f"{base}/{pod['metadata']['name']}/health/startup",
                clock=lambda: T0 + 10,
            )
            # A life starts: its phase is read every round, a refresh only when the phase changes.
            monitor.pod_event(None, _pod("containerd://one"))
            await monitor.tick("ns", "llm", BODY)
            assert refreshes == [("ns", "llm")]
            runtime.progress = 0.3
            await monitor.tick("ns", "llm", BODY)
            assert len(refreshes) == 1  # progress alone: nothing status shows
            runtime.phase, runtime.progress = "compiling", 0.45
            await monitor.tick("ns", "llm", BODY)
            assert len(refreshes) == 2
            life = monitor.lives("ns", "llm")["containerd://one"]
            assert life.last_report is not None and life.last_report.phase == "compiling"

            # The probe runs out (30 s): the kubelet stops the container (the preStop drain makes the
            # runtime exit 0) and starts a new life.
            killed_life = _ended("containerd://one", "Completed", 0, 29)
            killed = _pod("containerd://two", last=killed_life)
            monitor.pod_event("MODIFIED", killed)
            runtime.phase, runtime.progress = "loading_weights", 0.1
            await monitor.tick("ns", "llm", BODY)
            ((kind, reason, message),) = events
            assert (kind, reason) == ("Warning", "StartupProbeFailed")
            assert "llm-unified-0" in message and "phase compiling (45 %" in message
            assert "spec.startup.budgetSeconds (30 s)" in message
            await monitor.tick("ns", "llm", BODY)
            assert len(events) == 1  # once per life

            # The new life starts and serves: no more reads, no refresh, no event.
            serving = _pod("containerd://two", started=True, ready=True, last=killed_life)
            monitor.pod_event("MODIFIED", serving)
            reads, refreshed = runtime.reads, len(refreshes)
            for _ in range(3):
                await monitor.tick("ns", "llm", BODY)
            assert runtime.reads == reads and len(refreshes) == refreshed and len(events) == 1
            # Only lives the pods still name are kept.
            assert set(monitor.lives("ns", "llm")) == {"containerd://two", "containerd://one"}

    asyncio.run(scenario())


def test_an_oom_kill_of_a_life_it_saw_is_an_event_and_old_kills_are_not() -> None:
    async def scenario() -> None:
        events: list[tuple[str, str]] = []
        async with aiohttp.ClientSession() as session:
            monitor = StartupMonitor(
                lambda: session,
                post_event=lambda body, kind, reason, message: events.append((reason, message)),
                pod_url=lambda pod: None,
                clock=lambda: T0,
            )
            # Killed before this operator started: nothing it saw, no Event (the condition still says it).
            old = _pod(
                "containerd://b", last=_ended("containerd://a", "OOMKilled", 137, 500), name="llm-unified-1"
            )
            monitor.pod_event(None, old)
            monitor.pod_event(None, _pod("containerd://x", started=True, ready=True))
            await monitor.tick("ns", "llm", BODY)
            assert events == []
            monitor.pod_event(
                "MODIFIED", _pod("containerd://y", last=_ended("containerd://x", "OOMKilled", 137, 900))
            )
            await monitor.tick("ns", "llm", BODY)
            ((reason, message),) = events
            assert (
                reason == "OOMKilled"
                and "(4Gi)" in message
                and "spec.decode.resources.limits.memory" in message
            )

    asyncio.run(scenario())


def test_readiness_failing_for_long_asks_for_one_refresh_when_it_starts_and_one_when_it_ends() -> None:
    async def scenario() -> None:
        now = [T0]
        refreshes: list[str] = []

        async def refresh(namespace: str, name: str) -> None:
            refreshes.append(name)

        async with aiohttp.ClientSession() as session:
            monitor = StartupMonitor(
                lambda: session, on_change=refresh, pod_url=lambda pod: None, clock=lambda: now[0]
            )
            stuck = _pod("containerd://s", started=True, ready=False)
            stuck["status"]["conditions"][0]["lastTransitionTime"] = rfc3339(T0)
            monitor.pod_event(None, stuck)
            await monitor.tick("ns", "llm", BODY)
            assert refreshes == []
            now[0] = T0 + 200  # past the grace: no pod event announces that, the round does
            await monitor.tick("ns", "llm", BODY)
            await monitor.tick("ns", "llm", BODY)
            assert refreshes == ["llm"]
            monitor.pod_event("MODIFIED", _pod("containerd://s", started=True, ready=True))
            await monitor.tick("ns", "llm", BODY)
            assert refreshes == ["llm", "llm"]

    asyncio.run(scenario())


def test_deleted_pods_and_forgotten_deployments_leave_no_memory() -> None:
    monitor = StartupMonitor(lambda: None)  # type: ignore[arg-type,return-value]
    pod = _pod("containerd://z", started=True)
    monitor.pod_event(None, pod)
    assert monitor.lives("ns", "llm") == {"containerd://z": LifeMemory(None, started=True)}
    monitor.pod_event("DELETED", copy.deepcopy(pod))
    assert monitor.starting("ns", "llm") == []
    monitor.forget("ns", "llm")
    assert monitor.lives("ns", "llm") == {}
    # A pod's DELETED event after the deployment was forgotten (its namespace going) keeps nothing.
    monitor.pod_event("DELETED", copy.deepcopy(pod))
    assert not monitor._pods and not monitor._lives
