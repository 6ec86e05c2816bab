"""The output monitor against loopback pods: condition writes, events, the restart of a failing pod."""

from __future__ import annotations

import asyncio
import copy
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from sovereign_operator.outputhealth import OUTPUT_HEALTHY, OutputReport
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
async def pods_serving(answers: dict[str, dict[str, Any] | None], delay_s: float = 0.0) -> AsyncIterator[str]:
    """One loopback server; ``/{pod}/health/startup`` answers ``answers[pod]`` (None: 500 without JSON)
    after ``delay_s``."""

    async def handler(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(delay_s)
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

    def post_event(body: Any, kind: str, reason: str, message: str) -> None:
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


async def _test_an_unreachable_pod_is_written_once_however_it_fails() -> None:
    # A pod IP that does not answer gives a timeout one round and a refusal (or no route) the next;
    # the condition must not be rewritten each round for that (the steady-state cluster test saw it).
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        refused = f"http://127.0.0.1:{probe.getsockname()[1]}"
    kube = FakeKube(_body(), [_pod("tiny-unified-0")])
    now = [0.0]
    async with pods_serving({"tiny-unified-0": _startup(True)}, delay_s=1.0) as slow:
        base = [refused]
        session = aiohttp.ClientSession()
        monitor = OutputHealthMonitor(
            kube,
            lambda: session,
            pod_url=lambda pod: f"{base[0]}/{pod['metadata']['name']}/health/startup",
            clock=lambda: now[0],
            timeout_s=0.2,
        )
        try:
            first = await monitor.tick("ns", "tiny", kube.body)
            base[0], now[0] = slow, 20.0
            second = await monitor.tick("ns", "tiny", kube.body)
        finally:
            await session.close()
    assert first is not None and second is not None
    assert (second["status"], second["reason"]) == ("Unknown", "Unreachable")
    assert "tiny-unified-0 (not reachable within 0.2 s)" in second["message"]
    assert first["message"] == second["message"] and len(kube.writes) == 1


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


def test_an_unreachable_pod_is_written_once_however_it_fails() -> None:
    asyncio.run(_test_an_unreachable_pod_is_written_once_however_it_fails())


def test_remediation_restarts_one_failing_pod_per_pool_with_backoff() -> None:
    asyncio.run(_test_remediation_restarts_one_failing_pod_per_pool_with_backoff())


def test_degraded_names_the_failing_self_test_and_the_condition_is_kept() -> None:
    from operator_specs import TINY_SPEC
    from sovereign_operator.api import LLMDeploymentSpec
    from sovereign_operator.api.status import LLMDeploymentStatus
    from sovereign_operator.observe import Observed, compute_status, status_patch
    from sovereign_operator.outputhealth import output_condition_fields
    from sovereign_operator.render import ClusterFacts, DeploymentRef, render
    from sovereign_operator.vocabulary import condition

    ref = DeploymentRef(name="llm", namespace="ns", uid="u", generation=2)
    rendered = render(ref, LLMDeploymentSpec.model_validate(TINY_SPEC), ClusterFacts())
    reports = [OutputReport("llm-unified-0", "unified", _startup(False))]
    out = condition(OUTPUT_HEALTHY, *output_condition_fields(reports), "2026-01-01T00:00:00Z")
    current = {"conditions": [out]}
    sts = {
        "metadata": {"generation": 1},
        "status": {"observedGeneration": 1, "replicas": 1, "readyReplicas": 1},
    }
    observed = Observed(
        statefulsets={"unified": sts}, router={"spec": {"replicas": 1}, "status": {"readyReplicas": 1}}
    )
    status = compute_status(
        2, rendered, observed, LLMDeploymentStatus.model_validate(current), "2026-01-01T00:00:00Z"
    )
    degraded = next(c for c in status.conditions if c.type == "Degraded")
    assert (degraded.status, degraded.reason) == ("True", "OutputUnhealthy")
    assert "llm-unified-0 fails batch_invariance" in degraded.message
    patch = status_patch(current, status)
    assert patch is not None and out in patch["conditions"]  # the monitor's condition is kept


def test_the_autoscaler_counts_a_failing_pod_as_neither_capacity_nor_starting() -> None:
    from sovereign_operator.autoscale.controller import pool_replicas

    def pod(name: str, ready: bool) -> dict[str, Any]:
        return {
            "metadata": {"name": name},
            "status": {
                "phase": "Running",
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            },
        }

    sts = {"spec": {"replicas": 3}, "status": {"replicas": 3}}
    pods = [pod("p-0", True), pod("p-1", False), pod("p-2", False)]
    reps = pool_replicas(sts, pods, 0.0, {"p-1"})
    assert (reps.ready, reps.starting, reps.output_failing) == (1, 1, 1)


def test_the_policy_sizes_the_pool_as_if_failing_pods_were_absent() -> None:
    from sovereign_operator.autoscale import (
        AutoscalerConfig,
        PoolConfig,
        PoolInput,
        PoolMetrics,
        PoolReplicas,
        decide,
    )

    pool = PoolConfig(
        min_replicas=1,
        max_replicas=10,
        ttft_target_s=None,
        itl_target_s=None,
        kv_cache_usage_target=0.7,
        prompt_tokens_waiting_target=None,
    )
    config = AutoscalerConfig(interval_s=15.0, scale_up_stabilization_s=0.0)

    def desired_after(failing: int) -> int:
        state: dict[str, Any] = {}
        decision = None
        for i in range(3):
            now = i * 15.0
            # Two serving pods at 95 % KV usage: three serving pods meet the 70 % target.
            metrics = PoolMetrics(
                observed_at=now,
                pods_reporting=2,
                pods_expected=2,
                kv_cache_usage_mean=0.95,
                kv_cache_usage_max=0.95,
            )
            replicas = PoolReplicas(desired=2 + failing, current=2 + failing, ready=2, output_failing=failing)
            decisions, state = decide(
                now,
                {"p": PoolInput(role="decode", replicas=replicas, metrics=metrics)},
                {"p": pool},
                config,
                state,
            )
            decision = decisions["p"]
        assert decision is not None
        return decision.desired

    assert desired_after(0) == 3
    # 2 serving + 1 failing: three serving pods are still needed, so four replicas (not "3 is enough").
    assert desired_after(1) == 4
