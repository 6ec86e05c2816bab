"""The router against stub workers on loopback: routing, streaming, retries, health, metrics."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import random
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web
from loopback import serve_app
from prometheus_client import generate_latest
from sovereign_runtime.router.app import Router, RouterConfig, create_app
from sovereign_runtime.router.cli import add_router_arguments, validate_router_args
from sovereign_runtime.router.discovery import endpoint_urls
from sovereign_runtime.router.health import BreakerState, CircuitBreaker, FailureKind
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


def test_prefix_tree_eviction_drops_the_oldest_first_and_prunes_emptied_branches() -> None:
    rng = random.Random(7)
    prompts = ["".join(rng.choice("abcdefgh") for _ in range(30)) for _ in range(100)]
    tree = ApproximatePrefixTree(max_chars=1000)
    for i, prompt in enumerate(prompts):  # 3000 characters into a 1000-character budget
        tree.insert(prompt, f"w{i % 3}")
    # Evicted down to 90 % of the budget (a leaf at a time), then filled again.
    assert 900 - 30 <= tree.size_chars <= 1000
    assert tree.match(prompts[-1]).matched_chars == 30
    assert tree.match(prompts[0]).matched_chars < 30
    # A branch whose every leaf went is detached, not kept as an empty node.
    for worker in ("w0", "w1", "w2"):
        tree.remove_worker(worker)
    assert tree.size_chars == 0


def _chat_prompts(rng: random.Random, count: int) -> list[str]:
    systems = [f"system {i}: " + "".join(rng.choice("abcdefgh ") for _ in range(150)) for i in range(8)]
    return [
        rng.choice(systems) + "user: " + "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(5, 80)))
        for _ in range(count)
    ]


def test_prefix_tree_keeps_every_new_prompt_within_budget_and_frees_its_nodes() -> None:
    rng = random.Random(11)
    tree = ApproximatePrefixTree(max_chars=5000)
    for i, prompt in enumerate(_chat_prompts(rng, 3000)):
        worker = f"w{i % 3}"
        tree.insert(prompt, worker)
        assert tree.size_chars <= 5000
        # The newest prompt is the most recently used entry: never the one evicted.
        assert tree.match(prompt) == tree.match(prompt, alive={worker})
        assert tree.match(prompt).matched_chars == len(prompt)
        assert tree.node_count <= tree.size_chars + 1  # every node but the root holds a character
    # Evicted one leaf at a time, not down to a low-water mark.
    assert tree.size_chars > 5000 - 250
    for worker in ("w0", "w1", "w2"):
        tree.remove_worker(worker)
    assert (tree.size_chars, tree.node_count) == (0, 1)
    # Slots are reused: refilling does not grow the tree past its budget's worth of nodes.
    for prompt in _chat_prompts(rng, 500):
        tree.insert(prompt, "w0")
    assert tree.node_count <= tree.size_chars + 1


def test_prefix_tree_eviction_never_walks_the_tree() -> None:
    """An insert over the budget evicts from a heap kept as the tree changes: a walk of every node
    per eviction stopped the router's loop for 250-400 ms at a full 2M-character tree."""
    rng = random.Random(5)
    tree = ApproximatePrefixTree(max_chars=3000)

    def walk() -> list[int]:
        raise AssertionError("eviction walked the whole tree")

    tree._nodes_top_down = walk  # type: ignore[method-assign]
    for i, prompt in enumerate(_chat_prompts(rng, 2000)):
        tree.insert(prompt, f"w{i % 2}")
    assert 3000 - 250 < tree.size_chars <= 3000


def test_prefix_tree_is_invisible_to_the_cyclic_garbage_collector() -> None:
    """A full collection walks every tracked object: with one object per node a full tree made each
    one stop the router's loop for ~100 ms. The tree's nodes are plain strings, ints and dicts of them,
    which CPython does not track."""
    tree = ApproximatePrefixTree()
    prompts = _chat_prompts(random.Random(3), 2000)
    gc.collect()
    before = len(gc.get_objects())
    for i, prompt in enumerate(prompts):
        tree.insert(prompt, f"w{i % 2}")
    gc.collect()
    assert tree.match(prompts[-1]).matched_chars == len(prompts[-1])
    assert len(gc.get_objects()) - before < 50  # with a node object per node: thousands


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
    pool.record_failure(a, FailureKind.CONNECT)
    assert a.routable
    pool.record_failure(a, FailureKind.CONNECT)
    assert not a.routable
    assert [w.url for w in pool.routable("worker")] == ["http://b"]
    assert pool.set_members("worker", {"http://b"}) == ["http://a"]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_half_opens_for_one_trial_and_backs_off() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=2, cooldown_s=5, max_cooldown_s=12, clock=clock)
    breaker.record_failure(FailureKind.CONNECT)
    assert breaker.state is BreakerState.CLOSED and breaker.admits()
    breaker.record_failure(FailureKind.CONNECT)
    assert breaker.state is BreakerState.OPEN and not breaker.admits()
    clock.now = 5
    assert breaker.state is BreakerState.HALF_OPEN and breaker.admits()
    breaker.begin_attempt()
    assert not breaker.admits()  # one trial at a time
    breaker.record_failure(FailureKind.CONNECT)  # the trial failed: open again, twice as long
    clock.now = 14.9
    assert breaker.state is BreakerState.OPEN
    clock.now = 15
    breaker.begin_attempt()
    breaker.record_failure(FailureKind.TIMEOUT)
    clock.now = 15 + 11.9
    assert breaker.state is BreakerState.OPEN  # capped at max_cooldown_s = 12
    clock.now = 27
    breaker.begin_attempt()
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED and breaker.consecutive_failures == 0


def test_a_client_hanging_up_ends_a_half_open_trial_without_a_verdict() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=1, clock=clock)
    breaker.record_failure(FailureKind.CONNECT)
    clock.now = 1
    breaker.begin_attempt()
    breaker.end_attempt()
    assert breaker.state is BreakerState.HALF_OPEN and breaker.admits()


def test_timeouts_alone_never_take_out_the_last_routable_worker() -> None:
    pool = WorkerPool(failure_threshold=2)
    pool.set_members("worker", {"http://a", "http://b"})
    a, b = pool.get("http://a"), pool.get("http://b")
    assert a is not None and b is not None
    for _ in range(2):
        pool.record_failure(a, FailureKind.TIMEOUT)
    assert not a.routable  # b still serves
    for _ in range(5):
        pool.record_failure(b, FailureKind.TIMEOUT)
    assert b.routable  # the last one standing: slow beats "no worker is ready" for everyone
    pool.record_failure(b, FailureKind.CONNECT)
    assert not b.routable  # a refused connection is proof enough


def test_prompt_key_covers_chat_and_completion_shapes() -> None:
    assert prompt_key({"messages": [{"role": "user", "content": "hi"}]}) == "user:hi\n"
    assert (
        prompt_key({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}) == "user:x\n"
    )
    assert prompt_key({"prompt": "abc"}) == "abc"
    assert prompt_key({"prompt": [1, 2, 3]}) == "1,2,3"
    assert prompt_key({"prompt": [[4, 5]]}) == "4,5"
    assert prompt_key({}) == ""
    # Malformed shapes contribute nothing rather than failing in the router (the worker rejects them).
    assert prompt_key({"messages": [{"role": 1, "content": [{"text": 5}, "x"]}, 3]}) == ":\n"
    assert prompt_key({"messages": [{"role": "user", "content": {"a": 1}}]}) == "user:\n"


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
        (("--worker", "http://a", "--failure-threshold", "0"), "--failure-threshold"),
        (("--worker", "http://a", "--breaker-cooldown", "0"), "--breaker-cooldown"),
        (("--worker", "http://a", "--max-body-bytes", "10"), "--max-body-bytes"),
        (("--worker", "http://a", "--shutdown-delay", "-1"), "--shutdown-delay"),
        (("--worker", "http://a", "--drain-timeout", "0"), "--drain-timeout"),
        (("--worker", "http://a", "--wait-for-worker", "-2"), "--wait-for-worker"),
        (("--worker", "http://a", "https://b"), "'https://b' is not an http://HOST[:PORT] URL"),
        (("--prefill", "a:8000", "--decode", "http://b"), "'a:8000' is not an http://HOST[:PORT] URL"),
        (("--worker", "http://a:99999"), "'http://a:99999' is not valid"),
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
        self.ready_delay_s = 0.0
        self.behaviour = behaviour
        self.app = web.Application()
        self.app.router.add_post("/v1/chat/completions", self.chat)
        self.app.router.add_post("/v1/completions", self.chat)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_post("/tokenize", self.chat)
        self.app.router.add_post("/detokenize", self.chat)
        self.app.router.add_get("/health/ready", self.ready)
        self.url = ""

    async def ready(self, request: web.Request) -> web.Response:
        await asyncio.sleep(self.ready_delay_s)
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
                # vLLM's tokenizer endpoints go to a worker as they are.
                for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
                    async with client.post(f"{url}{path}", json=body) as resp:
                        assert resp.status == 200 and (await resp.json())["worker"] in ("a", "b")
                assert {"prompt": "x"} in a.requests + b.requests and {
                    "tokens": [1]
                } in a.requests + b.requests

    run(scenario())


def test_the_router_keeps_no_cookie_a_worker_set() -> None:
    """A worker's Set-Cookie is never sent with later requests (other clients' included): the router's
    client keeps no cookie jar. By name, not IP address: a jar keeps no cookies for IP addresses anyway."""

    async def sets_cookie(request: web.Request, payload: dict) -> web.Response:
        response = web.json_response({"cookie": request.headers.get("Cookie")})
        response.set_cookie("session", "client-1")
        return response

    async def scenario() -> None:
        worker = StubWorker("a", sets_cookie)
        async with serve_app(worker.app) as url_a:
            by_name = url_a.replace("127.0.0.1", "localhost")
            async with router_over({"worker": [by_name]}) as (url, _), aiohttp.ClientSession() as client:
                for _ in range(2):
                    async with client.post(f"{url}/v1/completions", json={"prompt": "x"}) as resp:
                        assert await resp.json() == {"cookie": None}

    run(scenario())


def test_a_whole_answer_cut_off_midway_is_retried_on_another_worker() -> None:
    """A non-streamed answer (Content-Length) is read whole before the client gets a byte: a worker
    that drops the connection halfway through it is retried, and the client sees only the full answer."""

    async def cut_off(request: web.Request, payload: dict) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": "100"})
        await response.prepare(request)
        await response.write(b'{"worker": "cut"')
        assert request.transport is not None
        request.transport.close()
        return response

    async def scenario() -> None:
        cut, whole = StubWorker("cut", cut_off), StubWorker("whole")
        async with serve_app(cut.app) as url_cut, serve_app(whole.app) as url_whole:
            async with (
                router_over({"worker": [url_cut, url_whole]}, policy="round-robin") as (url, router),
                aiohttp.ClientSession() as client,
            ):
                for _ in range(2):  # round-robin: at least one of the two starts on the cutting worker
                    async with client.post(f"{url}/v1/completions", json={"prompt": "x"}) as resp:
                        assert resp.status == 200
                        assert await resp.json() == {"worker": "whole"}
                assert len(cut.requests) >= 1 and len(whole.requests) == 2
                metrics = generate_latest(router.metrics.registry).decode()
                assert f"sovereign_router_retries_total {float(len(cut.requests))}" in metrics

    run(scenario())


def test_retries_on_another_worker_before_any_byte_is_sent() -> None:
    async def drops(request: web.Request, payload: dict) -> web.Response:
        request.transport.close()  # type: ignore[union-attr]  # the worker's process went away
        return web.Response()

    async def scenario() -> None:
        bad, good = StubWorker("bad", drops), StubWorker("good")
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
                # Two of its own failures in a row took the broken worker out of rotation.
                assert not router.pool.get(url_bad).alive  # type: ignore[union-attr]
                async with client.get(f"{url}/metrics") as resp:
                    metrics = await resp.text()
                assert "sovereign_router_retries_total" in metrics

    run(scenario())


def test_a_worker_answer_for_one_bad_request_goes_to_the_client_and_counts_nothing() -> None:
    async def rejects_bad(request: web.Request, payload: dict) -> web.Response:
        if payload.get("bad") == "500":
            return web.json_response({"error": {"message": "top_k overflowed"}}, status=500)
        if payload.get("bad") == "400":
            return web.json_response({"error": {"message": "no"}}, status=400)
        return web.json_response({"worker": "ok"})

    async def scenario() -> None:
        a, b = StubWorker("a", rejects_bad), StubWorker("b", rejects_bad)
        async with serve_app(a.app) as url_a, serve_app(b.app) as url_b:
            async with (
                router_over({"worker": [url_a, url_b]}, policy="round-robin", failure_threshold=2) as (
                    url,
                    router,
                ),
                aiohttp.ClientSession() as client,
            ):
                for bad in ("500", "400") * 4:
                    async with client.post(f"{url}/v1/completions", json={"prompt": "x", "bad": bad}) as resp:
                        assert resp.status == int(bad)
                        assert "message" in (await resp.json())["error"]
                # Never retried (another worker would fail the same way) and never counted.
                assert len(a.requests) + len(b.requests) == 8
                assert all(w.routable and w.breaker.consecutive_failures == 0 for w in router.pool.workers())
                async with client.post(f"{url}/v1/completions", json={"prompt": "x"}) as resp:
                    assert resp.status == 200

    run(scenario())


def test_client_disconnects_never_count_against_the_worker() -> None:
    async def slow_stream(request: web.Request, payload: dict) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(200):
            await response.write(f"data: {i}\n\n".encode())
            await asyncio.sleep(0.01)
        await response.write(b"data: [DONE]\n\n")
        return response

    async def scenario() -> None:
        a, b = StubWorker("a", slow_stream), StubWorker("b", slow_stream)
        async with serve_app(a.app) as url_a, serve_app(b.app) as url_b:
            async with router_over({"worker": [url_a, url_b]}, failure_threshold=2) as (url, router):
                # Eight clients read three chunks each and hang up (the finding: both workers went out).
                for _ in range(8):
                    async with aiohttp.ClientSession() as client:
                        resp = await client.post(
                            f"{url}/v1/completions", json={"prompt": "x", "stream": True}
                        )
                        for _ in range(3):
                            await resp.content.readany()
                        resp.close()
                await asyncio.sleep(0.3)  # let the router notice each hang-up on its next write
                assert all(w.routable and w.breaker.consecutive_failures == 0 for w in router.pool.workers())
                assert sum(w.in_flight for w in router.pool.workers()) == 0
                async with aiohttp.ClientSession() as client:
                    async with client.get(f"{url}/metrics") as resp:
                        metrics = await resp.text()
                assert "sovereign_router_client_disconnects_total 8.0" in metrics

    run(scenario())


def test_a_busy_worker_429_is_retried_elsewhere_and_passed_on_when_all_are_busy() -> None:
    async def busy(request: web.Request, payload: dict) -> web.Response:
        return web.json_response(
            {"error": {"message": "queue full"}}, status=429, headers={"Retry-After": "2"}
        )

    async def scenario() -> None:
        full, free = StubWorker("full", busy), StubWorker("free")
        async with serve_app(full.app) as url_full, serve_app(free.app) as url_free:
            async with (
                router_over({"worker": [url_full, url_free]}, policy="round-robin", failure_threshold=1) as (
                    url,
                    router,
                ),
                aiohttp.ClientSession() as client,
            ):
                for _ in range(3):
                    async with client.post(f"{url}/v1/completions", json={"prompt": "x"}) as resp:
                        assert (await resp.json())["worker"] == "free"
                assert router.pool.get(url_full).routable  # type: ignore[union-attr]  # busy is not broken
                free.behaviour = busy
                async with client.post(f"{url}/v1/completions", json={"prompt": "x"}) as resp:
                    assert resp.status == 429 and resp.headers["Retry-After"] == "2"
                    assert (await resp.json())["error"]["message"] == "queue full"

    run(scenario())


def test_a_broken_worker_comes_back_through_a_half_open_trial() -> None:
    async def drops(request: web.Request, payload: dict) -> web.Response:
        request.transport.close()  # type: ignore[union-attr]
        return web.Response()

    async def scenario() -> None:
        worker = StubWorker("w", drops)
        async with serve_app(worker.app) as url_w:
            async with (
                router_over({"worker": [url_w]}, failure_threshold=2, breaker_cooldown_s=0.3) as (
                    url,
                    router,
                ),
                aiohttp.ClientSession() as client,
            ):
                for _ in range(2):
                    async with client.post(f"{url}/v1/completions", json={"prompt": "x"}) as resp:
                        assert resp.status == 503
                state = router.pool.get(url_w).breaker  # type: ignore[union-attr]
                assert state.state is BreakerState.OPEN
                async with client.post(f"{url}/v1/completions", json={"prompt": "x"}) as resp:
                    assert resp.status == 503  # open: not even tried
                assert len(worker.requests) == 2
                worker.behaviour = None  # recovered
                await asyncio.sleep(0.35)
                assert state.state is BreakerState.HALF_OPEN
                async with client.post(f"{url}/v1/completions", json={"prompt": "x"}) as resp:
                    assert (await resp.json())["worker"] == "w"
                assert state.state is BreakerState.CLOSED

    run(scenario())


def test_a_worker_that_starts_late_serves_everyone_once_its_health_check_answers() -> None:
    async def scenario() -> None:
        with socket.socket() as sock:  # a port nobody listens on yet: connection refused
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        url_w = f"http://127.0.0.1:{port}"
        async with router_over({"worker": [url_w]}, failure_threshold=2) as (url, router):
            for _ in range(3):
                await router.check_all()
            assert router.pool.get(url_w).breaker.state is BreakerState.OPEN  # type: ignore[union-attr]
            worker = StubWorker("late")
            runner = web.AppRunner(worker.app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            try:
                await router.check_all()
                # Closed, not half-open: one long trial request would hold everybody else off.
                async with aiohttp.ClientSession() as client:
                    statuses = await asyncio.gather(
                        *(client.post(f"{url}/v1/completions", json={"prompt": "x"}) for _ in range(4))
                    )
                    assert [r.status for r in statuses] == [200] * 4
                    for r in statuses:
                        r.close()
            finally:
                await runner.cleanup()

    run(scenario())


def test_health_checks_that_time_out_because_the_router_was_late_count_nothing() -> None:
    async def scenario() -> None:
        a, b = StubWorker("a"), StubWorker("b")
        async with serve_app(a.app) as url_a, serve_app(b.app) as url_b:
            async with router_over({"worker": [url_a, url_b]}, failure_threshold=2, health_timeout_s=0.3) as (
                url,
                router,
            ):
                starving = True

                async def starve() -> None:  # a CPU-starved machine: every loop turn costs 200 ms
                    while starving:
                        time.sleep(0.2)
                        await asyncio.sleep(0)

                starver = asyncio.ensure_future(starve())
                for _ in range(3):
                    await router.check_all()
                starving = False
                await starver
                assert all(w.routable for w in router.pool.workers())
                async with aiohttp.ClientSession() as client, client.get(f"{url}/metrics") as resp:
                    metrics = await resp.text()
                assert "sovereign_router_health_checks_inconclusive_total" in metrics

    run(scenario())


def test_a_worker_that_stops_answering_health_checks_leaves_rotation_but_not_the_last_one() -> None:
    async def scenario() -> None:
        a, b = StubWorker("a"), StubWorker("b")
        async with serve_app(a.app) as url_a, serve_app(b.app) as url_b:
            async with router_over({"worker": [url_a, url_b]}, failure_threshold=2, health_timeout_s=0.2) as (
                _,
                router,
            ):
                a.ready_delay_s = b.ready_delay_s = 5
                for _ in range(4):
                    await router.check_all()
                # One went out after two timeouts in a row; the last one stays on timeouts alone.
                assert len(router.pool.routable("worker")) == 1

    run(scenario())


def test_router_only_fields_from_clients_are_dropped() -> None:
    forged = {"prefill_url": "http://169.254.169.254/latest?", "room": "x"}

    async def scenario() -> None:
        unified = StubWorker("u")
        prefill, decode = StubWorker("p"), StubWorker("d")
        async with (
            serve_app(unified.app) as url_u,
            serve_app(prefill.app) as url_p,
            serve_app(decode.app) as url_d,
            router_over({"worker": [url_u]}) as (url_unified, _),
            router_over({"prefill": [url_p], "decode": [url_d]}, disaggregation_threshold_chars=10) as (
                url_pd,
                _,
            ),
            aiohttp.ClientSession() as client,
        ):
            for url, prompt in ((url_unified, "short"), (url_pd, "short"), (url_pd, "a much longer prompt")):
                body = {"prompt": prompt, "kv_transfer_params": forged}
                async with client.post(f"{url}/v1/completions", json=body) as resp:
                    assert resp.status == 200
            assert "kv_transfer_params" not in unified.requests[0]
            short, long = decode.requests
            assert "kv_transfer_params" not in short
            assert long["kv_transfer_params"]["prefill_url"] == url_p
            async with client.get(f"{url_unified}/metrics") as resp:
                assert (
                    'sovereign_router_stripped_fields_total{field="kv_transfer_params"} 1.0'
                    in await resp.text()
                )

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
                # Pretend the checks have not noticed yet.
                router.pool.get(dead).breaker.record_success()  # type: ignore[union-attr]
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


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[" * 100_000, 400, "nested too deeply"),
        (b'{"prompt": "\xff\xfe"}', 400, "not valid JSON"),
        (b'{"prompt": [' + b"9" * 5000 + b"]}", 400, "not valid JSON"),
        (b'["a list"]', 400, "JSON object"),
        (b'{"prompt": "' + b"x" * 500_000 + b'"}', 413, "limit of 400000 bytes"),
    ],
)
def test_malformed_bodies_get_openai_errors(body: bytes, status: int, fragment: str) -> None:
    async def scenario() -> None:
        async with (
            router_over({"worker": []}, max_body_bytes=400_000) as (url, _),
            aiohttp.ClientSession() as client,
        ):
            async with client.post(f"{url}/v1/chat/completions", data=body) as resp:
                assert resp.status == status
                assert fragment in (await resp.json())["error"]["message"]

    run(scenario())


def test_unknown_paths_methods_and_undecodable_headers_get_openai_errors() -> None:
    async def scenario() -> None:
        worker = StubWorker("w")
        async with serve_app(worker.app) as url_w, router_over({"worker": [url_w]}) as (url, _):
            async with aiohttp.ClientSession() as client:
                async with client.get(f"{url}/v1/nope") as resp:
                    assert resp.status == 404 and (await resp.json())["error"]["code"] == 404
                async with client.get(f"{url}/v1/completions") as resp:
                    assert resp.status == 405 and "error" in await resp.json()
            host, port = url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            body = b'{"prompt": "x"}'
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                % (len(body), body)
            )
            raw = await reader.read()
            writer.close()
            head, _, payload = raw.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 400")
            assert json.loads(payload)["error"]["param"] == "Authorization"
            assert worker.requests == []

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


def test_a_request_waits_for_the_worker_that_replaces_a_draining_one() -> None:
    """A one-replica pool in a rolling update: its pod drains (503), the new pod appears at another
    address a moment later. With --wait-for-worker the request is held and answered by the new pod,
    and the router stays Ready meanwhile; with nothing appearing it ends in a 503 that says so."""

    async def scenario() -> None:
        old, new = StubWorker("old"), StubWorker("new")
        async with serve_app(old.app) as url_old, serve_app(new.app) as url_new:
            async with (
                router_over({"worker": [url_old]}, wait_for_worker_s=2.0) as (url, router),
                aiohttp.ClientSession() as client,
            ):
                old.ready_status = 503  # draining; the router has not checked it yet

                async def old_drains(request: web.Request, payload: dict) -> web.Response:
                    return web.json_response({"error": {"message": "draining"}}, status=503)

                old.behaviour = old_drains

                async def replace() -> None:
                    await asyncio.sleep(0.5)
                    router.set_members("worker", set())  # the old pod's endpoint is terminating
                    async with client.get(f"{url}/health/ready") as resp:
                        assert resp.status == 200 and (await resp.json())["holding_up_to_s"] == 2.0
                    await asyncio.sleep(0.3)
                    router.set_members("worker", {url_new})  # the new pod is Ready

                replacing = asyncio.create_task(replace())
                started = time.monotonic()
                async with client.post(f"{url}/v1/completions", json={"prompt": "x"}) as resp:
                    assert resp.status == 200 and (await resp.json())["worker"] == "new"
                await replacing
                assert 0.7 <= time.monotonic() - started < 2
                assert len(old.requests) == 1 and len(new.requests) == 1

                router.set_members("worker", set())
                async with client.post(f"{url}/v1/completions", json={"prompt": "x"}) as resp:
                    assert resp.status == 503
                    assert "waited 2 s" in (await resp.json())["error"]["message"]

    run(scenario())


def test_waiting_is_bounded_and_off_by_default() -> None:
    async def scenario() -> None:
        async with (
            router_over({"worker": []}, wait_for_worker_s=10.0, max_waiting_requests=0) as (url, _),
            aiohttp.ClientSession() as client,
        ):
            started = time.monotonic()
            async with client.post(f"{url}/v1/completions", json={"prompt": "x"}) as resp:
                assert resp.status == 503 and time.monotonic() - started < 2  # no room to wait
        async with router_over({"worker": []}) as (url, _), aiohttp.ClientSession() as client:
            async with client.get(f"{url}/health/ready") as resp:
                assert resp.status == 503  # nothing to route to and no waiting: not ready
            started = time.monotonic()
            async with client.post(f"{url}/v1/completions", json={"prompt": "x"}) as resp:
                assert resp.status == 503 and time.monotonic() - started < 2

    run(scenario())


def test_a_discovering_router_is_not_ready_until_its_first_listing() -> None:
    async def scenario() -> None:
        worker = StubWorker("w")
        async with serve_app(worker.app) as url_w, router_over({}, wait_for_worker_s=5.0) as (url, router):
            router.expect_discovery("worker")
            async with aiohttp.ClientSession() as client:
                async with client.get(f"{url}/health/ready") as resp:
                    assert resp.status == 503 and (await resp.json())["discovering"] == ["worker"]
                router.set_members("worker", {url_w})
                async with client.get(f"{url}/health/ready") as resp:
                    assert resp.status == 200

    run(scenario())


def test_a_stopping_router_leaves_the_service_first_and_finishes_every_stream() -> None:
    """SIGTERM in a rolling update: readiness 503 at once, new requests still served through the
    shutdown delay (endpoints take a moment to forget the pod), in-flight streams run to their end."""

    async def slow_stream(request: web.Request, payload: dict) -> web.StreamResponse:
        if not payload.get("stream"):
            return web.json_response({"worker": "w"})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(8):
            await response.write(f"data: {json.dumps({'n': i})}\n\n".encode())
            await asyncio.sleep(0.15)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def scenario() -> None:
        from sovereign_runtime.router.cli import serve_router

        worker = StubWorker("w", slow_stream)
        async with serve_app(worker.app) as url_w:
            router = Router(RouterConfig(static_members={"worker": [url_w]}, health_interval_s=3600))
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            stop = asyncio.Event()
            serving = asyncio.create_task(
                serve_router(
                    create_app(router), "127.0.0.1", port, shutdown_delay_s=0.5, drain_timeout_s=10,
                    router=router, stop=stop,
                )
            )  # fmt: skip
            url = f"http://127.0.0.1:{port}"
            async with aiohttp.ClientSession() as client:
                for _ in range(100):
                    with contextlib.suppress(aiohttp.ClientError):
                        async with client.get(f"{url}/health/ready") as resp:
                            if resp.status == 200:
                                break
                    await asyncio.sleep(0.05)
                async with client.post(
                    f"{url}/v1/completions", json={"prompt": "x", "stream": True}
                ) as stream:
                    await stream.content.readline()  # the first chunk: the stream is in flight
                    stop.set()  # SIGTERM
                    await asyncio.sleep(0.05)
                    async with client.get(f"{url}/health/ready") as resp:
                        assert resp.status == 503 and (await resp.json())["stopping"] is True
                    async with client.post(f"{url}/v1/completions", json={"prompt": "y"}) as resp:
                        assert resp.status == 200  # still served during the shutdown delay
                    text = await stream.text()
                assert text.count("data: ") == 8 and text.endswith("data: [DONE]\n\n")
                await asyncio.wait_for(serving, timeout=5)
                with pytest.raises(aiohttp.ClientError):
                    async with client.get(f"{url}/health"):
                        pass

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
