"""The operator's shell: metrics/health server and the kopf handlers it registers."""

from __future__ import annotations

import asyncio
import copy

import aiohttp
import kopf
from sovereign_operator import metrics


def test_metrics_and_health_endpoints_serve() -> None:
    async def scenario() -> None:
        metrics.RECONCILES.labels("applied").inc()
        runner = await metrics.start_server("127.0.0.1", 0)
        try:
            host, port = runner.addresses[0][:2]
            async with aiohttp.ClientSession() as session:
                async with session.get(f"http://{host}:{port}/healthz") as response:
                    assert response.status == 200
                async with session.get(f"http://{host}:{port}/metrics") as response:
                    text = await response.text()
            for name in (
                'sovereign_operator_reconciles_total{result="applied"}',
                "sovereign_operator_errors_total",
                "sovereign_operator_reconcile_duration_seconds_bucket",
                "sovereign_operator_children_applied_total",
                "sovereign_operator_status_writes_total",
            ):
                assert name in text or name.split("{")[0] in text, name
        finally:
            await runner.cleanup()

    asyncio.run(scenario())


def test_kopf_serves_no_resource_so_it_leaves_no_bookkeeping_on_them() -> None:
    import sovereign_operator.handlers  # noqa: F401  (registers kopf's handlers)

    registry = kopf.get_default_registry()
    # No create/update/resume/delete handler: kopf writes no annotations and no finalizer; no
    # watching or index handler: the informers watch everything.
    assert not registry._changing.get_all_handlers()
    assert not registry._indexing.get_all_handlers()
    assert not registry._watching.get_all_handlers()
    assert registry._activities.get_all_handlers()  # startup and cleanup


def test_informers_watch_each_named_namespace_or_every_namespace_for_globs() -> None:
    from types import SimpleNamespace

    from sovereign_operator import handlers
    from sovereign_operator.cache import CHILD_KINDS, DEPLOYMENT_KIND, ClusterCache

    kube = SimpleNamespace(client=None)
    named = handlers.informers(kube, ClusterCache(), ("team-a", "team-b"))  # type: ignore[arg-type]
    assert len(named) == 2 * (1 + len(CHILD_KINDS))
    assert {i.namespace for i in named} == {"team-a", "team-b"}
    deployments = [i for i in named if i.kind is DEPLOYMENT_KIND]
    # LLMDeployments carry no label of the operator's; its children do.
    assert [i.labels for i in deployments] == [None, None]
    assert all(i.labels == handlers.OWNED for i in named if i.kind is not DEPLOYMENT_KIND)
    globbed = handlers.informers(kube, ClusterCache(), ("team-*", "prod"))  # type: ignore[arg-type]
    assert {i.namespace for i in globbed} == {"*"}
    assert globbed[0].served("team-x") and not globbed[0].served("other")
    assert {i.namespace for i in handlers.informers(kube, ClusterCache(), ())} == {"*"}  # type: ignore[arg-type]


def test_events_feed_the_queues_and_the_startup_monitor_and_a_deleted_child_is_put_back() -> None:
    from operator_fakes import FakeKube, body_for
    from operator_specs import TINY_SPEC
    from sovereign_operator import handlers
    from sovereign_operator.cache import ClusterCache

    kube = FakeKube(body_for(TINY_SPEC))
    kube.body["metadata"]["uid"] = "uid-1"
    kube.body["kind"] = "LLMDeployment"
    saved = copy.copy(handlers.STATE)
    handlers.STATE.cache = ClusterCache()
    labels = {"app.kubernetes.io/instance": "llm", "app.kubernetes.io/managed-by": "sovereign-operator"}

    def deployment_seen(event_type: str) -> None:
        # As the informer does: the cache takes the object, then the handler is told.
        handlers.STATE.cache.put(kube.body)
        handlers._deployment_changed(event_type, kube.body)

    async def scenario() -> None:
        handlers.assemble(kube)  # type: ignore[arg-type]
        assert handlers.STATE.reconciles is not None and handlers.STATE.statuses is not None
        queues = (handlers.STATE.reconciles, handlers.STATE.statuses)
        # Listed before every informer has synced: it waits in the queue.
        deployment_seen("ADDED")
        await asyncio.sleep(0.01)
        assert kube.applies == 0 and len(handlers.STATE.reconciles) == 1
        for queue in queues:
            queue.start()

        async def settle() -> None:
            for queue in (*queues, *queues):
                await queue.join()

        await settle()
        applies, writes = kube.applies, len(kube.status_writes)
        assert applies > 0 and writes == 1
        # The operator's own status write comes back as an event: nothing to do.
        deployment_seen("MODIFIED")
        pod = {
            "kind": "Pod",
            "metadata": {
                "name": "llm-unified-0",
                "namespace": "ns",
                "labels": {**labels, "app.kubernetes.io/component": "unified"},
            },
            "status": {
                "containerStatuses": [{"name": "runtime", "containerID": "c://1", "state": {"running": {}}}]
            },
        }
        # Pod events feed the startup monitor, which reads the pods from the cache.
        startup = handlers.STATE.startup
        assert startup is not None
        handlers.STATE.cache.put(pod)
        handlers._child_changed("Pod")("ADDED", pod)
        assert [p["metadata"]["name"] for p, _ in startup.starting("ns", "llm")] == ["llm-unified-0"]
        handlers.STATE.cache.remove("Pod", "ns", "llm-unified-0")
        handlers._child_changed("Pod")("DELETED", pod)
        assert startup.starting("ns", "llm") == []
        await settle()
        assert (kube.applies, len(kube.status_writes)) == (applies, writes)
        # Someone deletes the StatefulSet: exactly it is applied again.
        del kube.children[("StatefulSet", "llm-unified")]
        sts = {
            "kind": "StatefulSet",
            "metadata": {"name": "llm-unified", "namespace": "ns", "labels": labels},
        }
        handlers._child_changed("StatefulSet")("DELETED", sts)
        await settle()
        assert ("StatefulSet", "llm-unified") in kube.children and kube.applies == applies + 1
        # The deployment deleted: the reconciler forgets it, and a child's deletion applies nothing.
        handlers.STATE.cache.remove("LLMDeployment", "ns", "llm")
        handlers._deployment_changed("DELETED", kube.body)
        assert ("ns", "llm") not in handlers.STATE.reconciler.outcomes  # type: ignore[union-attr]
        handlers._child_changed("StatefulSet")("DELETED", sts)
        await settle()
        assert kube.applies == applies + 1
        for queue in queues:
            await queue.close()

    try:
        asyncio.run(scenario())
    finally:
        for name, value in vars(saved).items():
            setattr(handlers.STATE, name, value)


def test_run_gives_kopf_the_namespaces_whose_index_feeds_the_loop(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from sovereign_operator import handlers, main

    monkeypatch.setattr(handlers.STATE, "health_port", handlers.STATE.health_port)
    calls: list[dict[str, object]] = []
    monkeypatch.setattr(kopf, "run", lambda **kwargs: calls.append(kwargs))
    assert main.run_operator(["team-*", "prod"], health_port=0, verbose=False) == 0
    assert calls[0]["namespaces"] == ["team-*", "prod"] and not calls[0]["clusterwide"]
    main.run_operator(None, health_port=0, verbose=False)
    assert calls[1]["clusterwide"] and calls[1]["namespaces"] == ()
