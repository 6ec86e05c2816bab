"""The operator's periodic loop (loop.py) and its wiring in handlers.py: fed by a kopf index, never a
kopf timer (no finalizer), one isolated round per object, KV health in the same round, Events
posted without kopf's per-object context."""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Mapping
from typing import Any

import kopf
from operator_fakes import FakeKube, body_for
from operator_specs import TINY_SPEC
from sovereign_operator import handlers, metrics
from sovereign_operator.autoscale.controller import AutoscaleController
from sovereign_operator.cache import ClusterCache
from sovereign_operator.downloadmonitor import DownloadMonitor
from sovereign_operator.gone import DeploymentGone
from sovereign_operator.kvmonitor import KVHealthMonitor
from sovereign_operator.loop import OperatorLoop
from sovereign_operator.observe import Observed, Problem
from sovereign_operator.vocabulary import KV_TRANSFER_HEALTHY


def test_no_timer_daemon_or_index_so_objects_get_no_finalizer_and_nothing_waits_on_kopf() -> None:
    registry = kopf.get_default_registry()
    # No timers or daemons: kopf would put a finalizer on every LLMDeployment for them.
    assert not registry._spawning.get_all_handlers()
    assert not [h for h in registry._changing.get_all_handlers() if h.requires_finalizer]
    # No index: kopf holds every handler back until its index listings are done, at a cost
    # quadratic in the objects listed; the loop serves the watch cache instead.
    assert not registry._indexing.get_all_handlers()
    activities = {h.fn for h in registry._activities.get_all_handlers()}
    assert {handlers.configure, handlers.shutdown} <= activities


def test_assemble_builds_every_part_on_one_client_and_posts_the_reconcilers_problems() -> None:
    kube = FakeKube(body_for(TINY_SPEC))
    saved = copy.copy(handlers.STATE)
    try:
        handlers.STATE.cache = ClusterCache()
        handlers.STATE.cache.put({"kind": "LLMDeployment", **kube.body})
        events, loop = handlers.assemble(kube)  # type: ignore[arg-type]
        assert handlers.STATE.loop is loop and handlers.STATE.events is events
        assert handlers.STATE.reconciler is not None and handlers.STATE.reconciler.kube is kube
        assert loop.autoscaler.kube is kube and loop.kv_monitor.kube is kube
        assert [b["metadata"]["name"] for b in loop.served()] == ["llm"]
        # The autoscaler's gauges live in the registry the operator serves on /metrics.
        assert loop.autoscaler.exporter is handlers.AUTOSCALER_METRICS
        loop.autoscaler.exporter.observe("ns", "llm", [])
        assert "sovereign_autoscaler_desired_replicas" in {m.name for m in metrics.REGISTRY.collect()}

        async def scenario() -> None:
            events.start()
            handlers.STATE.reconciler.report_problem(kube.body, Problem("InvalidSpec", "spec.model: x"))
            await events.flush()
            await events.close()

        asyncio.run(scenario())
        [event] = kube.events
        assert (event["type"], event["reason"], event["message"]) == (
            "Warning",
            "InvalidSpec",
            "spec.model: x",
        )
        assert event["involvedObject"]["name"] == "llm" and event["involvedObject"]["kind"] == "LLMDeployment"
    finally:
        for name, value in vars(saved).items():
            setattr(handlers.STATE, name, value)


class RecordingPart:
    """Stands in for the autoscaler and the KV monitor: records what the loop forgets."""

    def __init__(self) -> None:
        self.forgotten: list[tuple[str, str]] = []

    def forget(self, namespace: str, name: str) -> None:
        self.forgotten.append((namespace, name))

    async def close(self) -> None:
        pass


def obj(namespace: str, name: str, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"namespace": namespace, "name": name}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "spec": {}}


def test_rounds_are_isolated_skip_objects_still_running_and_forget_the_unserved() -> None:
    served = [obj("a", "x"), obj("a", "y"), obj("b", "z"), obj("a", "gone", deleting=True)]
    autoscaler, monitor = RecordingPart(), RecordingPart()
    loop = OperatorLoop(lambda: served, autoscaler, monitor)  # type: ignore[arg-type]
    seen: list[tuple[str, str]] = []
    release = asyncio.Event()

    async def fake_round(namespace: str, name: str, body: Mapping[str, Any]) -> None:
        seen.append((namespace, name))
        if name == "x":
            raise RuntimeError("boom")  # isolated: the others still run
        if name == "y":
            await release.wait()  # a slow round: the next tick skips it, never stacks a second

    loop.round = fake_round  # type: ignore[method-assign]

    async def scenario() -> None:
        loop.tick()
        await asyncio.sleep(0)
        assert sorted(seen) == [("a", "x"), ("a", "y"), ("b", "z")]  # not the one being deleted
        loop.tick()
        await asyncio.sleep(0)
        assert sorted(seen) == [("a", "x"), ("a", "x"), ("a", "y"), ("b", "z"), ("b", "z")]  # y in flight
        release.set()
        await asyncio.sleep(0)
        served[:] = [obj("b", "z")]  # x and y deleted (kopf's index drops them)
        seen.clear()
        loop.tick()
        await asyncio.sleep(0)
        assert seen == [("b", "z")] and set(loop.rounds) == {("b", "z")}
        assert sorted(autoscaler.forgotten) == sorted(monitor.forgotten) == [("a", "x"), ("a", "y")]
        loop.start()  # the periodic task; close stops it and every round in flight
        await loop.close()
        assert not loop.rounds

    asyncio.run(scenario())


def test_no_round_runs_before_the_watch_cache_holds_every_object() -> None:
    ready = False
    autoscaler, monitor = RecordingPart(), RecordingPart()
    loop = OperatorLoop(lambda: [obj("a", "x")], autoscaler, monitor, ready=lambda: ready)  # type: ignore[arg-type]
    seen: list[str] = []

    async def fake_round(namespace: str, name: str, body: Mapping[str, Any]) -> None:
        seen.append(name)

    loop.round = fake_round  # type: ignore[method-assign]

    async def scenario() -> None:
        nonlocal ready
        loop.tick()
        await asyncio.sleep(0)
        assert seen == [] and not loop.rounds
        ready = True
        loop.tick()
        await asyncio.sleep(0)
        assert seen == ["x"]

    asyncio.run(scenario())


def test_rounds_give_way_to_pending_child_applies_but_not_for_longer_than_the_limit() -> None:
    applying, now = True, 100.0
    autoscaler, monitor = RecordingPart(), RecordingPart()
    loop = OperatorLoop(
        lambda: [obj("a", "x")],
        autoscaler,  # type: ignore[arg-type]
        monitor,  # type: ignore[arg-type]
        yield_to=lambda: applying,
        max_yield_s=30,
        clock=lambda: now,
    )
    seen: list[float] = []

    async def fake_round(namespace: str, name: str, body: Mapping[str, Any]) -> None:
        seen.append(now)

    loop.round = fake_round  # type: ignore[method-assign]

    async def tick_at(when: float) -> None:
        nonlocal now
        now = when
        loop.tick()
        await asyncio.sleep(0)

    async def scenario() -> None:
        nonlocal applying
        # A burst: the rounds wait while children are applied, at most 30 s at a stretch ...
        for when in (100, 105, 125):
            await tick_at(when)
        assert seen == []
        await tick_at(130)
        assert seen == [130]
        # ... and then wait again, so a long burst gets a round every 30 s, not every tick.
        await tick_at(135)
        await tick_at(155)
        assert seen == [130]
        await tick_at(160)
        assert seen == [130, 160]
        # Once nothing waits to be applied, every tick runs its rounds, and the next burst starts afresh.
        applying = False
        await tick_at(165)
        applying = True
        await tick_at(170)
        await tick_at(195)
        assert seen == [130, 160, 165]
        await tick_at(200)
        assert seen == [130, 160, 165, 200]

    asyncio.run(scenario())


def test_the_assembled_loop_gives_way_to_the_reconcile_queue() -> None:
    kube = FakeKube(body_for(TINY_SPEC))
    saved = copy.copy(handlers.STATE)
    try:
        handlers.STATE.cache = ClusterCache()
        _, loop = handlers.assemble(kube)  # type: ignore[arg-type]
        reconciles = handlers.STATE.reconciles
        assert reconciles is not None and loop.max_yield_s == handlers.STATUS_MAX_YIELD_S
        assert not loop.yield_to()

        async def queued() -> bool:
            reconciles.add(("ns", "llm"))  # a reconcile (its child applies) waiting; no worker runs
            return loop.yield_to()

        assert asyncio.run(queued())
    finally:
        for name, value in vars(saved).items():
            setattr(handlers.STATE, name, value)


class MonitorKube:
    """A Ready disaggregated LLMDeployment whose pods are listed separately (none ready yet)."""

    def __init__(self) -> None:
        ready = {"type": "Ready", "status": "True", "reason": "AllReplicasReady"}
        self.body: dict[str, Any] = {
            "metadata": {"name": "llm", "namespace": "ns", "generation": 2, "resourceVersion": "1"},
            "spec": copy.deepcopy(TINY_SPEC),
            "status": {"mode": "disaggregated", "kvTransport": "tcp", "conditions": [ready]},
        }

    async def get_deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.body)

    async def observe(self, namespace: str, instance: str) -> Observed:
        return Observed()

    async def patch_status(
        self, namespace: str, name: str, patch: dict[str, Any], resource_version: str | None = None
    ) -> None:
        self.body["status"].update(copy.deepcopy(patch))


def test_a_round_runs_the_autoscaler_and_the_kv_monitor_and_degraded_follows() -> None:
    kube = MonitorKube()
    refreshed: list[tuple[str, str]] = []

    async def reconcile(_: Mapping[str, Any]) -> None:
        raise AssertionError("nothing is autoscaled: no re-render")

    async def refresh(namespace: str, name: str) -> None:
        refreshed.append((namespace, name))

    async def scenario() -> None:
        autoscaler = AutoscaleController(kube, reconcile)
        monitor = KVHealthMonitor(kube, autoscaler.http_session, on_change=refresh)
        loop = OperatorLoop(lambda: [kube.body], autoscaler, monitor, logger=logging.getLogger("test"))
        await loop.round("ns", "llm", copy.deepcopy(kube.body))
        assert not autoscaler.due("ns", "llm", 30)  # the autoscaler's round happened too
        await loop.close()

    asyncio.run(scenario())
    # No ready pods behind a Ready object: Unknown, and Degraded refreshed.
    kv = kube.body["status"]["conditions"][-1]
    assert (kv["type"], kv["status"], kv["reason"]) == (KV_TRANSFER_HEALTHY, "Unknown", "PodsNotReady")
    assert refreshed == [("ns", "llm")]


def test_a_deployment_found_gone_ends_its_rounds_and_every_parts_memory() -> None:
    """kopf's index keeps the last body of an object whose namespace was deleted. The download monitor's
    reconcile finds it gone: the loop forgets it everywhere (the reconciler too) and serves that body no
    more, instead of reconciling it every 10 s for as long as the operator runs; the same name created
    again (a new uid) is served."""
    hf = {"model": {"source": {"huggingFace": {"repo": "org/model"}}}}
    stale = {"metadata": {"namespace": "gone-ns", "name": "llm", "uid": "u1", "generation": 1}, "spec": hf}
    served = [stale]
    reconciles: list[str] = []

    async def reconcile(body: Mapping[str, Any]) -> None:
        reconciles.append(body["metadata"]["uid"])
        if body["metadata"]["uid"] == "u1":
            raise DeploymentGone("gone-ns", "llm", "u1")

    autoscaler, monitor, reconciler = RecordingPart(), RecordingPart(), RecordingPart()
    downloads = DownloadMonitor(reconcile, interval_s=0)
    loop = OperatorLoop(
        lambda: served,
        autoscaler,  # type: ignore[arg-type]
        monitor,  # type: ignore[arg-type]
        download_monitor=downloads,
        forget_also=reconciler.forget,
    )
    loop.autoscaler.due = lambda *args: False  # type: ignore[attr-defined]
    monitor.due = lambda *args: False  # type: ignore[attr-defined]

    async def settle() -> None:
        loop.tick()
        await asyncio.gather(*loop.rounds.values())

    async def scenario() -> None:
        await settle()
        assert reconciles == ["u1"]
        assert autoscaler.forgotten == monitor.forgotten == reconciler.forgotten == [("gone-ns", "llm")]
        assert loop.gone == {("gone-ns", "llm"): "u1"}
        for _ in range(3):
            await settle()
        assert reconciles == ["u1"] and not loop.rounds
        served.append({**stale, "metadata": {**stale["metadata"], "uid": "u2"}})
        await settle()
        assert reconciles == ["u1", "u2"]
        served.clear()
        await settle()
        assert not loop.gone and not loop.rounds
        await loop.close()

    asyncio.run(scenario())
