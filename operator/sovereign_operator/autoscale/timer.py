"""The kopf timer that drives autoscaling; importing this module registers it.

It fires every few seconds per LLMDeployment; the controller itself skips rounds until the
deployment's `spec.autoscaling.intervalSeconds` has passed, so the interval is per object.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import kopf

from sovereign_operator.api.crd import GROUP, PLURAL, VERSION

from .controller import AutoscaleController
from .exporter import AutoscalerMetrics

TICK_SECONDS = 5.0
_controller: AutoscaleController | None = None
# Built once per process: prometheus_client refuses to register the same metric names twice.
_exporter: AutoscalerMetrics | None = None


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


@kopf.timer(GROUP, VERSION, PLURAL, interval=TICK_SECONDS, initial_delay=TICK_SECONDS)
async def autoscale(
    name: str, namespace: str, spec: Mapping[str, Any], logger: logging.Logger, **_: Any
) -> None:
    ctl = controller()
    if ctl is None:
        return
    # Skip the apiserver read between rounds; the watched spec is enough to know the interval.
    interval = ((spec or {}).get("autoscaling") or {}).get("intervalSeconds", 30)
    if not ctl.due(namespace, name, float(interval)):
        return
    try:
        await ctl.tick(namespace, name)
    except Exception as error:  # one failed round is skipped, never retried in a hot loop
        logger.warning("autoscaling round for %s/%s failed: %s", namespace, name, error)


@kopf.on.cleanup()
async def close_autoscaler(**_: Any) -> None:
    if _controller is not None:
        await _controller.close()
