"""kopf's startup and cleanup, the watches' adapters to the watch cache and the work queues, and the
operator's assembly.

- the LLMDeployments, every kind the operator renders (LeaderWorkerSets
  too, once their CRD is installed), and pods are watched by the operator's own
  informers (informer.py: list, then watch, into the watch cache), which sync before anything
  reconciles, so the first reconcile after a restart sees every child;
- an LLMDeployment whose spec generation this process has not reconciled (new, changed, or first
  seen after a restart) goes on the reconcile queue (render + apply + prune; 8 workers, the
  apiserver's pace), then on the status queue; a child's change puts its deployment on the status
  queue, a deleted child on the reconcile queue (it is applied again). Queued keys coalesce, so a
  burst of events costs one refresh per deployment (workqueue.py); pod events also feed the startup
  monitor (phases of starting pods), which reads the pods themselves from the cache;
- kopf serves no resource: no index, create/update/resume, timer or delete handler, so kopf writes
  no bookkeeping annotations and no finalizer onto LLMDeployments (owner references clean up);
- `mode: auto` is resolved from the nodes when the spec changes and then kept (status records
  it): switching modes replaces every pool, so node churn must not trigger it;
- the periodic loop (loop.py: autoscaling, KV, output and startup health, model downloads) serves
  the LLMDeployments the cache holds; it writes `status.pools.<pool>.autoscaler.desiredReplicas`
  and asks the reconciler to re-render; the new replica counts flow into rendering as overrides,
  never into `spec`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from sovereign_operator import metrics
from sovereign_operator.autoscale.controller import AutoscaleController
from sovereign_operator.autoscale.exporter import AutoscalerMetrics
from sovereign_operator.cache import CHILD_KINDS, DEPLOYMENT_KIND, ClusterCache, WatchedKind
from sovereign_operator.downloadmonitor import DownloadMonitor
from sovereign_operator.events import EventPoster
from sovereign_operator.gone import DeploymentGone
from sovereign_operator.informer import Informer, informer_scopes, namespace_served
from sovereign_operator.kube import Kube
from sovereign_operator.kvmonitor import KVHealthMonitor
from sovereign_operator.loop import OperatorLoop
from sovereign_operator.metrics import start_server
from sovereign_operator.outputmonitor import OutputHealthMonitor
from sovereign_operator.reconcile import MAX_CONCURRENT_APPLIES, Reconciler
from sovereign_operator.render.plan import OperatorDefaults
from sovereign_operator.startupmonitor import StartupMonitor
from sovereign_operator.vocabulary import INSTANCE_LABEL, owned_labels
from sovereign_operator.workqueue import WorkQueue

OWNED = owned_labels()
ANNOTATION_PREFIX = "operator.sovereign.ai"
# Built once per process: prometheus_client refuses to register the same metric names twice.
AUTOSCALER_METRICS = AutoscalerMetrics(metrics.REGISTRY)
# Status refreshes in flight at once: status trails the children by design, and under a burst
# fewer workers mean more events coalesced into each write.
STATUS_WORKERS = 2
# A deployment's status is refreshed at most this often: the events of a pool starting (StatefulSet
# created, pods created, scheduled, running, ready) within it coalesce into one write.
STATUS_MIN_INTERVAL_S = 1.0
# While children wait to be applied, a status refresh gives way for up to this long: under a burst
# (100 deployments applied at once) the apiserver's writes go to the children first, and a
# deployment's status events meanwhile coalesce into one write (bench/cluster_scale.py).
STATUS_MAX_YIELD_S = 30.0
# How long a stopping operator lets in-flight reconciles finish (SIGTERM, before the Lease goes).
SHUTDOWN_GRACE_S = 10.0
# Kinds whose changes show in status (the others only matter to prune and the resync).
_STATUS_KINDS = {"StatefulSet", "Deployment", "Pod"}

Key = tuple[str, str]


@dataclass
class OperatorState:
    health_host: str = "0.0.0.0"
    health_port: int = 8080
    # Raises when this replica may not write (set by main.py under leader election).
    write_fence: Callable[[], None] | None = None
    cache: ClusterCache = field(default_factory=ClusterCache)
    kube: Kube | None = None
    reconciler: Reconciler | None = None
    reconciles: WorkQueue[Key] | None = None
    statuses: WorkQueue[Key] | None = None
    events: EventPoster | None = None
    loop: OperatorLoop | None = None
    startup: StartupMonitor | None = None
    servers: list[Any] = field(default_factory=list)
    # `run --namespace` patterns (empty: every namespace), as kopf is given them.
    namespaces: tuple[str, ...] = ()
    informers: list[Informer] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


STATE = OperatorState()


def assemble(kube: Kube, defaults: OperatorDefaults | None = None) -> tuple[EventPoster, OperatorLoop]:
    """Build the operator's parts on one kube client into STATE: the event poster, the reconciler
    and its two work queues, and the loop with its autoscaler and KV-health monitor; the loop serves
    the LLMDeployments in STATE.cache."""
    events = EventPoster(kube.create_event)
    reconciler = Reconciler(
        kube,
        report_problem=lambda body, problem: events.post(body, "Warning", problem.reason, problem.message),
        defaults=defaults,
    )

    async def refresh_one(key: Key) -> None:
        # Deleted meanwhile: the reconciler forgot it, the informer tells the rest.
        with contextlib.suppress(DeploymentGone):
            await reconciler.refresh_status(*key)

    def applying() -> bool:
        return len(reconciles) > 0

    statuses: WorkQueue[Key] = WorkQueue(
        refresh_one,
        STATUS_WORKERS,
        "status",
        min_interval_s=STATUS_MIN_INTERVAL_S,
        yield_to=applying,
        max_yield_s=STATUS_MAX_YIELD_S,
    )

    async def sync_one(key: Key) -> float | None:
        delay = await reconciler.sync(*key)
        statuses.add(key)
        return delay

    reconciles: WorkQueue[Key] = WorkQueue(sync_one, MAX_CONCURRENT_APPLIES, "reconcile")
    metrics.QUEUE_DEPTH.labels("reconcile").set_function(lambda: len(reconciles))
    metrics.QUEUE_DEPTH.labels("status").set_function(lambda: len(statuses))

    async def reconcile(body: Mapping[str, Any]) -> None:
        await reconciler.reconcile(body)

    autoscaler = AutoscaleController(
        kube,
        reconcile,
        post_event=lambda body, e: events.post(body, e["type"], e["reason"], e["message"]),
        exporter=AUTOSCALER_METRICS,
    )

    async def refresh(namespace: str, name: str) -> None:
        # Degraded follows KVTransferHealthy and OutputHealthy; the reconciler owns Degraded.
        statuses.add((namespace, name))

    monitor = KVHealthMonitor(kube, autoscaler.http_session, on_change=refresh)
    # The autoscaler counts pods failing their output self-test as no capacity.
    output = OutputHealthMonitor(kube, autoscaler.http_session, post_event=events.post, on_change=refresh)
    autoscaler.output_failing = output.failing
    # Phases of starting pods (fed by the pod informer, pods read from the cache); status names
    # them, Events name restarts.
    startup = StartupMonitor(
        autoscaler.http_session,
        post_event=events.post,
        on_change=refresh,
        pods_of=lambda namespace, name: STATE.cache.children(namespace, name, ("Pod",)),
    )
    reconciler.pod_memory = startup.lives

    def bodies() -> Iterator[Mapping[str, Any]]:
        return iter(STATE.cache.deployments())

    loop = OperatorLoop(
        bodies,
        autoscaler,
        monitor,
        output_monitor=output,
        download_monitor=DownloadMonitor(reconcile),
        startup_monitor=startup,
        forget_also=reconciler.forget,
        ready=lambda: STATE.cache.synced,
        yield_to=applying,
        max_yield_s=STATUS_MAX_YIELD_S,
    )
    STATE.kube, STATE.events, STATE.reconciler, STATE.loop = kube, events, reconciler, loop
    STATE.reconciles, STATE.statuses, STATE.startup = reconciles, statuses, startup
    return events, loop


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, logger: logging.Logger, **_: Any) -> None:
    settings.persistence.finalizer = f"{ANNOTATION_PREFIX}/finalizer"
    # Only warnings become Kubernetes Events: steady state writes nothing.
    settings.posting.level = logging.WARNING
    STATE.cache = ClusterCache()
    metrics.CACHE_SYNCED.set(0)
    kube = Kube.from_environment(STATE.write_fence, STATE.cache)
    events, loop = assemble(kube, OperatorDefaults.from_environment(os.environ))
    STATE.informers = informers(kube, STATE.cache, STATE.namespaces)
    STATE.tasks = [asyncio.create_task(i.run(), name=f"{i.kind.plural} informer") for i in STATE.informers]
    STATE.tasks.append(asyncio.create_task(_start_when_synced(), name="start when synced"))
    events.start()
    loop.start()
    if STATE.health_port:
        try:
            STATE.servers.append(await start_server(STATE.health_host, STATE.health_port))
            logger.info("metrics and health on :%d (/metrics, /healthz)", STATE.health_port)
        except OSError as error:
            # Reconciling matters more than the endpoint; in a pod the liveness probe reports it.
            logger.error("cannot serve /metrics and /healthz on :%d: %s", STATE.health_port, error)


async def _start_when_synced() -> None:
    """Reconcile nothing before every child kind is in the cache: a reconcile that missed a child
    would apply it again (a write), and status would report it missing."""
    await asyncio.gather(*(informer.synced.wait() for informer in STATE.informers))
    STATE.cache.synced = True
    metrics.CACHE_SYNCED.set(1)
    if STATE.reconciles is not None and STATE.statuses is not None:
        STATE.reconciles.start()
        STATE.statuses.start()


@kopf.on.cleanup()
async def shutdown(**_: Any) -> None:
    for server in STATE.servers:
        await server.cleanup()
    STATE.servers.clear()
    for task in STATE.tasks:
        task.cancel()
    await asyncio.gather(*STATE.tasks, return_exceptions=True)
    STATE.tasks.clear()
    # In-flight reconciles finish (graceful shutdown); what waits is the next leader's.
    if STATE.reconciles is not None:
        await STATE.reconciles.close(grace_s=SHUTDOWN_GRACE_S)
    if STATE.statuses is not None:
        await STATE.statuses.close(grace_s=SHUTDOWN_GRACE_S)
    if STATE.loop is not None:
        await STATE.loop.close()
    if STATE.events is not None:
        await STATE.events.close()
    if STATE.kube is not None:
        await STATE.kube.close()


def informers(kube: Kube, cache: ClusterCache, patterns: tuple[str, ...]) -> list[Informer]:
    """One informer per watched kind and scope (informer.py): the LLMDeployments, every kind the
    operator renders, and pods."""

    def served(namespace: str) -> bool:
        return namespace_served(namespace, patterns)

    def one(kind: WatchedKind, namespace: str) -> Informer:
        is_deployment = kind is DEPLOYMENT_KIND
        return Informer(
            kube.client,
            kind,
            cache,
            served,
            _deployment_changed if is_deployment else _child_changed(kind.kind),
            namespace=namespace,
            labels=None if is_deployment else OWNED,
        )

    scopes = informer_scopes(patterns)
    return [one(kind, scope) for kind in (DEPLOYMENT_KIND, *CHILD_KINDS) for scope in scopes]


def _enqueue_child_change(key: Key, kind: str, deleted: bool) -> None:
    if STATE.reconciles is None or STATE.statuses is None or STATE.reconciler is None:
        return
    if deleted and kind != "Pod" and STATE.cache.knows_deployment(*key):
        # Put it back (unless the deployment itself is going: then the cache no longer has it).
        STATE.reconciles.add(key)
    if kind in _STATUS_KINDS:
        STATE.statuses.add(key)


def _deployment_changed(event_type: str, body: dict[str, Any]) -> None:
    """What the LLMDeployment informer calls after the cache took a change."""
    meta = body.get("metadata") or {}
    namespace, name = meta.get("namespace"), meta.get("name")
    reconciler, reconciles = STATE.reconciler, STATE.reconciles
    if not namespace or not name or reconciler is None:
        return
    if event_type == "DELETED":
        reconciler.deleted(namespace, name)
        if reconciles is not None and (body.get("status") or {}).get("model"):
            # Its sync finds it gone and releases the cache claim it leaves unbound.
            reconciles.add((namespace, name))
        return
    if reconciles is not None and reconciler.wants(body):
        reconciles.add((namespace, name))


def _child_changed(kind: str) -> Callable[[str, dict[str, Any]], None]:
    """What an informer calls after the cache took a change of one of `kind`'s objects."""

    def changed(event_type: str, obj: dict[str, Any]) -> None:
        if kind == "Pod" and STATE.startup is not None:
            # The startup monitor first: the status refresh reads what it remembers of the pod.
            STATE.startup.pod_event(event_type, obj)
        meta = obj.get("metadata") or {}
        namespace, name = meta.get("namespace"), meta.get("name")
        instance = (meta.get("labels") or {}).get(INSTANCE_LABEL)
        if not namespace or not name or not instance:
            return  # shared objects (model caches, their Jobs and pods): the download monitor polls
        deleted = event_type == "DELETED"
        if deleted and STATE.reconciler is not None:
            STATE.reconciler.child_deleted(namespace, instance, kind, name)
        _enqueue_child_change((namespace, instance), kind, deleted)

    return changed
