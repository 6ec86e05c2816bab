"""A fake apiserver for the reconciler and handler tests (imported by name: tests/ is not a package)."""

from __future__ import annotations

import copy
import json
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from aiohttp import web
from lightkube import KubeConfig
from sovereign_operator.cache import APPLIED_DIGEST
from sovereign_operator.modeldownload import JobView
from sovereign_operator.observe import Observed


class FakeApiError(Exception):
    def __init__(self, code: int, message: str = "") -> None:
        super().__init__(f"HTTP {code}")
        self.status = type("Status", (), {"code": code, "message": message or f"HTTP {code}"})()


class FakeKube:
    """Keeps applied children and the LLMDeployment; StatefulSets report themselves ready."""

    def __init__(self, body: dict[str, Any], advertised: frozenset[str] = frozenset()) -> None:
        self.body = body
        self.advertised = advertised
        self.children: dict[tuple[str, str], dict[str, Any]] = {}
        self.applies = 0
        self.status_writes: list[dict[str, Any]] = []
        self.deleted: list[str] = []
        self.fail_apply_with: int | None = None
        # (kind, code, message): only that kind's apply fails, with the apiserver's message.
        self.fail_apply_of: tuple[str, int, str] | None = None
        self.conflicts_left = 0
        self.events: list[dict[str, Any]] = []
        # Shared objects (model caches) by (kind, name): the applied object and its owners' uids.
        self.shared: dict[tuple[str, str], dict[str, Any]] = {}
        self.shared_owners: dict[tuple[str, str], set[str]] = {}
        self.shared_applies = 0
        self.released: list[str] = []
        # release_unbound_claims calls: (namespace, owner uid or None after a deletion).
        self.unbound_sweeps: list[tuple[str, str | None]] = []
        # Jobs as the apiserver would report them: name -> JobView (a missing name reads as absent).
        self.jobs: dict[str, JobView] = {}
        self.deleted_jobs: list[str] = []
        # The claim each Job was observed with (the download Job's cache claim; None for others).
        self.job_claims: dict[str, str | None] = {}
        self.lws_installed = True  # the LeaderWorkerSet CRD (multi-node pools)

    async def apply(self, child: dict[str, Any]) -> None:
        if self.fail_apply_with is not None:
            raise FakeApiError(self.fail_apply_with)
        if self.fail_apply_of is not None and child["kind"] == self.fail_apply_of[0]:
            raise FakeApiError(self.fail_apply_of[1], self.fail_apply_of[2])
        self.applies += 1
        self.children[(child["kind"], child["metadata"]["name"])] = copy.deepcopy(child)

    async def apply_shared(self, child: dict[str, Any], owner_uid: str) -> None:
        if self.fail_apply_of is not None and child["kind"] == self.fail_apply_of[0]:
            raise FakeApiError(self.fail_apply_of[1], self.fail_apply_of[2])
        key = (child["kind"], child["metadata"]["name"])
        self.shared_applies += 1
        self.shared[key] = copy.deepcopy(child)
        owners = self.shared_owners.setdefault(key, set())
        # As in the apiserver: only an object naming this owner has it (a Retain claim names none).
        if any(r["uid"] == owner_uid for r in child["metadata"].get("ownerReferences") or []):
            owners.add(owner_uid)

    async def release_shared(self, namespace: str, owner_uid: str, keep: set[tuple[str, str]]) -> list[str]:
        released = []
        for key, owners in list(self.shared_owners.items()):
            if owner_uid not in owners or key in keep:
                continue
            owners.discard(owner_uid)
            if not owners:
                del self.shared_owners[key]
                self.shared.pop(key, None)
            released.append(f"{key[0]}/{key[1]}")
        self.released += released
        return released

    async def release_unbound_claims(
        self, namespace: str, owner_uid: str | None, keep: set[tuple[str, str]]
    ) -> list[str]:
        self.unbound_sweeps.append((namespace, owner_uid))
        return []

    async def observe_job(
        self, namespace: str, name: str, log_container: str | None, claim: str | None = None
    ) -> JobView:
        self.job_claims[name] = claim
        view = self.jobs.get(name)
        if view is None:
            # An applied Job exists (no pods yet); one never applied, or deleted, does not.
            applied = ("Job", name) in self.shared
            view = JobView(job={"metadata": {"name": name}, "status": {}} if applied else None)
        if view.claim is None and claim is not None and ("PersistentVolumeClaim", claim) in self.shared:
            # An applied claim exists; the tests of Pending claims give theirs in the view.
            view = replace(view, claim={"metadata": {"name": claim}, "status": {"phase": "Bound"}})
        return view

    async def delete_job(self, namespace: str, name: str) -> None:
        self.deleted_jobs.append(name)
        self.jobs.pop(name, None)
        self.shared.pop(("Job", name), None)

    def applied_digest(self, namespace: str, kind: str, name: str) -> str | None:
        child = self.children.get((kind, name))
        annotations = (child or {}).get("metadata", {}).get("annotations") or {}
        return annotations.get(APPLIED_DIGEST)

    async def prune(
        self, namespace: str, instance: str, owner_uid: str, keep: set[tuple[str, str]]
    ) -> list[str]:
        kinds = ("StatefulSet", "LeaderWorkerSet", "Service", "PodDisruptionBudget", "ConfigMap")
        gone = [key for key in self.children if key[0] in kinds]
        gone = [key for key in gone if key not in keep]
        for key in gone:
            del self.children[key]
            self.deleted.append(f"{key[0]}/{key[1]}")
        return self.deleted

    async def create_event(self, event: dict[str, Any]) -> None:
        self.events.append(copy.deepcopy(event))

    async def advertised_resources(self) -> frozenset[str]:
        return self.advertised

    async def leader_worker_set_installed(self) -> bool:
        return self.lws_installed

    async def get_deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.body)

    async def observe(self, namespace: str, instance: str) -> Observed:
        statefulsets, groups = {}, {}
        for (kind, _), child in self.children.items():
            if kind in ("StatefulSet", "LeaderWorkerSet"):
                replicas = child["spec"]["replicas"]
                component = child["metadata"]["labels"]["app.kubernetes.io/component"]
                into = statefulsets if kind == "StatefulSet" else groups
                into[component] = {
                    "metadata": {"generation": 1},
                    "status": {
                        "observedGeneration": 1,
                        "replicas": replicas,
                        "readyReplicas": replicas,
                        "updatedReplicas": replicas,
                    },
                }
        router = {"spec": {"replicas": 1}, "status": {"readyReplicas": 1}}
        return Observed(statefulsets=statefulsets, router=router, leader_worker_sets=groups)

    async def patch_status(
        self, namespace: str, name: str, patch: dict[str, Any], resource_version: str | None = None
    ) -> None:
        if self.conflicts_left > 0:
            self.conflicts_left -= 1
            raise FakeApiError(409)
        self.status_writes.append(patch)
        status = self.body.setdefault("status", {})
        merge_patch(status, json.loads(json.dumps(patch)))


def merge_patch(target: dict[str, Any], patch: dict[str, Any]) -> None:
    """Apply a JSON merge patch (RFC 7386) to ``target`` in place."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            merge_patch(target[key], value)
        else:
            target[key] = value


def body_for(spec: dict[str, Any], generation: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "sovereign.ai/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": "llm", "namespace": "ns", "uid": "uid-1", "generation": generation},
        "spec": copy.deepcopy(spec),
    }


async def serve_fake_apiserver(
    handle: Callable[[web.Request], Awaitable[web.StreamResponse]], method: str = "GET"
) -> tuple[web.AppRunner, KubeConfig]:
    """An aiohttp server on 127.0.0.1 answering every path with `handle`, and a kubeconfig for it.
    The caller cleans the runner up."""
    app = web.Application()
    app.router.add_route(method, "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    config = KubeConfig.from_dict(
        {
            "clusters": [{"name": "fake", "cluster": {"server": f"http://{host}:{port}"}}],
            "users": [{"name": "test", "user": {"token": "t"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "test"}}],
            "current-context": "fake",
        }
    )
    return runner, config
