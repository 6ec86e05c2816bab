"""The autoscaler's tick against a fake apiserver and real HTTP metrics endpoints on 127.0.0.1."""

from __future__ import annotations

import asyncio
import copy
import itertools
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web
from sovereign_operator.api.status import LLMDeploymentStatus
from sovereign_operator.autoscale.controller import (
    AutoscaleController,
    measured_startup_seconds,
    pool_replicas,
)
from sovereign_operator.observe import Observed
from sovereign_operator.reconcile import replica_overrides

T0 = 1_700_000_000.0


def iso(ts: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(ts, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def pod(
    name: str, *, ready: bool = True, created: float = T0 - 600, ready_at: float = T0 - 300, **kw: Any
) -> dict:
    conditions = [{"type": "PodScheduled", "status": "True"}]
    conditions.append(
        {"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": iso(ready_at)}
    )
    status: dict[str, Any] = {"phase": "Running", "podIP": "127.0.0.1", "conditions": conditions}
    status.update(kw.get("status", {}))
    return {
        "metadata": {
            "name": name,
            "creationTimestamp": iso(created),
            "labels": {"app.kubernetes.io/component": kw.get("component", "unified")},
        },
        "status": status,
    }


def merge(target: dict[str, Any], patch: Mapping[str, Any]) -> None:
    """RFC 7386 JSON merge patch."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(target.get(key), dict):
            merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


class FakeKube:
    def __init__(self, body: dict[str, Any], replicas: int, pods: list[dict[str, Any]]) -> None:
        self.body = body
        self.replicas = replicas
        self.pods = pods
        self.patches: list[dict[str, Any]] = []

    async def get_deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.body)

    async def observe(self, namespace: str, instance: str) -> Observed:
        sts = {"spec": {"replicas": self.replicas}, "status": {"replicas": self.replicas}}
        return Observed(statefulsets={"unified": sts}, pods=self.pods)

    async def patch_status(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self.patches.append(copy.deepcopy(patch))
        merge(self.body.setdefault("status", {}), patch)


SPEC = {
    "model": {"name": "tiny", "source": {"builtin": "sovereign-tiny"}},
    "mode": "unified",
    "decode": {"autoscaling": {"minReplicas": 1, "maxReplicas": 4, "kvCacheUsageTarget": 0.5}},
    "autoscaling": {"scaleUpStabilizationSeconds": 0, "intervalSeconds": 15},
}


def body(spec: dict[str, Any] = SPEC) -> dict[str, Any]:
    return {
        "metadata": {"name": "tiny", "namespace": "llm", "uid": "u1", "generation": 3},
        "spec": copy.deepcopy(spec),
        "status": {
            "mode": "unified",
            "conditions": [{"type": "Ready", "status": "True", "reason": "X", "lastTransitionTime": iso(T0)}],
            "pools": {"unified": {"desiredReplicas": 2, "replicas": 2, "readyReplicas": 2}},
        },
    }


@asynccontextmanager
async def metrics_server(kv: dict[str, float]) -> AsyncIterator[int]:
    async def handler(request: web.Request) -> web.Response:
        usage = kv[request.match_info["pod"]]
        text = f'vllm:num_requests_running{{model_name="m"}} 3\nvllm:kv_cache_usage_perc{{model_name="m"}} {usage}\n'
        return web.Response(text=text)

    app = web.Application()
    app.router.add_get("/{pod}/metrics", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


def test_tick_scales_writes_status_posts_event_and_rerenders() -> None:
    kv = {"tiny-unified-0": 0.9, "tiny-unified-1": 0.9}
    kube = FakeKube(body(), 2, [pod("tiny-unified-0"), pod("tiny-unified-1")])
    reconciled: list[Mapping[str, Any]] = []
    events: list[dict[str, str]] = []
    clock = [T0]

    async def reconcile(b: Mapping[str, Any]) -> None:
        reconciled.append(copy.deepcopy(dict(b)))

    async def main() -> None:
        async with metrics_server(kv) as port:
            ctl = AutoscaleController(
                kube,
                reconcile,
                post_event=lambda b, e: events.append(e),
                pod_url=lambda p: f"http://127.0.0.1:{port}/{p['metadata']['name']}/metrics",
                clock=lambda: clock[0],
            )
            first = await ctl.tick("llm", "tiny")
            assert first is not None and first["unified"].desired == 3
            # Not due again until the interval has passed.
            clock[0] += 5
            assert await ctl.tick("llm", "tiny") is None
            # The new replica is starting: the next round holds and says why.
            kube.replicas = 3
            kube.pods.append(pod("tiny-unified-2", ready=False))
            clock[0] += 15
            second = await ctl.tick("llm", "tiny")
            assert second is not None and second["unified"].desired == 3
            assert second["unified"].limited_by == "starting"
            await ctl.close()

    asyncio.run(main())
    status = LLMDeploymentStatus.model_validate(kube.body["status"])
    auto = status.pools.unified.autoscaler  # type: ignore[union-attr]
    assert auto is not None and auto.desired_replicas == 3 and auto.signal == "kv_cache_usage"
    assert auto.value == 0.9 and auto.target == 0.5 and "still starting" in (auto.reason or "")
    assert [(h.from_, h.to) for h in auto.history] == [(2, 3)]
    conds = {c.type: c for c in status.conditions}
    assert conds["MetricsAvailable"].status == "True" and conds["Ready"].status == "True"
    # The operator-owned pool fields are untouched; spec is never part of a patch.
    assert status.pools.unified.desired_replicas == 2  # type: ignore[union-attr]
    assert all(set(p) <= {"pools", "conditions"} for p in kube.patches)
    assert (
        events == [{"type": "Normal", "reason": "ScaledUp", "message": events[0]["message"]}]
        and "2 -> 3" in events[0]["message"]
    )
    # Exactly one re-render, with the decision visible to rendering as an override.
    assert len(reconciled) == 1 and replica_overrides(reconciled[0]["status"]) == {"unified": 3}


def test_unreachable_pods_hold_and_set_metrics_available_false() -> None:
    kube = FakeKube(body(), 2, [pod("tiny-unified-0"), pod("tiny-unified-1")])
    reconciled: list[Any] = []

    async def reconcile(b: Mapping[str, Any]) -> None:
        reconciled.append(b)

    async def main() -> None:
        # Port 9 on loopback: connection refused at once.
        ctl = AutoscaleController(
            kube, reconcile, pod_url=lambda p: "http://127.0.0.1:9/metrics", clock=lambda: T0
        )
        decisions = await ctl.tick("llm", "tiny")
        assert decisions is not None and decisions["unified"].desired == 2
        await ctl.close()

    asyncio.run(main())
    cond = next(c for c in kube.body["status"]["conditions"] if c["type"] == "MetricsAvailable")
    assert cond["status"] == "False" and cond["reason"] == "MetricsUnavailable"
    assert "unified" in cond["message"] and "no pod answered" in cond["message"]
    assert reconciled == []


def test_fixed_replica_pools_are_left_alone() -> None:
    spec = copy.deepcopy(SPEC)
    spec["decode"] = {"replicas": 2}
    kube = FakeKube(body(spec), 2, [pod("tiny-unified-0")])

    async def reconcile(b: Mapping[str, Any]) -> None:
        raise AssertionError("must not re-render")

    async def main() -> None:
        ctl = AutoscaleController(kube, reconcile, clock=lambda: T0)
        assert await ctl.tick("llm", "tiny") is None

    asyncio.run(main())
    assert kube.patches == []


def test_pool_facts_from_pods() -> None:
    pending = pod("p-3", ready=False, created=T0 - 400)
    pending["status"] = {
        "phase": "Pending",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "lastTransitionTime": iso(T0 - 400),
            }
        ],
    }
    pods = [
        pod("p-0", created=T0 - 1000, ready_at=T0 - 800),
        pod("p-1", created=T0 - 1000, ready_at=T0 - 700),
        pod("p-2", ready=False),
        pending,
    ]
    sts = {"spec": {"replicas": 4}, "status": {"replicas": 4}}
    reps = pool_replicas(sts, pods, T0)
    assert (reps.desired, reps.ready, reps.starting, reps.pending_unschedulable) == (4, 2, 1, 1)
    assert reps.unschedulable_for == 400
    assert measured_startup_seconds(pods) == 250  # median of 200 and 300


def test_prometheus_replay_moves_replicas_up_then_down_and_status_explains() -> None:
    """A Prometheus-compatible endpoint replays a load series; the fake cluster follows every
    re-render (pods ready at once) so the loop runs closed."""
    spec = copy.deepcopy(SPEC)
    spec["autoscaling"] = {
        "metrics": {"source": "prometheus", "prometheusUrl": "http://placeholder"},
        "scaleUpStabilizationSeconds": 30,
        "scaleDownStabilizationSeconds": 300,
        "intervalSeconds": 15,
    }
    kube = FakeKube(body(spec), 2, [])
    clock = [T0]

    def load(now: float) -> float:  # KV demand in replicas at 100 %: up for 10 min, then idle
        return 1.8 if now - T0 < 600 else 0.2

    def sync_pods() -> None:
        kube.pods = [pod(f"tiny-unified-{i}") for i in range(kube.replicas)]

    async def reconcile(b: Mapping[str, Any]) -> None:
        kube.replicas = replica_overrides(b["status"])["unified"]
        sync_pods()

    async def api(request: web.Request) -> web.Response:
        query = request.query["query"]
        n = max(1, kube.replicas)
        if query.startswith("count("):
            value: float | None = float(n)
        elif query.startswith("min(timestamp("):
            value = clock[0]
        elif query.startswith("avg(vllm:kv_cache_usage_perc"):
            value = min(1.0, load(clock[0]) / n)
        elif query.startswith("sum(vllm:num_requests"):
            value = 0.0
        else:
            value = None  # latencies, backlog: no series
        result = [] if value is None else [{"metric": {}, "value": [clock[0], str(value)]}]
        return web.json_response({"status": "success", "data": {"resultType": "vector", "result": result}})

    desired: list[int] = []

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/api/v1/query", api)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        kube.body["spec"]["autoscaling"]["metrics"]["prometheusUrl"] = f"http://127.0.0.1:{port}"
        sync_pods()
        ctl = AutoscaleController(kube, reconcile, clock=lambda: clock[0])
        try:
            for _ in range(100):  # 25 minutes
                decisions = await ctl.tick("llm", "tiny")
                assert decisions is not None
                desired.append(decisions["unified"].desired)
                clock[0] += 15
        finally:
            await ctl.close()
            await runner.cleanup()

    asyncio.run(main())
    # 1.8 / 0.5 target -> 4 replicas (the pool's max), then back to 1 after the load stops.
    assert max(desired) == 4 and desired[-1] == 1
    peak_at = desired.index(4)
    first_down = next(i for i, d in enumerate(desired) if i > peak_at and d < 4)
    assert (first_down - 40) * 15 >= 300 - 15  # the load dropped at tick 40: down waits the window
    changes = [(a, b) for a, b in itertools.pairwise(desired) if a != b]
    assert all(b == a - 1 for a, b in changes if b < a)  # one pod at a time on the way down
    auto = kube.body["status"]["pools"]["unified"]["autoscaler"]
    assert auto["desiredReplicas"] == 1 and "kv_cache_usage" in auto["reason"]
    assert [h["to"] for h in auto["history"]][-3:] == [3, 2, 1]


def test_switching_back_to_fixed_replicas_clears_the_autoscaler_status() -> None:
    spec = copy.deepcopy(SPEC)
    spec["decode"] = {"replicas": 2}
    b = body(spec)
    b["status"]["pools"]["unified"]["autoscaler"] = {"desiredReplicas": 4, "signal": "kv_cache_usage"}
    b["status"]["conditions"].append(
        {
            "type": "MetricsAvailable",
            "status": "True",
            "reason": "MetricsAvailable",
            "lastTransitionTime": iso(T0),
        }
    )
    kube = FakeKube(b, 2, [])

    async def reconcile(_: Mapping[str, Any]) -> None:
        raise AssertionError("must not re-render")

    async def main() -> None:
        ctl = AutoscaleController(kube, reconcile, clock=lambda: T0)
        assert await ctl.tick("llm", "tiny") is None
        assert await ctl.tick("llm", "tiny") is None  # nothing stale any more: no second write

    asyncio.run(main())
    assert len(kube.patches) == 1
    status = kube.body["status"]
    assert (
        "autoscaler" not in status["pools"]["unified"] and status["pools"]["unified"]["desiredReplicas"] == 2
    )
    assert [c["type"] for c in status["conditions"]] == ["Ready"]
    # Rendering no longer sees an override.
    assert replica_overrides(status) == {}


def test_a_new_leader_decides_as_the_old_one_would_have() -> None:
    # Failover: leader A scales up and is lost while the new replica starts; B starts from the
    # status A wrote and the cluster as it is. Against a twin that never failed over, B's decisions
    # are the same every round: no second scale-up while the first is in flight, no early
    # scale-down when the load drops (the stabilisation window holds across the failover).
    spec = copy.deepcopy(SPEC)
    spec["autoscaling"]["scaleDownStabilizationSeconds"] = 60
    kv = {f"tiny-unified-{i}": 0.9 for i in range(4)}
    clock = [T0]

    def world() -> FakeKube:
        return FakeKube(body(spec), 2, [pod("tiny-unified-0"), pod("tiny-unified-1")])

    async def noop(_: Mapping[str, Any]) -> None:
        return None

    async def main() -> list[tuple[Any, Any]]:
        async with metrics_server(kv) as port:

            def controller(kube: FakeKube) -> AutoscaleController:
                return AutoscaleController(
                    kube,
                    noop,
                    pod_url=lambda p: f"http://127.0.0.1:{port}/{p['metadata']['name']}/metrics",
                    clock=lambda: clock[0],
                )

            steady_kube, failed_kube = world(), world()
            steady, leader_a = controller(steady_kube), controller(failed_kube)
            rounds: list[tuple[Any, Any]] = []

            async def round_(other: AutoscaleController) -> None:
                a = await steady.tick("llm", "tiny")
                b = await other.tick("llm", "tiny")
                assert a is not None and b is not None
                rounds.append((a["unified"].desired, b["unified"].desired))
                for kube, decision in ((steady_kube, a), (failed_kube, b)):
                    wanted = decision["unified"].desired
                    while len(kube.pods) < wanted:  # the StatefulSet creates the pod, not ready yet
                        kube.pods.append(pod(f"tiny-unified-{len(kube.pods)}", ready=False))
                    kube.replicas = wanted

            await round_(leader_a)  # both scale up to 3
            await leader_a.close()
            leader_b = controller(failed_kube)  # A is gone; B never saw this deployment
            clock[0] += 15
            await round_(leader_b)  # the third replica is still starting: both hold
            for kube in (steady_kube, failed_kube):  # it becomes ready, and the load drops
                kube.pods[2] = pod("tiny-unified-2")
            for name in kv:
                kv[name] = 0.1
            for _ in range(8):  # two minutes: past the 60 s window, both scale down alike
                clock[0] += 15
                await round_(leader_b)
            await steady.close()
            await leader_b.close()
            return rounds

    rounds = asyncio.run(main())
    assert [b for _, b in rounds] == [a for a, _ in rounds], rounds
    assert rounds[0] == (3, 3) and rounds[1] == (3, 3) and rounds[-1][0] < 3, rounds
