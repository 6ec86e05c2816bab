"""The kopf timer that drives autoscaling; importing this module registers it.

It fires every few seconds per LLMDeployment; the controller itself skips rounds until the
deployment's `spec.autoscaling.intervalSeconds` has passed, so the interval is per object. The same
timer reads the prefill and decode pods' `/health/kv` every KV_INTERVAL_S and keeps the
`KVTransferHealthy` condition (one timer: one set of kopf settings, no second finalizer owner).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import kopf

from sovereign_operator.api.crd import GROUP, PLURAL, VERSION

from .controller import AutoscaleController
from .exporter import AutoscalerMetrics
from .kvmonitor import KVHealthMonitor

TICK_SECONDS = 5.0
_controller: AutoscaleController | None = None
# Built once per process: prometheus_client refuses to register the same metric names twice.
_exporter: AutoscalerMetrics | None = None
_kv_monitor: KVHealthMonitor | None = None


def _post_event(body: Mapping[str, Any], event: dict[str, str]) -> None:
    kopf.event(dict(body), type=event["type"], reason=event["reason"], message=event["message"][:1000])


def controller() -> AutoscaleController | None:
    """The process-wide controller, built once the operator's kube client and reconciler exist."""
    global _controller, _exporter
    if _controller is None:
        from sovereign_operator import handlers, metrics

        state = handlers.STATE
        if state.kube is None or state.reconciler is None:
            return None
        reconciler = state.reconciler

        async def reconcile(body: Mapping[str, Any]) -> None:
            await reconciler.reconcile(body)

        if _exporter is None:
            _exporter = AutoscalerMetrics(metrics.REGISTRY)
        _controller = AutoscaleController(state.kube, reconcile, post_event=_post_event, exporter=_exporter)
    return _controller


def kv_monitor() -> KVHealthMonitor | None:
    """The process-wide KV-health monitor, sharing the controller's kube client and HTTP session."""
    global _kv_monitor
    if _kv_monitor is None:
        from sovereign_operator import handlers

        ctl = controller()
        reconciler = handlers.STATE.reconciler
        if ctl is None or reconciler is None:
            return None

        async def refresh(namespace: str, name: str) -> None:
            # Degraded follows KVTransferHealthy; the reconciler owns Degraded.
            await reconciler.refresh_status(namespace, name)

        _kv_monitor = KVHealthMonitor(ctl.kube, ctl.http_session, on_change=refresh)  # type: ignore[arg-type]
    return _kv_monitor


@kopf.timer(GROUP, VERSION, PLURAL, interval=TICK_SECONDS, initial_delay=TICK_SECONDS)
async def autoscale(
    name: str,
    namespace: str,
    spec: Mapping[str, Any],
    body: Mapping[str, Any],
    logger: logging.Logger,
    **_: Any,
) -> None:
    ctl = controller()
    if ctl is None:
        return
    # Skip the apiserver read between rounds; the watched spec is enough to know the interval.
    interval = ((spec or {}).get("autoscaling") or {}).get("intervalSeconds", 30)
    if ctl.due(namespace, name, float(interval)):
        try:
            await ctl.tick(namespace, name)
        except Exception as error:  # one failed round is skipped, never retried in a hot loop
            logger.warning("autoscaling round for %s/%s failed: %s", namespace, name, error)
    monitor = kv_monitor()
    if monitor is not None and monitor.due(namespace, name, body):
        try:
            await monitor.tick(namespace, name, body)
        except Exception as error:  # as above: the next round tries again
            logger.warning("KV health round for %s/%s failed: %s", namespace, name, error)


@kopf.on.cleanup()
async def close_autoscaler(**_: Any) -> None:
    if _controller is not None:
        await _controller.close()
