"""The operator's shell: metrics/health server and the kopf handlers it registers."""

from __future__ import annotations

import asyncio

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


def test_handlers_cover_the_lifecycle_without_a_delete_handler() -> None:
    from sovereign_operator import handlers

    registry = kopf.get_default_registry()
    changing = registry._changing.get_all_handlers()
    watching = registry._watching.get_all_handlers()
    ours = [h for h in changing if h.fn is handlers.apply_deployment]
    reasons = {str(getattr(h.reason, "value", h.reason)) for h in ours}
    assert {"create", "update"} <= reasons
    assert any(h.initial for h in ours), "resume: existing objects are reconciled at start"
    # No delete handler: kopf adds no finalizer, owner references clean up.
    assert not [h for h in changing if str(getattr(h.reason, "value", h.reason)) == "delete"]
    watched = {h.fn for h in watching}
    assert {
        handlers.statefulset_event,
        handlers.leader_worker_set_event,
        handlers.deployment_event,
        handlers.pod_event,
    } <= watched


def test_a_deleted_child_is_put_back_and_pod_events_only_refresh_status() -> None:
    import logging

    from operator_fakes import FakeKube, body_for
    from operator_specs import TINY_SPEC
    from sovereign_operator import handlers
    from sovereign_operator.reconcile import Reconciler
    from sovereign_operator.startupmonitor import StartupMonitor

    kube = FakeKube(body_for(TINY_SPEC))
    handlers.STATE.reconciler = Reconciler(kube)
    handlers.STATE.startup = StartupMonitor(lambda: None)  # type: ignore[arg-type,return-value]
    log = logging.getLogger("test")
    labels = {"app.kubernetes.io/instance": "llm", "app.kubernetes.io/managed-by": "sovereign-operator"}

    async def scenario() -> None:
        await handlers.STATE.reconciler.reconcile(kube.body)
        applies = kube.applies
        pod = {"kind": "Pod", "metadata": {"name": "llm-unified-0", "namespace": "ns", "labels": labels}}
        starting = {
            **pod,
            "metadata": {**pod["metadata"], "labels": {**labels, "app.kubernetes.io/component": "unified"}},
            "status": {
                "containerStatuses": [{"name": "runtime", "containerID": "c://1", "state": {"running": {}}}]
            },
        }
        # Pod events feed the startup monitor (what status says of starting pods) before the refresh.
        await handlers.pod_event({"type": "ADDED", "object": starting}, starting, log)
        assert [p["metadata"]["name"] for p, _ in handlers.STATE.startup.starting("ns", "llm")] == [
            "llm-unified-0"
        ]
        await handlers.pod_event({"type": "DELETED", "object": pod}, pod, log)
        assert handlers.STATE.startup.starting("ns", "llm") == []
        assert kube.applies == applies
        del kube.children[("StatefulSet", "llm-unified")]
        sts = {
            "kind": "StatefulSet",
            "metadata": {"name": "llm-unified", "namespace": "ns", "labels": labels},
        }
        await handlers.statefulset_event({"type": "DELETED"}, sts, log)
        assert ("StatefulSet", "llm-unified") in kube.children and kube.applies > applies

    try:
        asyncio.run(scenario())
    finally:
        handlers.STATE.reconciler = None
        handlers.STATE.startup = None


def test_run_gives_kopf_the_namespaces_whose_index_feeds_the_loop(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from sovereign_operator import handlers, main

    monkeypatch.setattr(handlers.STATE, "health_port", handlers.STATE.health_port)
    calls: list[dict[str, object]] = []
    monkeypatch.setattr(kopf, "run", lambda **kwargs: calls.append(kwargs))
    assert main.run_operator(["team-*", "prod"], health_port=0, verbose=False) == 0
    assert calls[0]["namespaces"] == ["team-*", "prod"] and not calls[0]["clusterwide"]
    main.run_operator(None, health_port=0, verbose=False)
    assert calls[1]["clusterwide"] and calls[1]["namespaces"] == ()
