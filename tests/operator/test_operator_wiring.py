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
    assert {handlers.statefulset_event, handlers.deployment_event, handlers.pod_event} <= watched
