"""The informers on the wire: list, watch, resume, and a relist after 410 Gone that delivers the
deletions the expired watch missed."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web
from lightkube import AsyncClient
from operator_fakes import serve_fake_apiserver
from sovereign_operator.cache import CHILD_KINDS, ClusterCache
from sovereign_operator.informer import Informer, namespace_served

PODS = next(k for k in CHILD_KINDS if k.kind == "Pod")
LABELS = {"app.kubernetes.io/instance": "llm", "app.kubernetes.io/managed-by": "sovereign-operator"}


def _pod(name: str, rv: str, namespace: str = "ns", phase: str = "Pending") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": LABELS, "resourceVersion": rv},
        "status": {"phase": phase},
    }


@pytest.mark.parametrize(
    ("name", "patterns", "served"),
    [
        ("team-a", [], True),
        ("team-a", ["team-*"], True),
        ("prod", ["team-*", "prod"], True),
        ("other", ["team-*", "prod"], False),
        ("myapp-pr-456", ["myapp-*, !*-pr-*, *pr-123"], False),
        ("myapp-pr-123", ["myapp-*, !*-pr-*, *pr-123"], True),
        ("otherapp-pr-123", ["myapp-*, !*-pr-*, *pr-123"], False),
        ("anything", ["!*-pr-*"], True),
        ("x-pr-1", ["!*-pr-*"], False),
    ],
)
def test_namespaces_are_matched_as_kopf_matches_them(name: str, patterns: list[str], served: bool) -> None:
    assert namespace_served(name, patterns) is served


@pytest.mark.parametrize("scope", ["*", "ns"])
def test_lists_watches_and_after_a_410_lists_again_and_delivers_what_went_meanwhile(scope: str) -> None:
    """Cluster-wide (a relist sweeps every namespace) or in one namespace (it sweeps only that one:
    what another namespace's informer put in the cache stays)."""
    requests: list[dict[str, str]] = []
    watches = 0
    release = asyncio.Event()

    async def handle(request: web.Request) -> web.StreamResponse:
        nonlocal watches
        requests.append(dict(request.query))
        assert request.path == ("/api/v1/pods" if scope == "*" else "/api/v1/namespaces/ns/pods")
        assert "app.kubernetes.io/managed-by=sovereign-operator" in request.query["labelSelector"]
        if request.query.get("watch") != "true":
            lists = sum(1 for r in requests if r.get("watch") != "true")
            items = (
                [_pod("a", "5"), _pod("b", "6"), _pod("x", "7", namespace="unserved")]
                if lists == 1
                else [_pod("a", "12", phase="Running"), _pod("c", "11")]
            )
            body = {
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(10 * lists)},
                "items": items,
            }
            return web.Response(body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        watches += 1
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        if watches == 1:
            assert request.query["resourceVersion"] == "10"
            for event in (
                {"type": "ADDED", "object": _pod("c", "11")},
                {"type": "MODIFIED", "object": _pod("a", "12", phase="Running")},
                {
                    "type": "ERROR",
                    "object": {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "code": 410,
                        "reason": "Expired",
                        "message": "too old",
                    },
                },
            ):
                await response.write(json.dumps(event).encode() + b"\n")
            return response
        assert request.query["resourceVersion"] == "20"
        await release.wait()
        return response

    async def scenario() -> None:
        runner, config = await serve_fake_apiserver(handle)
        client = AsyncClient(config=config, trust_env=False)
        cache = ClusterCache()
        cache.put(_pod("elsewhere", "1", namespace="ns2"))
        changes: list[tuple[str, str]] = []
        informer = Informer(
            client,
            PODS,
            cache,
            lambda ns: namespace_served(ns, ["ns"]),
            lambda event, obj: changes.append((event, obj["metadata"]["name"])),
            namespace=scope,
            labels={"app.kubernetes.io/managed-by": "sovereign-operator"},
        )
        task = asyncio.create_task(informer.run())
        try:
            await asyncio.wait_for(informer.synced.wait(), 5)
            for _ in range(200):
                if informer.lists == 2 and watches == 2:
                    break
                await asyncio.sleep(0.01)
            assert informer.lists == 2
            pods = {p["metadata"]["name"]: p["status"]["phase"] for p in cache.observed("ns", "llm").pods}
            assert pods == {"a": "Running", "c": "Pending"}  # b went while the watch had expired
            mine = [change for change in changes if change[1] != "elsewhere"]
            assert mine[:4] == [("ADDED", "a"), ("ADDED", "b"), ("ADDED", "c"), ("MODIFIED", "a")]
            assert ("DELETED", "b") in mine[4:]
            assert not cache.children("unserved", "llm")  # a namespace the operator does not serve
            # Another namespace's object: gone with a cluster-wide relist, kept by a namespace's.
            assert bool(cache.children("ns2", "llm")) is (scope != "*")
        finally:
            release.set()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.close()
            await runner.cleanup()

    asyncio.run(scenario())


NOT_FOUND_STATUS = {
    "kind": "Status",
    "apiVersion": "v1",
    "status": "Failure",
    "reason": "NotFound",
    "code": 404,
}


@pytest.mark.parametrize(
    "body, content_type",
    [
        (json.dumps(NOT_FOUND_STATUS), "application/json"),
        # What a real apiserver answers for an API group it does not serve (LeaderWorkerSet's CRD
        # not installed, as on a fresh kind cluster): plain text, which lightkube raises as httpx's
        # HTTPStatusError rather than ApiError.
        ("404 page not found\n", "text/plain; charset=utf-8"),
    ],
    ids=["status-body", "plain-text"],
)
def test_a_kind_the_apiserver_does_not_serve_counts_as_synced_and_empty(body: str, content_type: str) -> None:
    """LeaderWorkerSet without its CRD: the LIST answers 404; reconciling must not wait for it."""

    async def handle(request: web.Request) -> web.Response:
        return web.Response(body=body.encode(), status=404, headers={"Content-Type": content_type})

    async def scenario() -> None:
        runner, config = await serve_fake_apiserver(handle)
        client = AsyncClient(config=config, trust_env=False)
        groups = next(k for k in CHILD_KINDS if k.kind == "LeaderWorkerSet")
        informer = Informer(client, groups, ClusterCache(), lambda ns: True, lambda event, obj: None)
        task = asyncio.create_task(informer.run())
        try:
            await asyncio.wait_for(informer.synced.wait(), 5)
            assert informer.lists == 0
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.close()
            await runner.cleanup()

    asyncio.run(scenario())
