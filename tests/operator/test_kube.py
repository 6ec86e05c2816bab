"""The lightkube layer on the wire: against a tiny fake apiserver on 127.0.0.1.

Checks what a real apiserver would see: server-side apply with our field manager and force,
label selectors, status merge patches with a resourceVersion precondition, 404 handling.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from lightkube import AsyncClient
from operator_fakes import serve_fake_apiserver
from sovereign_operator.cache import ClusterCache
from sovereign_operator.kube import Kube, shared_appliers
from sovereign_operator.modeldownload import unbound_claim_fate, unbound_retained_cache

Handler = Callable[[web.Request], Awaitable[web.Response]]


def _list(kind: str, api_version: str, items: list[dict[str, Any]]) -> dict[str, Any]:
    return {"kind": f"{kind}List", "apiVersion": api_version, "metadata": {}, "items": items}


STATEFULSET = {
    "apiVersion": "apps/v1",
    "kind": "StatefulSet",
    "metadata": {
        "name": "llm-unified",
        "namespace": "ns",
        "labels": {"app.kubernetes.io/component": "unified"},
        "ownerReferences": [
            {
                "apiVersion": "sovereign.ai/v1alpha1",
                "kind": "LLMDeployment",
                "name": "llm",
                "uid": "u1",
                "controller": True,
            }
        ],
    },
    "spec": {"selector": {"matchLabels": {}}, "serviceName": "llm-unified", "template": {}},
    "status": {"replicas": 1, "readyReplicas": 1},
}


CLAIM_EVENT = {
    "apiVersion": "v1",
    "kind": "Event",
    "metadata": {"name": "c-pending.1", "namespace": "ns"},
    "involvedObject": {"kind": "PersistentVolumeClaim", "name": "c-pending", "namespace": "ns"},
    "type": "Warning",
    "reason": "ProvisioningFailed",
    "message": 'storageclass.storage.k8s.io "fast" not found',
}


def _json(obj: Any, status: int = 200) -> web.Response:
    # Exactly "application/json", as the apiserver sends it (lightkube matches it literally).
    return web.Response(
        body=json.dumps(obj).encode(), status=status, headers={"Content-Type": "application/json"}
    )


async def _with_fake_apiserver(
    scenario: Callable[[Kube, list[dict[str, Any]]], Awaitable[None]],
    pods: list[dict[str, Any]] | None = None,
    cache: ClusterCache | None = None,
    objects: dict[str, dict[str, Any]] | None = None,
    config_maps: list[dict[str, Any]] | None = None,
) -> None:
    """`objects`: what a GET of one object's path answers (others: lists answer empty); `config_maps`:
    what the namespace's ConfigMap list answers."""
    requests: list[dict[str, Any]] = []

    async def handle(request: web.Request) -> web.Response:
        body = await request.text()
        requests.append(
            {
                "method": request.method,
                "path": request.path,
                "query": dict(request.query),
                "content_type": request.headers.get("Content-Type", ""),
                "body": body,
            }
        )
        path = request.path
        if request.method == "GET" and objects is not None and path in objects:
            return _json(objects[path])
        if request.method == "PATCH" and request.headers.get("Content-Type", "").startswith(
            "application/apply-patch"
        ):
            return _json(json.loads(body))
        if request.method == "PATCH" and path.endswith("/conflict/status"):
            status = {
                "kind": "Status",
                "apiVersion": "v1",
                "status": "Failure",
                "reason": "Conflict",
                "code": 409,
            }
            return _json(status, status=409)
        if request.method == "PATCH" and path.endswith("/status"):
            patch = json.loads(body)
            return _json(
                {
                    "apiVersion": "sovereign.ai/v1alpha1",
                    "kind": "LLMDeployment",
                    "metadata": {"name": "llm", "namespace": "ns", "resourceVersion": "43"},
                    "status": patch["status"],
                }
            )
        if path == "/api/v1/nodes":
            nodes = [
                {"metadata": {"name": "a"}, "status": {"allocatable": {"cpu": "8", "rdma/hca": "0"}}},
                {
                    "metadata": {
                        "name": "b",
                        "labels": {"nvidia.com/gpu.product": "NVIDIA-H200", "kubernetes.io/hostname": "b"},
                    },
                    "status": {"allocatable": {"nvidia.com/gpu": "8", "rdma/ib": "4"}},
                },
            ]
            wanted = request.query.get("fieldSelector", "").removeprefix("metadata.name=")
            return _json(
                _list("Node", "v1", [n for n in nodes if not wanted or n["metadata"]["name"] == wanted])
            )
        if path == "/api/v1/namespaces/ns/events":
            if "c-broken" in request.query.get("fieldSelector", ""):
                return _json({}, status=500)
            return _json(_list("Event", "v1", [CLAIM_EVENT]))
        if path == "/api/v1/namespaces/ns/pods" and pods is not None:
            return _json(_list("Pod", "v1", pods))
        if path == "/api/v1/namespaces/ns/configmaps" and config_maps is not None:
            return _json(_list("ConfigMap", "v1", config_maps))
        if path == "/apis/apps/v1/namespaces/ns/statefulsets":
            return _json(_list("StatefulSet", "apps/v1", [STATEFULSET]))
        if request.method == "GET" and path.startswith("/apis/sovereign.ai/"):
            status = {
                "kind": "Status",
                "apiVersion": "v1",
                "status": "Failure",
                "reason": "NotFound",
                "code": 404,
            }
            return _json(status, status=404)
        if request.method == "DELETE":
            return _json({"kind": "Status", "apiVersion": "v1", "status": "Success"})
        if request.method == "GET":  # other lists are empty
            kind = path.rsplit("/", 1)[-1]
            return _json(_list(kind, "v1", []))
        return _json({}, status=500)

    runner, config = await serve_fake_apiserver(handle, "*")
    kube = Kube(AsyncClient(config=config, field_manager="sovereign-operator", trust_env=False), cache=cache)
    try:
        await scenario(kube, requests)
    finally:
        await kube.close()
        await runner.cleanup()


def test_apply_is_server_side_with_one_field_manager_and_force() -> None:
    child = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "llm-runtime", "namespace": "ns"},
        "data": {"SOVEREIGN_MODE": "unified"},
    }

    async def scenario(kube: Kube, requests: list[dict[str, Any]]) -> None:
        await kube.apply(child)
        (request,) = requests
        assert request["method"] == "PATCH"
        assert request["path"] == "/api/v1/namespaces/ns/configmaps/llm-runtime"
        assert request["content_type"].startswith("application/apply-patch")
        assert request["query"]["fieldManager"] == "sovereign-operator"
        assert request["query"]["force"] == "true"
        assert json.loads(request["body"]) == child

    asyncio.run(_with_fake_apiserver(scenario))


def test_reads_nodes_children_and_a_missing_deployment() -> None:
    async def scenario(kube: Kube, requests: list[dict[str, Any]]) -> None:
        advertised = await kube.advertised_resources()
        assert "rdma/ib" in advertised and "rdma/hca" not in advertised
        observed = await kube.observe("ns", "llm")
        assert observed.statefulsets["unified"]["status"]["readyReplicas"] == 1
        sts_request = next(r for r in requests if r["path"].endswith("/statefulsets"))
        selector = set(sts_request["query"]["labelSelector"].split(","))
        assert selector == {
            "app.kubernetes.io/instance=llm",
            "app.kubernetes.io/managed-by=sovereign-operator",
        }
        assert await kube.get_deployment("ns", "llm") is None

    asyncio.run(_with_fake_apiserver(scenario))


def test_worker_pods_nodes_are_read_by_name_once_for_their_gpu_product() -> None:
    worker = {
        "metadata": {"name": "llm-unified-0", "labels": {"app.kubernetes.io/component": "unified"}},
        "spec": {"nodeName": "b", "containers": [{"name": "runtime", "image": "i"}]},
    }
    router = {
        "metadata": {"name": "llm-router-x", "labels": {"app.kubernetes.io/component": "router"}},
        "spec": {"nodeName": "a", "containers": [{"name": "router", "image": "i"}]},
    }

    async def scenario(kube: Kube, requests: list[dict[str, Any]]) -> None:
        # The rounds of many deployments at once (after a burst) share one read of the node.
        for observed in await asyncio.gather(*(kube.observe("ns", "llm") for _ in range(5))):
            assert observed.node_labels == {"b": {"nvidia.com/gpu.product": "NVIDIA-H200"}}
        observed = await kube.observe("ns", "llm")
        assert observed.node_labels == {"b": {"nvidia.com/gpu.product": "NVIDIA-H200"}}
        node_reads = [r for r in requests if r["path"] == "/api/v1/nodes"]
        assert [r["query"]["fieldSelector"] for r in node_reads] == ["metadata.name=b"]  # once, by name

    asyncio.run(_with_fake_apiserver(scenario, pods=[worker, router]))


def test_prune_deletes_only_owned_children_not_rendered() -> None:
    async def scenario(kube: Kube, requests: list[dict[str, Any]]) -> None:
        assert await kube.prune("ns", "llm", "someone-else", set()) == []
        assert await kube.prune("ns", "llm", "u1", {("StatefulSet", "llm-unified")}) == []
        assert await kube.prune("ns", "llm", "u1", set()) == ["StatefulSet/llm-unified"]
        deletes = [r for r in requests if r["method"] == "DELETE"]
        assert [r["path"] for r in deletes] == ["/apis/apps/v1/namespaces/ns/statefulsets/llm-unified"]

    asyncio.run(_with_fake_apiserver(scenario))


def test_prune_deletes_the_chat_template_config_map_once_it_is_not_rendered() -> None:
    def config_map(name: str, owner: str) -> dict[str, Any]:
        owners = [{**STATEFULSET["metadata"]["ownerReferences"][0], "uid": owner}]  # type: ignore[index]
        return {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": "ns", "ownerReferences": owners},
        }

    maps = [config_map("llm-runtime", "u1"), config_map("llm-chat-template", "u1"), config_map("mine", "x")]

    async def scenario(kube: Kube, requests: list[dict[str, Any]]) -> None:
        keep = {("StatefulSet", "llm-unified"), ("ConfigMap", "llm-runtime")}
        assert await kube.prune("ns", "llm", "u1", keep) == ["ConfigMap/llm-chat-template"]
        deletes = [r["path"] for r in requests if r["method"] == "DELETE"]
        assert deletes == ["/api/v1/namespaces/ns/configmaps/llm-chat-template"]

    asyncio.run(_with_fake_apiserver(scenario, config_maps=maps))


def test_status_is_a_merge_patch_on_the_subresource_with_a_precondition() -> None:
    async def scenario(kube: Kube, requests: list[dict[str, Any]]) -> None:
        await kube.patch_status("ns", "llm", {"mode": "unified"}, resource_version="42")
        (request,) = requests
        assert request["path"] == "/apis/sovereign.ai/v1alpha1/namespaces/ns/llmdeployments/llm/status"
        assert request["content_type"].startswith("application/merge-patch+json")
        assert json.loads(request["body"]) == {
            "status": {"mode": "unified"},
            "metadata": {"resourceVersion": "42"},
        }

    asyncio.run(_with_fake_apiserver(scenario))


def _synced_cache() -> ClusterCache:
    cache = ClusterCache()
    labels = {"app.kubernetes.io/instance": "llm", "app.kubernetes.io/managed-by": "sovereign-operator"}
    sts = json.loads(json.dumps(STATEFULSET))
    sts["metadata"]["labels"] = {**labels, "app.kubernetes.io/component": "unified"}
    cache.put(sts)
    cache.put(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "llm-unified-0", "namespace": "ns", "labels": labels},
        }
    )
    cache.put(
        {
            "apiVersion": "sovereign.ai/v1alpha1",
            "kind": "LLMDeployment",
            "metadata": {"name": "llm", "namespace": "ns", "resourceVersion": "42"},
            "status": {"mode": "unified"},
        }
    )
    cache.synced = True
    return cache


def test_a_synced_cache_answers_reads_and_learns_from_the_operators_own_writes() -> None:
    cache = _synced_cache()

    async def scenario(kube: Kube, requests: list[dict[str, Any]]) -> None:
        observed = await kube.observe("ns", "llm")
        assert observed.statefulsets["unified"]["status"]["readyReplicas"] == 1
        assert [p["metadata"]["name"] for p in observed.pods] == ["llm-unified-0"]
        assert (await kube.get_deployment("ns", "llm"))["status"] == {"mode": "unified"}  # type: ignore[index]
        assert await kube.prune("ns", "llm", "u1", {("StatefulSet", "llm-unified")}) == []
        assert requests == []
        # Nodes are listed once for a burst of new deployments.
        await kube.advertised_resources()
        await kube.advertised_resources()
        assert len(requests) == 1
        await kube.patch_status("ns", "llm", {"mode": "disaggregated"}, resource_version="42")
        assert (await kube.get_deployment("ns", "llm"))["metadata"]["resourceVersion"] == "43"  # type: ignore[index]
        assert len(requests) == 2
        # A refused write means the cache is behind: the next read goes to the apiserver.
        cache.put(
            {
                "apiVersion": "sovereign.ai/v1alpha1",
                "kind": "LLMDeployment",
                "metadata": {"name": "conflict", "namespace": "ns", "resourceVersion": "1"},
            }
        )
        try:
            await kube.patch_status("ns", "conflict", {"mode": "unified"}, resource_version="1")
        except Exception as error:
            assert getattr(error.status, "code", None) == 409  # type: ignore[attr-defined]
        assert await kube.get_deployment("ns", "conflict") is None  # the fake answers 404
        assert [r["method"] for r in requests[2:]] == ["PATCH", "GET"]
        # A child pruned from the cache's view is deleted on the apiserver and from the cache.
        assert await kube.prune("ns", "llm", "u1", set()) == ["StatefulSet/llm-unified"]
        assert "unified" not in (await kube.observe("ns", "llm")).statefulsets

    asyncio.run(_with_fake_apiserver(scenario, cache=cache))


def test_a_synced_cache_answers_the_model_downloads_reads() -> None:
    """The download's Job, its pods and the shared claims come from the cache (no LIST, no GET);
    a Job deleted to run again leaves the cache at once."""
    cache = _synced_cache()
    shared = {
        "app.kubernetes.io/managed-by": "sovereign-operator",
        "app.kubernetes.io/component": "model-download",
    }
    cache.put(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "dl", "namespace": "ns", "labels": shared, "resourceVersion": "3"},
            "status": {"active": 1},
        }
    )
    cache.put(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "dl-x",
                "namespace": "ns",
                "labels": {**shared, "batch.kubernetes.io/job-name": "dl"},
                "resourceVersion": "4",
            },
            "status": {"phase": "Pending"},
        }
    )

    async def scenario(kube: Kube, requests: list[dict[str, Any]]) -> None:
        view = await kube.observe_job("ns", "dl", "download")
        assert view.job is not None and view.job["status"] == {"active": 1}
        assert [p["metadata"]["name"] for p in view.pods] == ["dl-x"]
        assert (await kube.observe_job("ns", "other", None)).job is None
        assert await kube.release_shared("ns", "u1", set()) == []  # no reference of u1's
        assert requests == []
        await kube.delete_job("ns", "dl")
        assert [r["method"] for r in requests] == ["DELETE"]
        assert (await kube.observe_job("ns", "dl", None)).job is None

    asyncio.run(_with_fake_apiserver(scenario, cache=cache))


def test_a_download_claim_is_read_from_the_cache_and_its_events_only_while_it_is_not_bound() -> None:
    cache = _synced_cache()
    labels = {
        "app.kubernetes.io/managed-by": "sovereign-operator",
        "app.kubernetes.io/component": "model-cache",
    }
    for name, phase in (("c-bound", "Bound"), ("c-pending", "Pending"), ("c-broken", "Pending")):
        cache.put(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": name, "namespace": "ns", "labels": labels, "resourceVersion": "5"},
                "spec": {"accessModes": ["ReadWriteMany"]},
                "status": {"phase": phase},
            }
        )

    async def scenario(kube: Kube, requests: list[dict[str, Any]]) -> None:
        bound = await kube.observe_job("ns", "dl", "download", claim="c-bound")
        assert bound.claim is not None and bound.claim["status"]["phase"] == "Bound"  # whole, from the cache
        assert bound.claim_events == [] and requests == []  # a bound claim costs no read
        pending = await kube.observe_job("ns", "dl", "download", claim="c-pending")
        assert [e["reason"] for e in pending.claim_events] == ["ProvisioningFailed"]
        (read,) = requests
        assert read["path"] == "/api/v1/namespaces/ns/events"
        assert set(read["query"]["fieldSelector"].split(",")) == {
            "involvedObject.kind=PersistentVolumeClaim",
            "involvedObject.name=c-pending",
            "type=Warning",
        }
        # Events are advice: an apiserver that refuses the read costs the reason, not the round.
        broken = await kube.observe_job("ns", "dl", "download", claim="c-broken")
        assert broken.claim is not None and broken.claim_events == []

    asyncio.run(_with_fake_apiserver(scenario, cache=cache))


def _cache_claim(name: str, appliers: list[str], **extra: Any) -> dict[str, Any]:
    """A Pending `Retain` cache claim as a GET answers it: with the managed fields of each applier
    (LLMDeployment uids; other names are managers of someone else's)."""
    managers = [
        {"manager": a if a.startswith("kubectl") else f"sovereign-operator-{a}", "operation": "Apply"}
        for a in appliers
    ]
    managers.append({"manager": "kube-controller-manager", "operation": "Update"})
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": name,
            "namespace": "ns",
            "resourceVersion": "7",
            "labels": {
                "app.kubernetes.io/managed-by": "sovereign-operator",
                "app.kubernetes.io/component": "model-cache",
            },
            "managedFields": managers,
        },
        "spec": {"accessModes": ["ReadWriteMany"]},
        "status": {"phase": "Pending"},
    }
    for key, value in extra.items():
        claim[key] = {**claim[key], **value}
    return claim


def test_a_retained_cache_claim_that_never_bound_goes_once_no_existing_deployment_applied_it() -> None:
    """A `Retain` claim keeps a download for later users; one that never bound keeps nothing, so
    the deployment that stops rendering it deletes it, unless another existing one applied it too
    (then only its own fields go). Bound, binding, owned, kept and hand-made claims stay."""
    claims = {
        "c-mine": _cache_claim("c-mine", ["u1"]),
        "c-shared": _cache_claim("c-shared", ["u1", "u2"]),
        "c-theirs": _cache_claim("c-theirs", ["u2"]),
        "c-abandoned": _cache_claim("c-abandoned", ["u9"]),  # u9 was deleted
        "c-bound": _cache_claim("c-bound", ["u1"], status={"phase": "Bound"}),
        "c-binding": _cache_claim("c-binding", ["u1"], spec={"volumeName": "pv-1"}),
        "c-kept": _cache_claim("c-kept", ["u1"]),
        "c-by-hand": _cache_claim("c-by-hand", ["kubectl-client-side-apply"]),
        "c-delete": _cache_claim(
            "c-delete", ["u1"], metadata={"ownerReferences": [{"uid": "u2", "kind": "LLMDeployment"}]}
        ),
    }
    cache = _synced_cache()
    for claim in claims.values():
        cache.put(claim)
    for name, uid in (("a", "u1"), ("b", "u2")):
        cache.put(
            {
                "apiVersion": "sovereign.ai/v1alpha1",
                "kind": "LLMDeployment",
                "metadata": {"name": name, "namespace": "ns", "uid": uid, "resourceVersion": "9"},
            }
        )
    paths = {f"/api/v1/namespaces/ns/persistentvolumeclaims/{n}": c for n, c in claims.items()}

    async def scenario(kube: Kube, requests: list[dict[str, Any]]) -> None:
        released = await kube.release_shared("ns", "u1", {("PersistentVolumeClaim", "c-kept")})
        assert sorted(released) == [
            "PersistentVolumeClaim/c-abandoned",
            "PersistentVolumeClaim/c-mine",
            "PersistentVolumeClaim/c-shared",
        ]
        writes = [r for r in requests if r["method"] != "GET"]
        deleted = sorted(r["path"].rsplit("/", 1)[-1] for r in writes if r["method"] == "DELETE")
        assert deleted == ["c-abandoned", "c-mine"]
        (release,) = [r for r in writes if r["method"] == "PATCH"]
        assert release["path"].endswith("/persistentvolumeclaims/c-shared")
        assert release["content_type"].startswith("application/apply-patch")
        assert release["query"]["fieldManager"] == "sovereign-operator-u1"
        assert json.loads(release["body"]) == {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "c-shared"},
        }
        # Only the candidates are read whole (the cache has no managed fields).
        read = sorted(r["path"].rsplit("/", 1)[-1] for r in requests if r["method"] == "GET")
        assert read == ["c-abandoned", "c-by-hand", "c-mine", "c-shared", "c-theirs"]
        # After a deletion (no owner): only the claims no existing deployment applied.
        requests.clear()
        cache.remove("PersistentVolumeClaim", "ns", "c-abandoned")
        cache.remove("PersistentVolumeClaim", "ns", "c-mine")
        assert await kube.release_unbound_claims("ns", None, set()) == []
        read = sorted(r["path"].rsplit("/", 1)[-1] for r in requests if r["method"] == "GET")
        assert read == ["c-by-hand", "c-kept", "c-shared", "c-theirs"]  # each applied by u1 or u2, or by hand
        assert all(r["method"] == "GET" for r in requests)

    asyncio.run(_with_fake_apiserver(scenario, cache=cache, objects=paths))


def test_the_fate_of_an_unbound_retained_claim() -> None:
    live = {"u1", "u2"}
    assert unbound_claim_fate({"u1"}, "u1", live) == "delete"
    assert unbound_claim_fate({"u1", "u9"}, "u1", live) == "delete"  # u9 is gone
    assert unbound_claim_fate({"u1", "u2"}, "u1", live) == "release"
    assert unbound_claim_fate({"u2"}, "u1", live) is None
    assert unbound_claim_fate({"u9"}, None, live) == "delete"
    assert unbound_claim_fate({"u2"}, None, live) is None
    assert unbound_claim_fate(set(), "u1", live) is None
    claim = _cache_claim("c", ["u1"])
    assert shared_appliers(claim) == {"u1"} and unbound_retained_cache(claim)
    assert not unbound_retained_cache({**claim, "status": {"phase": "Lost"}})
