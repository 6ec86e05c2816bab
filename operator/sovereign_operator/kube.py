"""The thin layer between the operator and the apiserver (lightkube, async).

Every write is a server-side apply under one field manager with force, a merge patch of `status`,
or a delete; nothing here decides anything. Reads come from the watch cache (cache.py) once the
informers have listed every watched kind, and from the apiserver before that or when the cache has
no answer (a pod's log is always read from the apiserver).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from lightkube import ApiError, AsyncClient, codecs
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.apiextensions_v1 import CustomResourceDefinition
from lightkube.resources.apps_v1 import Deployment, StatefulSet
from lightkube.resources.batch_v1 import Job
from lightkube.resources.core_v1 import ConfigMap, Event, Node, PersistentVolumeClaim, Pod, Service
from lightkube.resources.networking_v1 import NetworkPolicy
from lightkube.resources.policy_v1 import PodDisruptionBudget
from lightkube.types import CascadeType, PatchType

from sovereign_operator.api.crd import GROUP, KIND, PLURAL, VERSION
from sovereign_operator.cache import ClusterCache, WatchedKind
from sovereign_operator.modeldownload import (
    JOB_NAME_LABEL,
    JobView,
    claim_bound,
    unbound_claim_fate,
    unbound_retained_cache,
)
from sovereign_operator.observe import Observed
from sovereign_operator.render.modelcache import SHARED_COMPONENTS
from sovereign_operator.startupbudget import GPU_PRODUCT_LABEL
from sovereign_operator.vocabulary import (
    COMPONENT_LABEL,
    LWS_CRD,
    LWS_GROUP,
    LWS_KIND,
    LWS_PLURAL,
    LWS_VERSION,
    MANAGED_BY,
    WORKER_COMPONENTS,
    owned_labels,
    pod_component,
)

FIELD_MANAGER = MANAGED_BY

LLMDeploymentResource = create_namespaced_resource(GROUP, VERSION, KIND, PLURAL)
# Lines of a download pod's log read for its latest progress line (it writes one every 10 s).
LOG_TAIL_LINES = 20
# Node labels kept per node (startupbudget.py types a start's node by them), and for how long.
NODE_TYPE_LABELS = frozenset({GPU_PRODUCT_LABEL})
NODE_LABELS_TTL_S = 3600.0
NODE_LABELS_KEPT = 4096
NODE_RETRY_S = 60.0
log = logging.getLogger(__name__)
# Registered with lightkube's codecs, so applying a rendered LeaderWorkerSet dict works like any kind.
LeaderWorkerSetResource = create_namespaced_resource(LWS_GROUP, LWS_VERSION, LWS_KIND, LWS_PLURAL)
# Kinds whose set changes with the mode (a pool appears or disappears); pruned after apply.
# ConfigMap: the chat template's goes when runtime.chatTemplate is removed.
_PRUNABLE = (StatefulSet, LeaderWorkerSetResource, Service, PodDisruptionBudget, NetworkPolicy, ConfigMap)
_PRUNABLE_KINDS = tuple(kind.__name__ for kind in _PRUNABLE)
# How long one LIST of the nodes answers `advertised_resources`: a burst of new deployments
# resolving `mode: auto` reads the nodes once, not once each.
NODE_FACTS_TTL_S = 10.0


def _as_dict(obj: Any) -> dict[str, Any]:
    return obj.to_dict() if hasattr(obj, "to_dict") else dict(obj)


def shared_field_manager(owner_uid: str) -> str:
    return f"{FIELD_MANAGER}-{owner_uid}"


def shared_appliers(obj: dict[str, Any]) -> set[str]:
    """The uids of the LLMDeployments whose field managers applied a shared object."""
    prefix = shared_field_manager("")
    return {
        str(entry["manager"]).removeprefix(prefix)
        for entry in (obj.get("metadata") or {}).get("managedFields") or []
        if entry.get("operation") == "Apply" and str(entry.get("manager") or "").startswith(prefix)
    }


@functools.cache
def _resource(api_version: str, kind: str) -> Any:
    if (api_version, kind) == (f"{GROUP}/{VERSION}", KIND):
        return LLMDeploymentResource
    return codecs.resource_registry.load(api_version, kind)


def api_resource(kind: WatchedKind) -> Any:
    """lightkube's resource class of a watched kind."""
    return _resource(kind.api_version, kind.kind)


def api_error_code(error: BaseException) -> int | None:
    """The HTTP status of an apiserver error: lightkube's ApiError (a Status body), or the bare httpx
    status error lightkube raises when the body is not a Status (the apiserver answers a path of an
    API group it does not serve, e.g. LeaderWorkerSets without their CRD, with a plain-text 404)."""
    code = getattr(getattr(error, "status", None), "code", None)
    if not isinstance(code, int):
        code = getattr(getattr(error, "response", None), "status_code", None)
    return code if isinstance(code, int) else None


class Kube:
    def __init__(
        self,
        client: AsyncClient,
        write_fence: Callable[[], None] | None = None,
        cache: ClusterCache | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        # Node name -> (when read, its typing labels): nodes rarely change type, pods read them often.
        self._node_labels: dict[str, tuple[float, dict[str, str]]] = {}
        self._node_failures: dict[str, float] = {}
        self._node_reads: dict[str, asyncio.Future[None]] = {}
        # Called before every write; raises when this process may not write (leadership.py).
        self._write_fence = write_fence or (lambda: None)
        self.cache = cache
        self._clock = clock
        self._node_facts: tuple[float, frozenset[str]] | None = None

    @classmethod
    def from_environment(
        cls, write_fence: Callable[[], None] | None = None, cache: ClusterCache | None = None
    ) -> Kube:
        # In-cluster service account, else KUBECONFIG / ~/.kube/config.
        return cls(AsyncClient(field_manager=FIELD_MANAGER), write_fence, cache)

    @property
    def _cached(self) -> ClusterCache | None:
        return self.cache if self.cache is not None and self.cache.synced else None

    async def close(self) -> None:
        await self.client.close()

    async def apply(self, child: dict[str, Any]) -> None:
        # The rendered dict goes out as it is: no round trip through lightkube's models.
        meta = child["metadata"]
        self._write_fence()
        await self.client.patch(
            _resource(child["apiVersion"], child["kind"]),
            meta["name"],
            child,
            namespace=meta.get("namespace"),
            patch_type=PatchType.APPLY,
            field_manager=FIELD_MANAGER,
            force=True,
        )

    def applied_digest(self, namespace: str, kind: str, name: str) -> str | None:
        """The rendering digest the live child carries (cache.APPLIED_DIGEST); None when unknown."""
        cached = self._cached
        return cached.applied_digest(namespace, kind, name) if cached is not None else None

    async def apply_shared(self, child: dict[str, Any], owner_uid: str) -> None:
        """Apply an object several LLMDeployments share (a model cache) under this owner's own field
        manager, so each keeps its own owner reference and none removes another's. The answer goes
        into the cache at once: the next look at the Job must not find it missing and apply it again."""
        meta = child["metadata"]
        self._write_fence()
        answer = await self.client.patch(
            _resource(child["apiVersion"], child["kind"]),
            meta["name"],
            child,
            namespace=meta.get("namespace"),
            patch_type=PatchType.APPLY,
            field_manager=shared_field_manager(owner_uid),
            force=True,
        )
        if self.cache is not None:
            self.cache.put(_as_dict(answer))

    async def release_shared(self, namespace: str, owner_uid: str, keep: set[tuple[str, str]]) -> list[str]:
        """Drop this owner's reference from shared objects it no longer renders; delete the ones it
        was the last owner of (a `Retain` cache claim has no owners and is never touched)."""
        released = []
        for kind in (Job, PersistentVolumeClaim):
            for meta in await self._shared_metadata(kind, namespace):
                if (meta.get("labels") or {}).get(COMPONENT_LABEL) not in SHARED_COMPONENTS:
                    continue
                refs = meta.get("ownerReferences") or []
                mine = [i for i, ref in enumerate(refs) if ref.get("uid") == owner_uid]
                if not mine or (kind.__name__, meta["name"]) in keep:
                    continue
                self._write_fence()
                if len(mine) == len(refs):
                    await self._delete_gone_ok(kind, meta["name"], namespace)
                else:
                    ops: list[dict[str, Any]] = []
                    for index in reversed(mine):
                        path = f"/metadata/ownerReferences/{index}"
                        ops += [
                            {"op": "test", "path": f"{path}/uid", "value": owner_uid},
                            {"op": "remove", "path": path},
                        ]
                    await self.client.patch(
                        kind, meta["name"], ops, namespace=namespace, patch_type=PatchType.JSON
                    )
                released.append(f"{kind.__name__}/{meta['name']}")
        return released + await self.release_unbound_claims(namespace, owner_uid, keep)

    async def release_unbound_claims(
        self, namespace: str, owner_uid: str | None, keep: set[tuple[str, str]]
    ) -> list[str]:
        """`Retain` cache claims that never bound, not in `keep`: delete those no other existing
        LLMDeployment applied, and drop `owner_uid`'s fields from the others. A claim the cluster
        could not provision (a missing class, an access mode it lacks) would otherwise stay Pending
        after the spec that named it changed, or its deployment went: it has no owner reference,
        and holds no download to keep. Who applied it is read from its managed fields (each
        deployment applies shared objects under its own field manager); owner_uid None: after a
        deletion, for claims only deleted deployments applied."""
        candidates = [
            claim["metadata"]["name"]
            for claim in await self._shared_objects(PersistentVolumeClaim, namespace)
            if unbound_retained_cache(claim)
            and ("PersistentVolumeClaim", claim["metadata"]["name"]) not in keep
        ]
        if not candidates:
            return []
        live_uids = await self._deployment_uids(namespace)
        released = []
        for name in candidates:
            claim = await self._get_or_none(PersistentVolumeClaim, name, namespace)  # with managedFields
            if claim is None or not unbound_retained_cache(claim):
                continue
            fate = unbound_claim_fate(shared_appliers(claim), owner_uid, live_uids)
            if fate is None:
                continue
            self._write_fence()
            if fate == "delete":
                await self._delete_gone_ok(PersistentVolumeClaim, name, namespace)
            else:
                assert owner_uid is not None
                # An apply of nothing under this owner's manager: the fields only it held go,
                # those the others applied too stay theirs.
                bare = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name}}
                await self.client.patch(
                    PersistentVolumeClaim,
                    name,
                    bare,
                    namespace=namespace,
                    patch_type=PatchType.APPLY,
                    field_manager=shared_field_manager(owner_uid),
                    force=True,
                )
            released.append(f"PersistentVolumeClaim/{name}")
        return released

    async def _deployment_uids(self, namespace: str) -> set[str]:
        cached = self._cached
        if cached is not None:
            bodies = [b for b in cached.deployments() if b["metadata"].get("namespace") == namespace]
        else:
            bodies = [_as_dict(b) async for b in self.client.list(LLMDeploymentResource, namespace=namespace)]
        return {str(b["metadata"]["uid"]) for b in bodies if b["metadata"].get("uid")}

    async def _shared_objects(self, kind: Any, namespace: str) -> list[dict[str, Any]]:
        """The operator's `kind` objects in `namespace` (Jobs, claims)."""
        cached = self._cached
        if cached is not None:
            return cached.shared(namespace, kind.__name__)
        return [
            _as_dict(obj) async for obj in self.client.list(kind, namespace=namespace, labels=owned_labels())
        ]

    async def _shared_metadata(self, kind: Any, namespace: str) -> list[dict[str, Any]]:
        """The metadata of the operator's `kind` objects in `namespace` (Jobs, claims)."""
        return [obj["metadata"] for obj in await self._shared_objects(kind, namespace)]

    async def _delete_gone_ok(self, kind: Any, name: str, namespace: str) -> None:
        try:
            # Jobs orphan their pods unless told otherwise.
            await self.client.delete(kind, name, namespace=namespace, cascade=CascadeType.BACKGROUND)
        except ApiError as error:
            if api_error_code(error) != 404:
                raise
        if self.cache is not None:
            self.cache.remove(kind.__name__, namespace, name)

    async def delete_job(self, namespace: str, name: str) -> None:
        self._write_fence()
        await self._delete_gone_ok(Job, name, namespace)

    async def observe_job(
        self, namespace: str, name: str, log_container: str | None, claim: str | None = None
    ) -> JobView:
        """A Job, its pods, and (with `log_container`) the tail of its running pod's log. An
        unreadable log is no error: progress figures just wait for the next read. With `claim`
        (the download's cache claim), that claim, and its Warning Events while it is not Bound."""
        job: dict[str, Any] | None
        pods: list[dict[str, Any]]
        cached = self._cached
        if cached is not None:
            job = cached.shared_object(namespace, "Job", name)
            pods = cached.job_pods(namespace, name)
        else:
            job = await self._get_or_none(Job, name, namespace)
            pods = [
                _as_dict(p)
                async for p in self.client.list(Pod, namespace=namespace, labels={JOB_NAME_LABEL: name})
            ]
        lines: list[str] = []
        running = [p for p in pods if (p.get("status") or {}).get("phase") == "Running"]
        if log_container and running:
            newest = max(running, key=lambda p: p["metadata"].get("creationTimestamp") or "")
            try:
                async for line in self.client.log(
                    newest["metadata"]["name"],
                    namespace=namespace,
                    container=log_container,
                    tail_lines=LOG_TAIL_LINES,
                ):
                    lines.append(line)
            except Exception:  # no kubelet behind the pod (a fake node), a restart, a network blip
                lines = []
        claim_obj, claim_events = (None, []) if claim is None else await self._claim(namespace, claim)
        return JobView(job=job, pods=pods, log_lines=lines, claim=claim_obj, claim_events=claim_events)

    async def _get_or_none(self, kind: Any, name: str, namespace: str) -> dict[str, Any] | None:
        try:
            return _as_dict(await self.client.get(kind, name, namespace=namespace))
        except ApiError as error:
            if api_error_code(error) != 404:
                raise
            return None

    async def _claim(self, namespace: str, name: str) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """A cache claim and, only while it is not Bound, its Warning Events (the PV controller's
        and the provisioner's reasons: nothing else says why a claim stays Pending). Events are
        advice: a failed read of them is logged and the claim returned without."""
        cached = self._cached
        claim: dict[str, Any] | None
        if cached is not None:
            claim = cached.shared_object(namespace, "PersistentVolumeClaim", name)
        else:
            claim = await self._get_or_none(PersistentVolumeClaim, name, namespace)
        if claim is None or claim_bound(claim):
            return claim, []
        selector = {
            "involvedObject.kind": "PersistentVolumeClaim",
            "involvedObject.name": name,
            "type": "Warning",
        }
        try:
            events = [
                _as_dict(e) async for e in self.client.list(Event, namespace=namespace, fields=selector)
            ]
        except Exception as error:  # advice only: never fail the round for it
            log.warning("reading the Events of claim %s/%s failed: %s", namespace, name, error)
            events = []
        return claim, events

    async def prune(
        self, namespace: str, instance: str, owner_uid: str, keep: set[tuple[str, str]]
    ) -> list[str]:
        """Delete pool children this deployment owns that the current render no longer has."""
        cached = self._cached
        if cached is not None:
            candidates = [
                (obj["kind"], obj["metadata"])
                for obj in cached.children(namespace, instance, _PRUNABLE_KINDS)
            ]
        else:
            candidates = []
            for kind in _PRUNABLE:
                async for obj in self._list_if_served(kind, namespace, owned_labels(instance)):
                    candidates.append((kind.__name__, _as_dict(obj)["metadata"]))
        deleted = []
        for kind_name, meta in candidates:
            owners = [ref.get("uid") for ref in (meta.get("ownerReferences") or []) if ref.get("controller")]
            if (kind_name, meta["name"]) in keep or owner_uid not in owners:
                continue
            self._write_fence()
            try:
                await self.client.delete(_resource_by_kind(kind_name), meta["name"], namespace=namespace)
            except ApiError as error:
                if api_error_code(error) != 404:
                    raise
            if self.cache is not None:
                self.cache.remove(kind_name, namespace, meta["name"])
            deleted.append(f"{kind_name}/{meta['name']}")
        return deleted

    async def _list_if_served(self, kind: Any, namespace: str, labels: dict[str, str]) -> AsyncIterator[Any]:
        """The objects of ``kind``; none when the apiserver does not serve the kind (LeaderWorkerSet not
        installed)."""
        try:
            async for obj in self.client.list(kind, namespace=namespace, labels=labels):
                yield obj
        except ApiError as error:
            if error.status.code != 404:
                raise

    async def leader_worker_set_installed(self) -> bool:
        """Whether the LeaderWorkerSet CRD (multi-node pools) is installed."""
        try:
            await self.client.get(CustomResourceDefinition, LWS_CRD)
        except ApiError as error:
            if error.status.code == 404:
                return False
            raise
        return True

    async def advertised_resources(self) -> frozenset[str]:
        """Extended resources with a non-zero allocatable quantity on at least one node."""
        now = self._clock()
        if self._node_facts is not None and now - self._node_facts[0] < NODE_FACTS_TTL_S:
            return self._node_facts[1]
        names: set[str] = set()
        async for node in self.client.list(Node):
            allocatable = (node.status.allocatable if node.status else None) or {}
            names.update(name for name, quantity in allocatable.items() if str(quantity) not in ("0", ""))
        self._node_facts = (now, frozenset(names))
        return self._node_facts[1]

    async def get_deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        if self.cache is not None:
            cached = self.cache.deployment(namespace, name)
            if cached is not None:
                return cached
        try:
            live = _as_dict(await self.client.get(LLMDeploymentResource, name, namespace=namespace))
        except ApiError as error:
            if api_error_code(error) == 404:
                return None
            raise
        if self.cache is not None:
            self.cache.put(live)
        return live

    async def create_event(self, event: dict[str, Any]) -> None:
        """Create a core/v1 Event (see events.py for why the operator posts its own)."""
        self._write_fence()
        await self.client.create(codecs.from_dict(event))

    async def delete_pod(self, namespace: str, name: str) -> None:
        """Delete one pod (its StatefulSet recreates it): the output-failure remediation. Gone is fine."""
        self._write_fence()
        try:
            await self.client.delete(Pod, name, namespace=namespace)
        except ApiError as error:
            if api_error_code(error) != 404:
                raise

    async def observe(self, namespace: str, instance: str) -> Observed:
        cached = self._cached
        if cached is not None:
            observed = cached.observed(namespace, instance)
            return replace(observed, node_labels=await self.node_labels(_worker_nodes(observed.pods)))
        labels = owned_labels(instance)
        statefulsets: dict[str, dict[str, Any]] = {}
        async for sts in self.client.list(StatefulSet, namespace=namespace, labels=labels):
            component = (sts.metadata.labels or {}).get(COMPONENT_LABEL)
            if component:
                statefulsets[component] = _as_dict(sts)
        groups: dict[str, dict[str, Any]] = {}
        async for lws in self._list_if_served(LeaderWorkerSetResource, namespace, labels):
            component = (lws.metadata.labels or {}).get(COMPONENT_LABEL)
            if component:
                groups[component] = _as_dict(lws)
        router = None
        async for deployment in self.client.list(Deployment, namespace=namespace, labels=labels):
            router = _as_dict(deployment)
        pods = [_as_dict(p) async for p in self.client.list(Pod, namespace=namespace, labels=labels)]
        return Observed(
            statefulsets=statefulsets,
            router=router,
            pods=pods,
            node_labels=await self.node_labels(_worker_nodes(pods)),
            leader_worker_sets=groups,
        )

    async def node_labels(self, names: set[str]) -> dict[str, dict[str, str]]:
        """The labels that type a node (startupbudget.py), for the named nodes: read once per node and
        NODE_LABELS_TTL_S (the operator may only list nodes: one list by name each). A node that cannot
        be read is left out; its pods' starts wait for a later read."""
        now = time.monotonic()
        for name in sorted(names):
            cached = self._node_labels.get(name)
            if cached is not None and now - cached[0] < NODE_LABELS_TTL_S:
                continue
            failed = self._node_failures.get(name)
            if failed is not None and now - failed < NODE_RETRY_S:
                continue
            # One read per node at a time: the rounds of many deployments on one node share it.
            reading = self._node_reads.get(name)
            if reading is None:
                reading = self._node_reads[name] = asyncio.ensure_future(self._read_node_labels(name, now))
                reading.add_done_callback(lambda _done, name=name: self._node_reads.pop(name, None))
            await asyncio.shield(reading)
        while len(self._node_labels) > NODE_LABELS_KEPT:
            self._node_labels.pop(next(iter(self._node_labels)))
        while len(self._node_failures) > NODE_LABELS_KEPT:
            self._node_failures.pop(next(iter(self._node_failures)))
        return {name: self._node_labels[name][1] for name in names if name in self._node_labels}

    async def _read_node_labels(self, name: str, now: float) -> None:
        try:
            found = [node async for node in self.client.list(Node, fields={"metadata.name": name})]
        except ApiError as error:
            self._node_failures[name] = now
            log.warning(
                "reading node %s failed (%s): starts on it are recorded once it can be read", name, error
            )
            return
        self._node_failures.pop(name, None)
        if found:
            labels = found[0].metadata.labels or {}
            self._node_labels[name] = (now, {k: v for k, v in labels.items() if k in NODE_TYPE_LABELS})

    async def patch_status(
        self, namespace: str, name: str, patch: dict[str, Any], resource_version: str | None = None
    ) -> None:
        """Merge-patch `status`; with a resourceVersion the apiserver answers 409 if it moved."""
        body: dict[str, Any] = {"status": patch}
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        self._write_fence()
        try:
            answer = await self.client.patch(
                LLMDeploymentResource.Status,
                name,
                body,
                namespace=namespace,
                patch_type=PatchType.MERGE,
            )
        except ApiError as error:
            if self.cache is not None and api_error_code(error) in (404, 409):
                # What the cache holds is not what the apiserver has: read it afresh next time.
                self.cache.forget_deployment(namespace, name)
            raise
        if self.cache is not None:
            self.cache.record(_as_dict(answer))


def _worker_nodes(pods: list[dict[str, Any]]) -> set[str]:
    return {
        str(p["spec"]["nodeName"])
        for p in pods
        if pod_component(p) in WORKER_COMPONENTS and (p.get("spec") or {}).get("nodeName")
    }


def _resource_by_kind(kind: str) -> Any:
    return next(k for k in _PRUNABLE if k.__name__ == kind)
