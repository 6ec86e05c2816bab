"""The router against stub workers on loopback: routing, streaming, retries, health, metrics."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web
from loopback import serve_app
from sovereign_runtime.router.app import Router, RouterConfig, create_app
from sovereign_runtime.router.cli import add_router_arguments, validate_router_args
from sovereign_runtime.router.discovery import endpoint_urls
from sovereign_runtime.router.policy import (
    CacheAwarePolicy,
    LeastLoadPolicy,
    Worker,
    WorkerPool,
    make_policy,
    prompt_key,
)
from sovereign_runtime.router.prefix_tree import ApproximatePrefixTree

# ---- pure parts -------------------------------------------------------------------------------------


def test_prefix_tree_matches_longest_prefix_and_splits() -> None:
    tree = ApproximatePrefixTree()
    tree.insert("hello world", "a")
    tree.insert("hello there", "b")
    assert tree.match("hello world, again").worker == "a"
    assert tree.match("hello world, again").matched_chars == len("hello world")
    assert tree.match("hello there!").worker == "b"
    # The shared "hello " run is held by both; the most recent user wins.
    assert tree.match("hello ").worker == "b"
    assert tree.match("goodbye").worker is None
    assert tree.match("hello world", alive={"b"}).worker == "b"
    assert tree.match("hello world", alive={"b"}).matched_chars == len("hello ")


def test_prefix_tree_evicts_least_recent_and_forgets_workers() -> None:
    tree = ApproximatePrefixTree(max_chars=30)
    tree.insert("a" * 20, "w1")
    tree.insert("b" * 20, "w2")  # over budget: the older entry goes
    assert tree.size_chars <= 30
    assert tree.match("a" * 20).worker is None
    assert tree.match("b" * 20).worker == "w2"
    tree.remove_worker("w2")
    assert tree.match("b" * 20).worker is None
    assert tree.size_chars == 0


def _workers(*loads: int) -> list[Worker]:
    return [Worker(url=f"http://w{i}", role="worker", in_flight=load) for i, load in enumerate(loads)]


def test_least_load_picks_idlest_and_rotates_ties() -> None:
    policy = LeastLoadPolicy()
    assert policy.choose(_workers(3, 1, 2), "").url == "http://w1"
    tied = _workers(0, 0)
    assert {policy.choose(tied, "").url for _ in range(4)} == {"http://w0", "http://w1"}


def test_cache_aware_prefers_the_worker_holding_the_prefix_unless_imbalanced() -> None:
    policy = CacheAwarePolicy(balance_abs=4, balance_rel=1.5)
    workers = _workers(2, 0)
    shared = "system: you are terse\n" * 10
    policy.record(workers[0], shared)
    assert policy.choose(workers, shared + "user: hi").url == "http://w0"
    # No useful match: least load.
    assert policy.choose(workers, "something else entirely").url == "http://w1"
    # The cached worker is swamped: balance wins over affinity.
    swamped = _workers(20, 0)
    policy.record(swamped[0], shared)
    assert policy.choose(swamped, shared + "user: hi").url == "http://w1"


def test_unknown_policy_names_valid_ones() -> None:
    with pytest.raises(ValueError, match="cache-aware"):
        make_policy("random")


def test_worker_pool_membership_and_failure_threshold() -> None:
    pool = WorkerPool(failure_threshold=2)
    pool.set_members("worker", {"http://a", "http://b"})
    a = pool.get("http://a")
    assert a is not None
    pool.record_failure(a)
    assert a.routable
    pool.record_failure(a)
    assert not a.routable
    assert [w.url for w in pool.routable("worker")] == ["http://b"]
    assert pool.set_members("worker", {"http://b"}) == ["http://a"]


def test_prompt_key_covers_chat_and_completion_shapes() -> None:
    assert prompt_key({"messages": [{"role": "user", "content": "hi"}]}) == "user:hi\n"
    assert (
        prompt_key({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}) == "user:x\n"
    )
    assert prompt_key({"prompt": "abc"}) == "abc"
    assert prompt_key({"prompt": [1, 2, 3]}) == "1,2,3"
    assert prompt_key({"prompt": [[4, 5]]}) == "4,5"
    assert prompt_key({}) == ""


def test_endpoint_urls_keeps_ready_non_terminating_endpoints() -> None:
    slices = {
        "s1": {
            "ports": [{"name": "http", "port": 8000}],
            "endpoints": [
                {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
                {"addresses": ["10.0.0.2"], "conditions": {"ready": False}},
                {"addresses": ["10.0.0.3"], "conditions": {"ready": True, "terminating": True}},
                {"addresses": ["fd00::4"], "conditions": {}},
            ],
        }
    }
    assert endpoint_urls(slices) == {"http://10.0.0.1:8000", "http://[fd00::4]:8000"}


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_router_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        ((), "give workers"),
        (("--worker", "http://a", "--prefill", "http://b"), "cannot be combined"),
        (("--prefill", "http://a"), "both prefill and decode"),
        (("--worker-service", "svc"), "--namespace"),
    ],
)
def test_router_flags_are_validated(argv: tuple[str, ...], fragment: str) -> None:
    assert fragment in (validate_router_args(_parse(*argv)) or "")


def test_router_flags_accept_valid_combinations() -> None:
    assert validate_router_args(_parse("--worker", "http://a", "http://b")) is None
    assert validate_router_args(_parse("--prefill", "http://a", "--decode", "http://b")) is None
    assert validate_router_args(_parse("--namespace", "ns", "--worker-service", "svc")) is None


# ---- the HTTP shell against stub workers ------------------------------------------------------------


class StubWorker:
    """A fake runtime worker: records requests, answers with a fixed or custom behaviour."""

    def __init__(self, name: str, behaviour: Callable | None = None) -> None:
        self.name = name
        self.requests: list[dict] = []
        self.ready_status = 200
        self.behaviour = behaviour
        self.app = web.Application()
        self.app.router.add_post("/v1/chat/completions", self.chat)
        self.app.router.add_post("/v1/completions", self.chat)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/health/ready", self.ready)
        self.url = ""

    async def ready(self, request: web.Request) -> web.Response:
        return web.Response(status=self.ready_status)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        payload = await request.json()
        self.requests.append(payload)
        if self.behaviour is not None:
            return await self.behaviour(request, payload)
        if payload.get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for piece in ("a", "b", "c"):
                await response.write(f"data: {json.dumps({'worker': self.name, 'text': piece})}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        return web.json_response({"worker": self.name})


@asynccontextmanager
async def router_over(members: dict[str, list[str]], **config: object) -> AsyncIterator[tuple[str, Router]]:
    router = Router(RouterConfig(static_members=members, health_interval_s=3600, **config))  # type: ignore[arg-type]
    async with serve_app(create_app(router)) as url:
        await router.check_all()
        yield url, router


def run(coro: object) -> object:
    return asyncio.run(asyncio.wait_for(coro, timeout=30))  # type: ignore[arg-type]


def test_routes_and_streams_through_to_workers() -> None:
    async def scenario() -> None:
        a, b = StubWorker("a"), StubWorker("b")
        async with serve_app(a.app) as url_a, serve_app(b.app) as url_b:
            async with (
                router_over({"worker": [url_a, url_b]}, policy="least-load") as (url, _),
                aiohttp.ClientSession() as client,
            ):
                seen = set()
                for _ in range(4):
                    async with client.post(f"{url}/v1/chat/completions", json={"messages": []}) as resp:
                        assert resp.status == 200
                        seen.add((await resp.json())["worker"])
                assert seen == {"a", "b"}
                async with client.post(f"{url}/v1/completions", json={"prompt": "x", "stream": True}) as resp:
                    assert resp.headers["Content-Type"].startswith("text/event-stream")
                    text = await resp.text()
                assert text.count("data: ") == 4 and text.endswith("data: [DONE]\n\n")
                async with client.get(f"{url}/v1/models") as resp:
                    assert (await resp.json())["data"][0]["id"] == "tiny"

    run(scenario())


def test_retries_on_another_worker_before_any_byte_is_sent() -> None:
    async def broken(request: web.Request, payload: dict) -> web.Response:
        return web.json_response({"error": "boom"}, status=500)

    async def scenario() -> None:
        bad, good = StubWorker("bad", broken), StubWorker("good")
        async with serve_app(bad.app) as url_bad, serve_app(good.app) as url_good:
            async with (
                router_over({"worker": [url_bad, url_good]}, policy="round-robin", failure_threshold=2) as (
                    url,
                    router,
                ),
                aiohttp.ClientSession() as client,
            ):
                for _ in range(4):
                    async with client.post(f"{url}/v1/chat/completions", json={"messages": []}) as resp:
                        assert resp.status == 200
                        assert (await resp.json())["worker"] == "good"
                # Two failures in a row took the broken worker out of rotation.
                assert not router.pool.get(url_bad).alive  # type: ignore[union-attr]
                async with client.get(f"{url}/metrics") as resp:
                    metrics = await resp.text()
                assert "sovereign_router_retries_total" in metrics

    run(scenario())


def test_dead_worker_is_skipped_and_no_workers_gives_openai_503() -> None:
    async def scenario() -> None:
        good = StubWorker("good")
        async with serve_app(good.app) as url_good:
            dead = "http://127.0.0.1:9"  # discard port: connection refused
            async with (
                router_over({"worker": [dead, url_good]}, policy="round-robin") as (url, router),
                aiohttp.ClientSession() as client,
            ):
                router.pool.get(dead).alive = True  # type: ignore[union-attr]  # pretend the check has not noticed
                router.pool.get(dead).ready = True  # type: ignore[union-attr]
                for _ in range(2):
                    async with client.post(f"{url}/v1/completions", json={"prompt": "x"}) as resp:
                        assert (await resp.json())["worker"] == "good"
                good.ready_status = 503  # draining
                await router.check_all()
                async with client.post(f"{url}/v1/completions", json={"prompt": "x"}) as resp:
                    assert resp.status == 503
                    error = (await resp.json())["error"]
                    assert error["type"] == "service_unavailable"
                async with client.get(f"{url}/health/ready") as resp:
                    assert resp.status == 503

    run(scenario())


def test_malformed_json_gets_openai_error() -> None:
    async def scenario() -> None:
        async with router_over({"worker": []}) as (url, _), aiohttp.ClientSession() as client:
            async with client.post(f"{url}/v1/chat/completions", data=b"{not json") as resp:
                assert resp.status == 400
                assert "not valid JSON" in (await resp.json())["error"]["message"]

    run(scenario())


def test_failure_mid_stream_ends_with_an_error_event() -> None:
    async def dies(request: web.Request, payload: dict) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"text": "a"}\n\n')
        request.transport.close()  # type: ignore[union-attr]  # the worker dies mid-stream
        return response

    async def scenario() -> None:
        worker = StubWorker("dies", dies)
        async with serve_app(worker.app) as url_w:
            async with router_over({"worker": [url_w]}) as (url, _), aiohttp.ClientSession() as client:
                async with client.post(f"{url}/v1/completions", json={"prompt": "x", "stream": True}) as resp:
                    text = await resp.text()
                assert text.startswith('data: {"text": "a"}')
                assert '"upstream_error"' in text and text.endswith("data: [DONE]\n\n")
                assert len(worker.requests) == 1  # never retried once bytes flowed

    run(scenario())


def test_disaggregated_mode_pairs_decode_with_prefill_for_long_prompts() -> None:
    async def scenario() -> None:
        prefill, decode = StubWorker("p"), StubWorker("d")
        async with (
            serve_app(prefill.app) as url_p,
            serve_app(decode.app) as url_d,
            router_over({"prefill": [url_p], "decode": [url_d]}, disaggregation_threshold_chars=10) as (
                url,
                _,
            ),
            aiohttp.ClientSession() as client,
        ):
            async with client.post(f"{url}/v1/completions", json={"prompt": "short"}) as resp:
                assert (await resp.json())["worker"] == "d"
            async with client.post(f"{url}/v1/completions", json={"prompt": "a much longer prompt"}) as resp:
                assert (await resp.json())["worker"] == "d"
            short, long = decode.requests
            assert "kv_transfer_params" not in short
            assert long["kv_transfer_params"]["prefill_url"] == url_p
            assert len(long["kv_transfer_params"]["room"]) == 16
            assert prefill.requests == []  # the decode worker pulls from prefill, the router does not

    run(scenario())
