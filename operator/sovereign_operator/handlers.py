"""kopf handlers: thin adapters from kopf's events to the Reconciler.

- create/update(spec)/resume of an LLMDeployment -> render + apply + status;
- events of the children (StatefulSets, the router Deployment, pods) -> status, and re-apply when
  a child was deleted;
- `mode: auto` is resolved from the nodes when the spec changes and then kept (status records
  it): switching modes replaces every pool, so node churn must not trigger it;
- no delete handler and so no finalizer: owner references clean up.

The autoscaler adds a periodic loop (not a `@kopf.timer`, which would add a finalizer) that writes
`status.pools.<pool>.autoscaler.desiredReplicas` and calls `STATE.reconciler.reconcile(body)`; the new replica counts flow into rendering as
overrides, never into `spec`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from sovereign_operator.api.crd import GROUP, PLURAL, VERSION
from sovereign_operator.kube import INSTANCE_LABEL, MANAGED_BY_LABEL, Kube
from sovereign_operator.metrics import start_server
from sovereign_operator.observe import Problem
from sovereign_operator.reconcile import Reconciler, RetryLater
from sovereign_operator.render.children import MANAGED_BY
from sovereign_operator.render.plan import OperatorDefaults

OWNED = {MANAGED_BY_LABEL: MANAGED_BY}
ANNOTATION_PREFIX = "operator.sovereign.ai"


@dataclass
class OperatorState:
    health_host: str = "0.0.0.0"
    health_port: int = 8080
    kube: Kube | None = None
    reconciler: Reconciler | None = None
    servers: list[Any] = field(default_factory=list)


STATE = OperatorState()


def _post_event(body: Mapping[str, Any], problem: Problem) -> None:
    kopf.warn(dict(body), reason=problem.reason, message=problem.message[:1000])


def _reconciler() -> Reconciler:
    if STATE.reconciler is None:
        raise kopf.TemporaryError("operator is still starting", delay=5)
    return STATE.reconciler


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, logger: logging.Logger, **_: Any) -> None:
    # kopf's bookkeeping goes to annotations (never spec, never our status schema).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{ANNOTATION_PREFIX}/finalizer"
    # Only warnings become Kubernetes Events: steady state writes nothing.
    settings.posting.level = logging.WARNING
    settings.execution.max_workers = 8
    STATE.kube = Kube.from_environment()
    STATE.reconciler = Reconciler(
        STATE.kube, report_problem=_post_event, defaults=OperatorDefaults.from_environment(os.environ)
    )
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
    except Exception as error:  # the next event retries; never crash the watch
        logger.warning("status refresh for %s/%s failed: %s", namespace, instance, error)


@kopf.on.event("apps", "v1", "statefulsets", labels=OWNED)
async def statefulset_event(event: kopf.RawEvent, body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    await _child_changed(event, body, logger)


@kopf.on.event("apps", "v1", "deployments", labels=OWNED)
async def deployment_event(event: kopf.RawEvent, body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    await _child_changed(event, body, logger)


@kopf.on.event("", "v1", "pods", labels=OWNED)
async def pod_event(event: kopf.RawEvent, body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    await _child_changed(event, body, logger)
