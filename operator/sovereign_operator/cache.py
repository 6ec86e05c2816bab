"""What the operator's watches have seen: the LLMDeployments and every child they own.

The operator's informers (informer.py: list, then watch, per kind) put every listed or changed
child, and every LLMDeployment, here and remove it on DELETED.
Status, prune, the model download's Jobs and the resync after a restart then read memory instead of
the apiserver: a burst of pod events costs no LISTs, and a restart that finds every child as it was
last applied writes nothing (each applied child carries the digest of its rendering in
APPLIED_DIGEST, compared here). This is the informer pattern of client-go.

Children are indexed by their deployment's instance label. Objects the deployments of a namespace
share (a model cache claim, its Jobs) carry no instance label and are kept by name, and so are the
pods of those Jobs, indexed by the Job's name.

Two gaps are closed here rather than ignored:
- after a watch expired (410 Gone), a fresh LIST yields the objects that exist but never a DELETED
  for those removed in between: `sweep` drops what the LIST no longer has;
- the operator's own writes reach the watch a moment after their response: `record` keeps the newer
  of the two (by resourceVersion), so a refresh right after a write starts from it.

Memory: objects are stored without `metadata.managedFields` (most of an object's size); kinds
whose status the operator never reads keep only their metadata; the others (pods, StatefulSets,
LeaderWorkerSets, Deployments, Jobs, LLMDeployments) are kept as compact JSON and parsed when read, about a fifth of the
same object as Python dicts, so 1000 deployments' 14 000 objects fit in tens of MiB. Every read
returns objects of its own: callers may change them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from sovereign_operator.api.crd import GROUP, KIND, PLURAL, VERSION
from sovereign_operator.modeldownload import JOB_NAME_LABEL
from sovereign_operator.observe import Observed
from sovereign_operator.vocabulary import (
    COMPONENT_LABEL,
    INSTANCE_LABEL,
    LWS_GROUP,
    LWS_KIND,
    LWS_PLURAL,
    LWS_VERSION,
)

# The digest of a child's rendering, set by the reconciler on every child it applies.
APPLIED_DIGEST = "operator.sovereign.ai/applied-digest"

Key = tuple[str, str]  # (namespace, name)


@dataclass(frozen=True)
class WatchedKind:
    group: str
    version: str
    plural: str
    kind: str
    # Keep the whole object (status reads it), or only its metadata (prune and resync need no more).
    whole: bool = False
    # Shared by the deployments of a namespace (model caches and their Jobs): no instance label, kept
    # by name.
    shared: bool = False

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


# Every kind the renderer produces, plus pods (status reads them). A rendered kind missing here is
# still applied, but re-applied after every restart (tests/operator/test_cache.py checks the list).
CHILD_KINDS: tuple[WatchedKind, ...] = (
    WatchedKind("apps", "v1", "statefulsets", "StatefulSet", whole=True),
    WatchedKind("apps", "v1", "deployments", "Deployment", whole=True),
    WatchedKind("", "v1", "pods", "Pod", whole=True),
    WatchedKind("", "v1", "services", "Service"),
    WatchedKind("", "v1", "configmaps", "ConfigMap"),
    WatchedKind("", "v1", "serviceaccounts", "ServiceAccount"),
    WatchedKind("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget"),
    WatchedKind("rbac.authorization.k8s.io", "v1", "roles", "Role"),
    WatchedKind("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding"),
    WatchedKind("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy"),
    WatchedKind(LWS_GROUP, LWS_VERSION, LWS_PLURAL, LWS_KIND, whole=True),
    WatchedKind("batch", "v1", "jobs", "Job", whole=True, shared=True),
    # Whole: a claim that is not Bound holds its download back, and status says why.
    WatchedKind("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", whole=True, shared=True),
)
DEPLOYMENT_KIND = WatchedKind(GROUP, VERSION, PLURAL, KIND, whole=True)
_BY_KIND = {k.kind: k for k in CHILD_KINDS}


def _newer(incoming: Mapping[str, Any], stored: _Entry) -> bool:
    """Whether `incoming` is at least as new as what is stored. resourceVersions are etcd revisions
    (integers) on every apiserver this runs against; anything else counts as newer, so the latest
    arrival wins as it did without a cache."""
    try:
        return int((incoming.get("metadata") or {})["resourceVersion"]) >= int(stored.version or "")
    except (KeyError, TypeError, ValueError):
        return True


def _trimmed(obj: Mapping[str, Any], whole: bool) -> dict[str, Any]:
    meta = {k: v for k, v in (obj.get("metadata") or {}).items() if k != "managedFields"}
    if not whole:
        return {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"), "metadata": meta}
    out = {k: v for k, v in obj.items() if k != "metadata"}
    out["metadata"] = meta
    return out


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


@dataclass
class _Entry:
    seq: int  # when it was last put (see ClusterCache.mark)
    version: str | None  # metadata.resourceVersion
    instance: str | None  # the app.kubernetes.io/instance label (children)
    digest: str | None  # the APPLIED_DIGEST annotation (children)
    data: bytes  # the trimmed object as JSON
    # Known to differ from the apiserver (a write based on it was refused): read it afresh.
    stale: bool = False

    @classmethod
    def of(cls, seq: int, obj: Mapping[str, Any], whole: bool) -> _Entry:
        meta = obj.get("metadata") or {}
        return cls(
            seq=seq,
            version=meta.get("resourceVersion"),
            instance=(meta.get("labels") or {}).get(INSTANCE_LABEL),
            digest=(meta.get("annotations") or {}).get(APPLIED_DIGEST),
            data=_encode(_trimmed(obj, whole)),
        )

    def obj(self) -> dict[str, Any]:
        return dict(_decode(self.data))


class ClusterCache:
    def __init__(self) -> None:
        # True once the informers have listed every watched kind (handlers.py sets it); before that readers
        # go to the apiserver.
        self.synced = False
        self._seq = 0
        self._children: dict[tuple[str, str, str], _Entry] = {}  # (namespace, kind, name)
        self._by_instance: dict[Key, set[tuple[str, str]]] = {}  # -> {(kind, name)}
        self._deployments: dict[Key, _Entry] = {}
        # Shared objects (Jobs, claims) and the pods of those Jobs: (namespace, kind, name).
        self._shared: dict[tuple[str, str, str], _Entry] = {}
        self._by_job: dict[Key, set[str]] = {}  # (namespace, Job name) -> its pods' names

    # --- feeding -------------------------------------------------------------------------------

    def put(self, obj: Mapping[str, Any]) -> None:
        """A listed, added or modified object (an informer's, or a response the operator received)."""
        meta = obj.get("metadata") or {}
        namespace, name, kind = meta.get("namespace"), meta.get("name"), obj.get("kind")
        if not namespace or not name:
            return
        self._seq += 1
        if kind == KIND:
            stored = self._deployments.get((namespace, name))
            if stored is None or _newer(obj, stored):
                self._deployments[(namespace, name)] = _Entry.of(self._seq, obj, whole=True)
            else:
                stored.seq = self._seq
            return
        watched = _BY_KIND.get(str(kind))
        labels = meta.get("labels") or {}
        instance = labels.get(INSTANCE_LABEL)
        if watched is not None and (watched.shared or (not instance and labels.get(JOB_NAME_LABEL))):
            self._put_shared(namespace, watched, name, obj, labels.get(JOB_NAME_LABEL))
            return
        if watched is None or not instance:
            return
        key = (namespace, watched.kind, name)
        stored = self._children.get(key)
        if stored is not None and not _newer(obj, stored):
            stored.seq = self._seq
            return
        if stored is not None:
            self._unlink(key, stored)
        self._children[key] = _Entry.of(self._seq, obj, watched.whole)
        self._by_instance.setdefault((namespace, instance), set()).add((watched.kind, name))

    def _put_shared(
        self, namespace: str, watched: WatchedKind, name: str, obj: Mapping[str, Any], job: str | None
    ) -> None:
        key = (namespace, watched.kind, name)
        stored = self._shared.get(key)
        if stored is not None and not _newer(obj, stored):
            stored.seq = self._seq
            return
        if stored is not None:
            self._unlink_shared(key, stored)
        entry = _Entry.of(self._seq, obj, watched.whole)
        entry.instance = job if watched.kind == "Pod" else None  # a Job's pod: indexed by its Job
        self._shared[key] = entry
        if entry.instance:
            self._by_job.setdefault((namespace, entry.instance), set()).add(name)

    def _unlink_shared(self, key: tuple[str, str, str], entry: _Entry) -> None:
        pods = self._by_job.get((key[0], entry.instance)) if entry.instance else None
        if pods is not None:
            pods.discard(key[2])
            if not pods:
                del self._by_job[(key[0], entry.instance or "")]

    def record(self, deployment: Mapping[str, Any]) -> None:
        """An LLMDeployment as the apiserver answered one of the operator's own writes."""
        self.put(deployment)

    def remove(self, kind: str, namespace: str, name: str) -> None:
        if kind == KIND:
            self._deployments.pop((namespace, name), None)
            return
        key = (namespace, kind, name)
        stored = self._children.pop(key, None)
        if stored is not None:
            self._unlink(key, stored)
        shared = self._shared.pop(key, None)
        if shared is not None:
            self._unlink_shared(key, shared)

    def forget_deployment(self, namespace: str, name: str) -> None:
        """A deployment known to be stale (a write based on it was refused with 409): the next read
        goes to the apiserver, and the next newer event or response replaces it."""
        entry = self._deployments.get((namespace, name))
        if entry is not None:
            entry.stale = True

    def _unlink(self, key: tuple[str, str, str], entry: _Entry) -> None:
        instance = entry.instance
        refs = self._by_instance.get((key[0], instance)) if instance else None
        if refs is not None:
            refs.discard((key[1], key[2]))
            if not refs:
                del self._by_instance[(key[0], instance)]

    # --- relists -------------------------------------------------------------------------------

    def mark(self) -> int:
        """A point in the cache's history: entries put after it are newer than a LIST started now."""
        return self._seq

    def sweep(
        self, kind: str, present: Iterable[tuple[str, str]], since: int, namespace: str | None = None
    ) -> list[dict[str, Any]]:
        """Drop `kind` objects (of `namespace`, else of every namespace) that a LIST started at
        `since` no longer returned, as (namespace, name) in `present`, and that no event has
        refreshed since. Returns the dropped objects."""
        keep = set(present)
        dropped: list[dict[str, Any]] = []
        if kind == KIND:
            for key, entry in list(self._deployments.items()):
                if (namespace is None or key[0] == namespace) and key not in keep and entry.seq <= since:
                    del self._deployments[key]
                    dropped.append(entry.obj())
            return dropped
        for store in (self._children, self._shared):
            for key, entry in list(store.items()):
                if key[1] != kind or (namespace is not None and key[0] != namespace):
                    continue
                if (key[0], key[2]) not in keep and entry.seq <= since:
                    self.remove(kind, key[0], key[2])
                    dropped.append(entry.obj())
        return dropped

    # --- reading -------------------------------------------------------------------------------

    def deployments(self) -> list[dict[str, Any]]:
        """Every LLMDeployment as last seen (what the periodic loop serves)."""
        return [entry.obj() for entry in self._deployments.values()]

    def deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A copy of the LLMDeployment as last seen (callers may change it); None when unknown or
        known to be stale."""
        entry = self._deployments.get((namespace, name))
        return entry.obj() if entry is not None and not entry.stale else None

    def knows_deployment(self, namespace: str, name: str) -> bool:
        return (namespace, name) in self._deployments

    def children(
        self, namespace: str, instance: str, kinds: Iterable[str] | None = None
    ) -> list[dict[str, Any]]:
        """The objects labelled with this instance, of `kinds` (all when None), by kind and name."""
        wanted = set(kinds) if kinds is not None else None
        refs = sorted(self._by_instance.get((namespace, instance), ()))
        return [
            self._children[(namespace, kind, name)].obj()
            for kind, name in refs
            if wanted is None or kind in wanted
        ]

    def shared(self, namespace: str, kind: str) -> list[dict[str, Any]]:
        """The shared objects of `kind` (Job, PersistentVolumeClaim) in `namespace`, by name."""
        return [
            entry.obj()
            for key, entry in sorted(self._shared.items())
            if key[0] == namespace and key[1] == kind
        ]

    def shared_object(self, namespace: str, kind: str, name: str) -> dict[str, Any] | None:
        entry = self._shared.get((namespace, kind, name))
        return entry.obj() if entry is not None else None

    def job_pods(self, namespace: str, job: str) -> list[dict[str, Any]]:
        """The pods of one of the operator's Jobs (labelled with the Job's name), by name."""
        names = sorted(self._by_job.get((namespace, job), ()))
        return [self._shared[(namespace, "Pod", name)].obj() for name in names]

    def observed(self, namespace: str, instance: str) -> Observed:
        statefulsets: dict[str, dict[str, Any]] = {}
        groups: dict[str, dict[str, Any]] = {}
        router = None
        pods = []
        for obj in self.children(namespace, instance, ("StatefulSet", LWS_KIND, "Deployment", "Pod")):
            if obj["kind"] in ("StatefulSet", LWS_KIND):
                component = (obj["metadata"].get("labels") or {}).get(COMPONENT_LABEL)
                if component:
                    (statefulsets if obj["kind"] == "StatefulSet" else groups)[component] = obj
            elif obj["kind"] == "Deployment":
                router = obj
            else:
                pods.append(obj)
        return Observed(statefulsets=statefulsets, router=router, pods=pods, leader_worker_sets=groups)

    def applied_digest(self, namespace: str, kind: str, name: str) -> str | None:
        """The rendering digest the live child carries, or None when it is not (known to be) there."""
        entry = self._children.get((namespace, kind, name))
        return entry.digest if entry is not None else None
