"""KVTransferHealthy: the pure condition from `/health/kv` answers, the collection against loopback
servers (healthy, failing, dead, slow), the monitor's writes, and Degraded following the condition."""

from __future__ import annotations

import asyncio
import copy
import socket
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from operator_specs import DEEPSEEK_SPEC, TINY_SPEC
from sovereign_operator.api import LLMDeploymentSpec
from sovereign_operator.api.status import LLMDeploymentStatus
from sovereign_operator.kvhealth import (
    KV_TRANSFER_HEALTHY,
    Counters,
    KVReport,
    conditions_patch,
    kv_condition,
    kv_condition_fields,
)
from sovereign_operator.kvmonitor import KVHealthMonitor, read_kv_health
from sovereign_operator.observe import Observed, compute_status, status_patch
from sovereign_operator.render import ClusterFacts, DeploymentRef, render

BOTH = {"prefill": 1, "decode": 1}


def answer(
    role: str = "decode",
    transport: str = "tcp",
    healthy: bool = True,
    ok: int = 5,
    fallbacks: int = 0,
    error: str | None = None,
) -> dict[str, Any]:
    return {
        "role": role,
        "transport": transport,
        "address": "10.0.0.7:8001" if role == "decode" else None,
        "transfers_ok": ok,
        "transfers_failed": 0 if error is None else 1,
        "fallbacks": fallbacks,
        "bytes": 1000,
        "tokens": 10,
        "last_error": error,
        "last_error_time": 1767225600.0 if error else None,
        "healthy": healthy,
    }


def reports(
    decode: dict[str, Any] | None, prefill: dict[str, Any] | None = None, error: str = ""
) -> list[KVReport]:
    return [
        KVReport("llm-prefill-0", "prefill", body=prefill or answer("prefill")),
        KVReport("llm-decode-0", "decode", body=decode, error=error or None),
    ]


# (name, mode, requested transport, ready pods, reports, previous counters, status, reason, message parts)
CASES: list[
    tuple[str, str, str | None, dict[str, int], list[KVReport], dict[str, Counters], str, str, list[str]]
] = [
    (
        "healthy tcp",
        "disaggregated",
        "tcp",
        BOTH,
        reports(answer()),
        {},
        "True",
        "TransfersHealthy",
        ["over tcp"],
    ),
    (
        "healthy rdma",
        "disaggregated",
        "rdma",
        BOTH,
        reports(answer(transport="rdma"), answer("prefill", "rdma")),
        {},
        "True",
        "TransfersHealthy",
        ["1 prefill, 1 decode", "over rdma"],
    ),
    (
        "decode not ready",
        "disaggregated",
        "rdma",
        {"prefill": 1, "decode": 0},
        reports(answer())[:1],
        {},
        "Unknown",
        "PodsNotReady",
        ["decode 0 ready"],
    ),
    (
        "rdma requested, tcp used",
        "disaggregated",
        "rdma",
        BOTH,
        reports(answer(transport="tcp"), answer("prefill", "rdma")),
        {},
        "False",
        "RDMANotInUse",
        ["RDMA was requested", "llm-decode-0", "reports transport tcp"],
    ),
    (
        "failing",
        "disaggregated",
        "tcp",
        BOTH,
        reports(answer(healthy=False, error="room 7: connection reset")),
        {},
        "False",
        "TransferFailing",
        ["llm-decode-0 (decode, tcp, 10.0.0.7:8001)", "room 7: connection reset", "2026-01-01T00:00:00Z"],
    ),
    (
        "dead pod",
        "disaggregated",
        "tcp",
        BOTH,
        reports(None, error="ClientConnectorError: refused"),
        {},
        "False",
        "Unreachable",
        ["llm-decode-0", "refused"],
    ),
    (
        "new fallbacks since the last round",
        "disaggregated",
        "tcp",
        BOTH,
        reports(answer(fallbacks=3)),
        {"llm-decode-0": Counters(fallbacks=1)},
        "False",
        "FallingBack",
        ["llm-decode-0 fall back to local prefill", "transport tcp"],
    ),
    (
        "old fallbacks only",
        "disaggregated",
        "tcp",
        BOTH,
        reports(answer(fallbacks=3)),
        {"llm-decode-0": Counters(fallbacks=3)},
        "True",
        "TransfersHealthy",
        [],
    ),
    (
        "first look: only ever fell back",
        "disaggregated",
        "tcp",
        BOTH,
        reports(answer(fallbacks=2, ok=0)),
        {},
        "False",
        "FallingBack",
        [],
    ),
    (
        "failing over tcp while rdma requested: both said, failing first",
        "disaggregated",
        "rdma",
        BOTH,
        reports(answer(healthy=False, error="boom"), answer("prefill", "rdma")),
        {},
        "False",
        "TransferFailing",
        ["boom", "RDMA was requested"],
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_condition_fields(case: tuple[Any, ...]) -> None:
    _, mode, transport, ready, answers, previous, status, reason, parts = case
    fields = kv_condition_fields(mode, transport, ready, answers, previous)
    assert fields is not None
    assert fields[:2] == (status, reason)
    for part in parts:
        assert part in fields[2]


def test_unified_has_no_condition_and_the_patch_removes_it_keeping_others() -> None:
    assert kv_condition_fields("unified", None, {"unified": 2}, [], None) is None
    others = {"type": "MetricsAvailable", "status": "True", "reason": "MetricsAvailable"}
    old = kv_condition(("True", "TransfersHealthy", "ok"), None, 0.0)
    assert conditions_patch({"conditions": [others, old]}, None) == {"conditions": [others]}
    assert conditions_patch({"conditions": [others]}, None) is None


def test_transition_time_moves_only_on_a_flip_and_same_words_need_no_write() -> None:
    first = kv_condition(("True", "TransfersHealthy", "ok"), None, 0.0, 3)
    again = kv_condition(("True", "TransfersHealthy", "ok"), first, 600.0, 3)
    assert again == first and conditions_patch({"conditions": [first]}, again) is None
    flipped = kv_condition(("False", "Unreachable", "x"), first, 600.0, 3)
    assert flipped["lastTransitionTime"] == "1970-01-01T00:10:00Z"
    assert conditions_patch({"conditions": [first]}, flipped) == {"conditions": [flipped]}


def test_many_pods_are_counted_not_all_named() -> None:
    many = [KVReport(f"llm-decode-{i}", "decode", error="timeout") for i in range(6)]
    fields = kv_condition_fields("disaggregated", "tcp", {"prefill": 1, "decode": 6}, many, None)
    assert fields is not None and "and 3 more" in fields[2] and "llm-decode-5" not in fields[2]


# ---- collection against loopback servers ----------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@asynccontextmanager
async def kv_servers(
    bodies: Mapping[str, tuple[int, dict[str, Any] | None, float]],
) -> AsyncIterator[dict[str, int]]:
    """One aiohttp server per pod on 127.0.0.1: (HTTP status, body, delay before answering)."""
    runners, ports = [], {}
    for pod, (code, body, delay) in bodies.items():

        async def handler(
            request: web.Request, code: int = code, body: Any = body, delay: float = delay
        ) -> web.Response:
            await asyncio.sleep(delay)
            return web.json_response(body, status=code)

        app = web.Application()
        app.router.add_get("/health/kv", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        ports[pod] = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield ports
    finally:
        for runner in runners:
            await runner.cleanup()


def test_read_kv_health_healthy_failing_dead_and_slow() -> None:
    async def main() -> None:
        servers = {
            "ok": (200, answer(), 0.0),
            "failing": (503, answer(healthy=False, error="boom"), 0.0),
            "slow": (200, answer(), 1.0),
        }
        async with kv_servers(servers) as ports, aiohttp.ClientSession() as session:
            ports["dead"] = _free_port()
            got = {
                pod: await read_kv_health(session, pod, "decode", f"http://127.0.0.1:{port}/health/kv", 0.3)
                for pod, port in ports.items()
            }
        assert got["ok"].body is not None and got["ok"].body["healthy"] is True
        assert got["failing"].body is not None and got["failing"].body["last_error"] == "boom"
        # One text for every way of not reaching a pod: a timeout one round and a refusal the next
        # must not rewrite the condition (its message carries this text).
        assert got["dead"].body is None and got["dead"].error == "not reachable within 0.3 s"
        assert got["slow"].body is None and got["slow"].error == "not reachable within 0.3 s"

    asyncio.run(main())


def _pod(name: str, component: str, ready: bool = True) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"app.kubernetes.io/component": component}},
        "status": {"podIP": name, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


class MonitorKube:
    def __init__(self, status: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        self.body: dict[str, Any] = {
            "metadata": {"name": "llm", "namespace": "ns", "generation": 2, "resourceVersion": "1"},
            "status": status,
        }
        self.pods = pods
        self.writes: list[dict[str, Any]] = []
        self.reads = 0

    async def get_deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads += 1
        return copy.deepcopy(self.body)

    async def observe(self, namespace: str, instance: str) -> Observed:
        return Observed(pods=copy.deepcopy(self.pods))

    async def patch_status(
        self, namespace: str, name: str, patch: dict[str, Any], resource_version: str | None = None
    ) -> None:
        assert resource_version == self.body["metadata"]["resourceVersion"]
        self.writes.append(copy.deepcopy(patch))
        self.body["status"].update(copy.deepcopy(patch))


def test_monitor_writes_on_change_only_refreshes_degraded_and_clears_on_unified() -> None:
    metrics_cond = {"type": "MetricsAvailable", "status": "True", "reason": "MetricsAvailable"}
    status = {"mode": "disaggregated", "kvTransport": "rdma", "conditions": [metrics_cond]}
    pods = [
        _pod("llm-prefill-0", "prefill"),
        _pod("llm-decode-0", "decode"),
        _pod("llm-decode-1", "decode", False),
    ]
    kube = MonitorKube(status, pods)
    refreshed: list[tuple[str, str]] = []

    async def refresh(namespace: str, name: str) -> None:
        refreshed.append((namespace, name))

    async def main() -> None:
        servers = {
            "llm-prefill-0": (200, answer("prefill", "rdma"), 0.0),
            "llm-decode-0": (200, answer(transport="tcp"), 0.0),
        }
        async with kv_servers(servers) as ports, aiohttp.ClientSession() as session:
            clock = [1000.0]
            monitor = KVHealthMonitor(
                kube,
                lambda: session,
                on_change=refresh,
                pod_url=lambda p: f"http://127.0.0.1:{ports[p['status']['podIP']]}/health/kv",
                clock=lambda: clock[0],
                timeout_s=1.0,
            )
            cond = await monitor.tick("ns", "llm", kube.body)
            assert cond is not None and (cond["status"], cond["reason"]) == ("False", "RDMANotInUse")
            assert "llm-decode-0" in cond["message"] and "llm-decode-1" not in cond["message"]
            assert kube.writes == [{"conditions": [metrics_cond, cond]}] and refreshed == [("ns", "llm")]
            assert not monitor.due("ns", "llm")
            # Ready with KV health not known yet: every tick until it is.
            ready = {"type": "Ready", "status": "True", "reason": "AllReplicasReady"}
            unknown = {**cond, "status": "Unknown"}
            assert monitor.due("ns", "llm", {"status": {**status, "conditions": [ready, unknown]}})
            assert not monitor.due("ns", "llm", {"status": {**status, "conditions": [ready, cond]}})
            assert not monitor.due("ns", "llm", {"status": {**status, "conditions": [unknown]}})
            # Steady state: same answers, no read of the object, no write.
            clock[0] += 15
            assert monitor.due("ns", "llm")
            reads = kube.reads
            assert await monitor.tick("ns", "llm", kube.body) == cond
            assert len(kube.writes) == 1 and kube.reads == reads and len(refreshed) == 1
            # Back to unified: the condition goes, the others stay.
            kube.body["status"]["mode"] = "unified"
            assert await monitor.tick("ns", "llm", kube.body) is None
            assert kube.writes[-1] == {"conditions": [metrics_cond]}
            assert await monitor.tick("ns", "llm", kube.body) is None and len(kube.writes) == 2

    asyncio.run(main())


def test_monitor_reports_a_dead_and_a_timed_out_pod_as_unreachable() -> None:
    status = {"mode": "disaggregated", "kvTransport": "tcp", "conditions": []}
    pods = [_pod("llm-prefill-0", "prefill"), _pod("llm-decode-0", "decode"), _pod("llm-decode-1", "decode")]
    kube = MonitorKube(status, pods)

    async def main() -> None:
        servers = {"llm-prefill-0": (200, answer("prefill"), 0.0), "llm-decode-1": (200, answer(), 1.0)}
        async with kv_servers(servers) as ports, aiohttp.ClientSession() as session:
            ports["llm-decode-0"] = _free_port()
            monitor = KVHealthMonitor(
                kube,
                lambda: session,
                pod_url=lambda p: f"http://127.0.0.1:{ports[p['status']['podIP']]}/health/kv",
                timeout_s=0.3,
            )
            cond = await monitor.tick("ns", "llm", kube.body)
        assert cond is not None and (cond["status"], cond["reason"]) == ("False", "Unreachable")
        assert "llm-decode-0, llm-decode-1" in cond["message"]

    asyncio.run(main())


# ---- Degraded follows the condition (reconciler side) ---------------------------------------------


def _ready_observed() -> Observed:
    def sts() -> dict[str, Any]:
        status = {"observedGeneration": 1, "replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}
        return {"metadata": {"generation": 1}, "status": status}

    router = {"spec": {"replicas": 1}, "status": {"readyReplicas": 1}}
    return Observed(statefulsets={"prefill": sts(), "decode": sts(), "unified": sts()}, router=router)


@pytest.mark.parametrize(
    ("spec", "kv_status", "degraded"),
    [
        (DEEPSEEK_SPEC, "False", ("True", "KVTransferUnhealthy")),
        (DEEPSEEK_SPEC, "True", ("False", "AsExpected")),
        (DEEPSEEK_SPEC, "Unknown", ("False", "AsExpected")),
        (TINY_SPEC, "False", ("False", "AsExpected")),  # unified: a leftover condition does not count
    ],
)
def test_degraded_follows_a_false_kv_condition_while_ready_stays(
    spec: dict[str, Any], kv_status: str, degraded: tuple[str, str]
) -> None:
    ref = DeploymentRef(name="llm", namespace="ns", uid="u", generation=2)
    rendered = render(ref, LLMDeploymentSpec.model_validate(spec), ClusterFacts())
    kv = kv_condition(
        (kv_status, "RDMANotInUse", "RDMA was requested but llm-decode-0 reports tcp"), None, 0.0
    )
    current = {"conditions": [kv]}
    previous = LLMDeploymentStatus.model_validate(current)
    status = compute_status(2, rendered, _ready_observed(), previous, "2026-01-01T00:00:00Z")
    conds = {c.type: c for c in status.conditions}
    assert (conds["Degraded"].status, conds["Degraded"].reason) == degraded
    assert conds["Ready"].status == "True"
    if degraded[0] == "True":
        assert "llm-decode-0 reports tcp" in conds["Degraded"].message
    patch = status_patch(current, status)
    assert patch is not None and kv in patch["conditions"]  # the monitor's condition is kept
    assert sum(c["type"] == KV_TRANSFER_HEALTHY for c in patch["conditions"]) == 1
