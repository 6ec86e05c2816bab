"""The periodic loop that drives autoscaling; importing this module registers its start and stop.

Every TICK_SECONDS the loop lists the LLMDeployments of the namespaces the operator serves and runs
`autoscale` for each, as its own task (a slow or failing object never delays another, and an
object whose previous round is still running is skipped). The controller itself skips rounds until
the deployment's `spec.autoscaling.intervalSeconds` has passed, so the interval is per object. The
same round reads the prefill and decode pods' `/health/kv` every KV_INTERVAL_S and keeps the
`KVTransferHealthy` condition.

Not a `@kopf.timer`: kopf puts a finalizer on every object a timer serves, and a namespace-restricted
kopf stops serving a namespace marked for deletion before releasing those finalizers, so deleting
the namespace hung. This loop needs no finalizer; children go by their owner references.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import kopf

# kopf's own matcher, so the loop serves exactly the namespaces `run --namespace` gives kopf.
from kopf._cogs.structs.references import NamespaceName, match_namespace, select_specific_namespaces
from kopf._core.engines import posting

from sovereign_operator.api.crd import GROUP, PLURAL, VERSION

from .controller import AutoscaleController
from .exporter import AutoscalerMetrics
from .kvmonitor import KVHealthMonitor

TICK_SECONDS = 5.0
_controller: AutoscaleController | None = None
# Built once per process: prometheus_client refuses to register the same metric names twice.
_exporter: AutoscalerMetrics | None = None
_kv_monitor: KVHealthMonitor | None = None
# The `--namespace` patterns of this process; empty: the whole cluster.
_namespaces: tuple[str, ...] = ()
_loop_task: asyncio.Task[None] | None = None
# Rounds in flight, per (namespace, name).
_rounds: dict[tuple[str, str], asyncio.Task[None]] = {}
# kopf's event queue (and its loop), taken from a kopf handler: kopf.event()/kopf.warn() need them
# and kopf sets them only in its per-object contexts, not in the startup task the loop came from.
_posting: tuple[Any, Any] | None = None


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


def serve_namespaces(patterns: Iterable[str]) -> None:
    """Restrict the loop to these namespace names or kopf patterns (empty: all namespaces)."""
    global _namespaces
    _namespaces = tuple(patterns)


def served(namespace: str, patterns: tuple[str, ...]) -> bool:
    return not patterns or any(match_namespace(NamespaceName(namespace), p) for p in patterns)


async def list_served(kube: Any, patterns: tuple[str, ...]) -> list[dict[str, Any]]:
    """The LLMDeployments in the served namespaces: per namespace when all are plain names (works
    with namespaced RBAC too), else one cluster-wide list filtered by the patterns."""
    specific = select_specific_namespaces(patterns)
    if patterns and len(specific) == len(set(patterns)):
        bodies: list[dict[str, Any]] = []
        for namespace in sorted(specific):
            bodies.extend(await kube.list_deployments(namespace))
        return bodies
    return [b for b in await kube.list_deployments(None) if served(b["metadata"]["namespace"], patterns)]


async def run_round(kube: Any, patterns: tuple[str, ...], logger: logging.Logger) -> None:
    """Start one round for every served LLMDeployment whose previous round has finished."""
    bodies = await list_served(kube, patterns)
    present: set[tuple[str, str]] = set()
    for body in bodies:
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        if meta.get("deletionTimestamp"):
            continue  # going away: owner references take the children, nothing to scale
        present.add(key)
        running = _rounds.get(key)
        if running is not None and not running.done():
            continue
        _rounds[key] = asyncio.create_task(_one_round(key, body, logger), name=f"autoscale {key[0]}/{key[1]}")
    for key in [k for k, task in _rounds.items() if k not in present and task.done()]:
        # Deleted (or no longer served): drop its memory and its gauges.
        del _rounds[key]
        if _controller is not None:
            _controller.forget(*key)
        if _kv_monitor is not None:
            _kv_monitor.forget(*key)


async def _one_round(key: tuple[str, str], body: Mapping[str, Any], logger: logging.Logger) -> None:
    try:
        await autoscale(name=key[1], namespace=key[0], spec=body.get("spec") or {}, body=body, logger=logger)
    except Exception as error:  # isolation: one object's failure never stops the loop or another
        logger.warning("autoscaling round for %s/%s failed: %s", key[0], key[1], error)


@kopf.on.event(GROUP, VERSION, PLURAL)
async def capture_posting(**_: Any) -> None:
    """Remember kopf's event queue once; kopf sees every LLMDeployment before the loop does."""
    global _posting
    if _posting is None:
        with contextlib.suppress(LookupError):  # outside kopf (tests): nothing to capture
            _posting = (posting.event_queue_loop_var.get(), posting.event_queue_var.get())


async def _loop(logger: logging.Logger) -> None:
    from sovereign_operator import handlers

    while True:
        await asyncio.sleep(TICK_SECONDS)
        kube = handlers.STATE.kube
        if kube is None or controller() is None or _posting is None:
            continue  # operator still starting (or no LLMDeployment seen yet)
        # Set in this task's context; each round's task copies it, so events post from there too.
        posting.event_queue_loop_var.set(_posting[0])
        posting.event_queue_var.set(_posting[1])
        try:
            await run_round(kube, _namespaces, logger)
        except Exception as error:  # the apiserver hiccuped: try again next tick
            logger.warning("listing LLMDeployments for autoscaling failed: %s", error)


@kopf.on.startup()
async def start_autoscaler(**_: Any) -> None:
    global _loop_task
    if _loop_task is None or _loop_task.done():
        _loop_task = asyncio.create_task(_loop(logging.getLogger(__name__)), name="autoscaler loop")


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
    global _loop_task
    tasks = [t for t in (_loop_task, *_rounds.values()) if t is not None]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    _loop_task = None
    _rounds.clear()
    if _controller is not None:
        await _controller.close()
