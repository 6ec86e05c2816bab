"""The output monitor against loopback pods: condition writes, events, the restart of a failing pod."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from sovereign_operator.outputhealth import OUTPUT_HEALTHY
from sovereign_operator.outputmonitor import OutputHealthMonitor


def _pod(name: str, component: str = "unified", uid: str = "u", phase: str = "Running") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "uid": uid, "labels": {"app.kubernetes.io/component": component}},
        "status": {"phase": phase, "podIP": "127.0.0.1"},
    }


def _startup(passed: bool) -> dict[str, Any]:
    return {
        "phase": "ready",
        "self_test": {
            "passed": passed,
            "failing_check": None if passed else "batch_invariance",
            "reason": None if passed else "batch_invariance: prompt 0 in a batch of 3: token 24 vs 37",
        },
    }


@dataclass
class _Observed:
    pods: list[dict[str, Any]]


@dataclass
class FakeKube:
    body: dict[str, Any]
    pods: list[dict[str, Any]]
    writes: list[dict[str, Any]] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)

    async def get_deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.body)

    async def observe(self, namespace: str, instance: str) -> _Observed:
        return _Observed(copy.deepcopy(self.pods))

    async def patch_status(
        self, namespace: str, name: str, patch: dict[str, Any], resource_version: str | None = None
    ) -> None:
        self.writes.append(patch)
        self.body.setdefault("status", {}).update(copy.deepcopy(patch))

    async def delete_pod(self, namespace: str, name: str) -> None:
        self.deleted.append(name)


@asynccontextmanager
async def pods_serving(answers: dict[str, dict[str, Any] | None]) -> AsyncIterator[str]:
    """One loopback server; ``/{pod}/health/startup`` answers ``answers[pod]`` (None: 500 without JSON)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        body = answers.get(request.match_info["pod"])
        if body is None:
            return web.Response(status=500, text="boom")
        return web.json_response(body)

    app = web.Application()
    app.router.add_get("/{pod}/health/startup", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def _body(restart: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {"model": {"name": "tiny"}}
    if restart:
        spec["remediation"] = {
            "restartOnOutputFailure": True,
            "restartBackoffSeconds": 60,
            "maxRestartBackoffSeconds": 600,
        }
    return {
        "metadata": {"name": "tiny", "namespace": "ns", "generation": 3, "resourceVersion": "1"},
        "spec": spec,
    }


async def _monitor(
    kube: FakeKube, base: str, events: list[tuple[str, str]], now: list[float]
) -> tuple[OutputHealthMonitor, aiohttp.ClientSession]:
    session = aiohttp.ClientSession()

    async def post_event(body: Any, kind: str, reason: str, message: str) -> None:
        events.append((reason, message))

    monitor = OutputHealthMonitor(
        kube,
        lambda: session,
        post_event=post_event,
        pod_url=lambda pod: f"{base}/{pod['metadata']['name']}/health/startup",
        clock=lambda: now[0],
    )
    return monitor, session


async def _test_a_failing_pod_turns_the_condition_false_once_with_an_event_and_no_restart_by_default() -> (
    None
):
    kube = FakeKube(
        _body(), [_pod("tiny-unified-0"), _pod("tiny-unified-1"), _pod("tiny-unified-2", phase="Pending")]
    )
    answers = {"tiny-unified-0": _startup(True), "tiny-unified-1": _startup(False)}
    events: list[tuple[str, str]] = []
    async with pods_serving(answers) as base:
        monitor, session = await _monitor(kube, base, events, [1000.0])
        try:
            cond = await monitor.tick("ns", "tiny", kube.body)
            assert cond is not None and cond["type"] == OUTPUT_HEALTHY and cond["status"] == "False"
            assert "unified: tiny-unified-1 fails batch_invariance" in cond["message"]
            assert monitor.failing("ns", "tiny") == {"unified": {"tiny-unified-1"}}
            # Steady state: no second write, no second event.
            await monitor.tick("ns", "tiny", kube.body)
            assert len(kube.writes) == 1 and [e[0] for e in events] == ["OutputUnhealthy"]
            assert kube.deleted == []  # remediation is off by default
            answers["tiny-unified-1"] = _startup(True)
            cond = await monitor.tick("ns", "tiny", kube.body)
            assert (
                cond is not None
                and cond["status"] == "True"
                and [e[0] for e in events][-1] == "OutputHealthy"
            )
        finally:
            await session.close()


async def _test_an_unreadable_pod_is_unknown() -> None:
    kube = FakeKube(_body(), [_pod("tiny-unified-0")])
    async with pods_serving({"tiny-unified-0": None}) as base:
        monitor, session = await _monitor(kube, base, [], [0.0])
        try:
            cond = await monitor.tick("ns", "tiny", kube.body)
            assert cond is not None and (cond["status"], cond["reason"]) == ("Unknown", "Unreachable")
        finally:
            await session.close()


async def _test_remediation_restarts_one_failing_pod_per_pool_with_backoff() -> None:
    kube = FakeKube(_body(restart=True), [_pod("tiny-unified-0", uid="a"), _pod("tiny-unified-1", uid="b")])
    answers = {"tiny-unified-0": _startup(False), "tiny-unified-1": _startup(False)}
    events: list[tuple[str, str]] = []
    now = [0.0]
    async with pods_serving(answers) as base:
        monitor, session = await _monitor(kube, base, events, now)
        try:
            await monitor.tick("ns", "tiny", kube.body)
            assert kube.deleted == ["tiny-unified-0"]
            assert any(r == "RestartingForOutput" and "tiny-unified-0" in m for r, m in events)
            now[0] = 500.0  # the deleted pod has not come back (same uid still listed): no second restart
            await monitor.tick("ns", "tiny", kube.body)
            assert kube.deleted == ["tiny-unified-0"]
            kube.pods[0]["metadata"]["uid"] = "a2"  # the StatefulSet's replacement, failing again
            await monitor.tick("ns", "tiny", kube.body)
            assert kube.deleted == ["tiny-unified-0", "tiny-unified-0"]
        finally:
            await session.close()


def test_a_failing_pod_turns_the_condition_false_once_with_an_event_and_no_restart_by_default() -> None:
    asyncio.run(_test_a_failing_pod_turns_the_condition_false_once_with_an_event_and_no_restart_by_default())


def test_an_unreadable_pod_is_unknown() -> None:
    asyncio.run(_test_an_unreadable_pod_is_unknown())


def test_remediation_restarts_one_failing_pod_per_pool_with_backoff() -> None:
    asyncio.run(_test_remediation_restarts_one_failing_pod_per_pool_with_backoff())
