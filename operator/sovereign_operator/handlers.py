"""kopf handlers: thin adapters from kopf's events to the Reconciler, and the operator's assembly.

- create/update(spec)/resume of an LLMDeployment -> render + apply + status;
- events of the children (StatefulSets, LeaderWorkerSets, the router Deployment, pods) -> status, and
  re-apply when a child was deleted; pod events also feed the startup monitor (phases of starting pods);
- `mode: auto` is resolved from the nodes when the spec changes and then kept (status records
  it): switching modes replaces every pool, so node churn must not trigger it;
- no delete handler, no timer and so no finalizer: owner references clean up;
- an index of the LLMDeployments kopf serves feeds the periodic loop (loop.py: autoscaling, KV
  health and output health), which writes `status.pools.<pool>.autoscaler.desiredReplicas` and asks the reconciler to
  re-render; the new replica counts flow into rendering as overrides, never into `spec`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from sovereign_operator import metrics
from sovereign_operator.api.crd import GROUP, PLURAL, VERSION
from sovereign_operator.autoscale.controller import AutoscaleController
from sovereign_operator.autoscale.exporter import AutoscalerMetrics
from sovereign_operator.downloadmonitor import DownloadMonitor
from sovereign_operator.events import EventPoster
from sovereign_operator.gone import DeploymentGone
from sovereign_operator.kube import Kube
from sovereign_operator.kvmonitor import KVHealthMonitor
from sovereign_operator.loop import OperatorLoop
from sovereign_operator.metrics import start_server
from sovereign_operator.outputmonitor import OutputHealthMonitor
from sovereign_operator.reconcile import Reconciler, RetryLater
from sovereign_operator.render.plan import OperatorDefaults
from sovereign_operator.startupmonitor import StartupMonitor
from sovereign_operator.vocabulary import INSTANCE_LABEL, LWS_GROUP, LWS_PLURAL, LWS_VERSION, owned_labels

OWNED = owned_labels()
ANNOTATION_PREFIX = "operator.sovereign.ai"
# Built once per process: prometheus_client refuses to register the same metric names twice.
AUTOSCALER_METRICS = AutoscalerMetrics(metrics.REGISTRY)


@dataclass
class OperatorState:
    health_host: str = "0.0.0.0"
    health_port: int = 8080
    # Raises when this replica may not write (set by main.py under leader election).
    write_fence: Callable[[], None] | None = None
    kube: Kube | None = None
    reconciler: Reconciler | None = None
    events: EventPoster | None = None
    loop: OperatorLoop | None = None
    startup: StartupMonitor | None = None
    servers: list[Any] = field(default_factory=list)


STATE = OperatorState()


def assemble(
    kube: Kube, served: Mapping[Any, Iterable[Mapping[str, Any]]], defaults: OperatorDefaults | None = None
) -> tuple[EventPoster, OperatorLoop]:
    """Build the operator's parts on one kube client into STATE: the event poster, the reconciler,
    and the loop with its autoscaler and KV-health monitor. `served` is kopf's index of the
    LLMDeployments (a mapping of (namespace, name) to a store of bodies)."""
    events = EventPoster(kube.create_event)
    reconciler = Reconciler(
        kube,
        report_problem=lambda body, problem: events.post(body, "Warning", problem.reason, problem.message),
        defaults=defaults,
    )

    async def reconcile(body: Mapping[str, Any]) -> None:
        await reconciler.reconcile(body)

    autoscaler = AutoscaleController(
        kube,
        reconcile,
        post_event=lambda body, e: events.post(body, e["type"], e["reason"], e["message"]),
        exporter=AUTOSCALER_METRICS,
    )

    async def refresh(namespace: str, name: str) -> None:
        # Degraded follows KVTransferHealthy; the reconciler owns Degraded.
        await reconciler.refresh_status(namespace, name)

    monitor = KVHealthMonitor(kube, autoscaler.http_session, on_change=refresh)
    # Degraded follows OutputHealthy too; the autoscaler counts failing pods as no capacity.
    output = OutputHealthMonitor(kube, autoscaler.http_session, post_event=events.post, on_change=refresh)
    autoscaler.output_failing = output.failing
    # Phases of starting pods (fed by the pod watch below); status names them, Events name restarts.
    startup = StartupMonitor(autoscaler.http_session, post_event=events.post, on_change=refresh)
    reconciler.pod_memory = startup.lives

    def bodies() -> Iterator[Mapping[str, Any]]:
        return (body for store in served.values() for body in store)

    loop = OperatorLoop(
        bodies,
        autoscaler,
        monitor,
        output_monitor=output,
        download_monitor=DownloadMonitor(reconcile),
        startup_monitor=startup,
        forget_also=reconciler.forget,
    )
    STATE.kube, STATE.events, STATE.reconciler, STATE.loop = kube, events, reconciler, loop
    STATE.startup = startup
    return events, loop


def _reconciler() -> Reconciler:
    if STATE.reconciler is None:
        raise kopf.TemporaryError("operator is still starting", delay=5)
    return STATE.reconciler


@kopf.index(GROUP, VERSION, PLURAL, id="llmdeployments")
def index_deployment(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    """What the loop serves: kopf's own view of the LLMDeployments in the namespaces it serves. An
    index is kopf's public way to share it (and, unlike a timer, adds no finalizer)."""
    return {(namespace, name): {key: body.get(key) for key in ("metadata", "spec", "status")}}


@kopf.on.startup()
async def configure(
    settings: kopf.OperatorSettings, logger: logging.Logger, llmdeployments: kopf.Index[Any, Any], **_: Any
) -> None:
    # kopf's bookkeeping goes to annotations (never spec, never our status schema).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{ANNOTATION_PREFIX}/finalizer"
    # Only warnings become Kubernetes Events: steady state writes nothing.
    settings.posting.level = logging.WARNING
    settings.execution.max_workers = 8
    events, loop = assemble(
        Kube.from_environment(STATE.write_fence),
        llmdeployments,
        OperatorDefaults.from_environment(os.environ),
    )
    events.start()
    loop.start()
    if STATE.health_port:
        try:
            STATE.servers.append(await start_server(STATE.health_host, STATE.health_port))
            logger.info("metrics and health on :%d (/metrics, /healthz)", STATE.health_port)
        except OSError as error:
            # Reconciling matters more than the endpoint; in a pod the liveness probe reports it.
            logger.error("cannot serve /metrics and /healthz on :%d: %s", STATE.health_port, error)


@kopf.on.cleanup()
async def shutdown(**_: Any) -> None:
    for server in STATE.servers:
        await server.cleanup()
    STATE.servers.clear()
    if STATE.loop is not None:
        await STATE.loop.close()
    if STATE.events is not None:
        await STATE.events.close()
    if STATE.kube is not None:
        await STATE.kube.close()


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
async def apply_deployment(body: kopf.Body, retry: int, logger: logging.Logger, **_: Any) -> None:
    try:
        outcome = await _reconciler().reconcile(body, retry=retry)
    except RetryLater as error:
        raise kopf.TemporaryError(str(error), delay=error.delay) from error
    except DeploymentGone as gone:
        logger.info("%s; nothing to apply", gone)  # deleted (or its namespace) before this handler ran
        return
    if outcome.rendered is not None:
        logger.info("mode %s: %s", outcome.rendered.plan.mode, outcome.rendered.plan.reason)


async def _child_changed(event: Mapping[str, Any], body: kopf.Body, logger: logging.Logger) -> None:
    instance = (body.get("metadata", {}).get("labels") or {}).get(INSTANCE_LABEL)
    namespace = body.get("metadata", {}).get("namespace")
    if not instance or not namespace or STATE.reconciler is None:
        return
    try:
        if event.get("type") == "DELETED" and body.get("kind") != "Pod":
            # Someone deleted a child: put it back (owner deletion also lands here; then the
            # LLMDeployment is gone and there is nothing to do).
            live = await STATE.reconciler.kube.get_deployment(namespace, instance)
            if live is not None and not live["metadata"].get("deletionTimestamp"):
                await STATE.reconciler.reconcile(live, force=True)
            return
        await STATE.reconciler.refresh_status(namespace, instance)
    except DeploymentGone:
        return  # deleted between the read and the reconcile
    except Exception as error:  # the next event retries; never crash the watch
        logger.warning("status refresh for %s/%s failed: %s", namespace, instance, error)


@kopf.on.event("apps", "v1", "statefulsets", labels=OWNED)
async def statefulset_event(event: kopf.RawEvent, body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    await _child_changed(event, body, logger)


# Multi-node pools. kopf starts this watch when the LeaderWorkerSet CRD appears (and only then).
@kopf.on.event(LWS_GROUP, LWS_VERSION, LWS_PLURAL, labels=OWNED)
async def leader_worker_set_event(
    event: kopf.RawEvent, body: kopf.Body, logger: logging.Logger, **_: Any
) -> None:
    await _child_changed(event, body, logger)


@kopf.on.event("apps", "v1", "deployments", labels=OWNED)
async def deployment_event(event: kopf.RawEvent, body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    await _child_changed(event, body, logger)


@kopf.on.event("", "v1", "pods", labels=OWNED)
async def pod_event(event: kopf.RawEvent, body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    # The startup monitor first: the status refresh below reads what it remembers of the pod.
    if STATE.startup is not None and isinstance(event.get("object"), Mapping):
        STATE.startup.pod_event(event.get("type"), event["object"])
    await _child_changed(event, body, logger)
