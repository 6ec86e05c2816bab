"""The router's HTTP shell: OpenAI-compatible front door, health checks, metrics.

Requests are proxied byte for byte (SSE included) to a worker the policy picks. A worker that fails
(refused or dropped connection, timeout), answers 503 (starting, draining) or 429 (its queue is full)
before any byte reached the client is retried on another worker; once bytes flowed, the client gets an
error event instead of a silent truncation. Whole answers of known length (not streams) are read before
the client gets any byte, and then sent in one write. Only a worker's own failures take it out of rotation (see
`health`): any other answer, a 500 caused by one bad request included, goes to the client as it is.
Fields only the router may set (`kv_transfer_params`) are dropped from what clients send. In prefill/decode mode the router pairs a
decode worker with a prefill worker and tells the decode worker where to pull the KV cache from
(`kv_transfer_params`); short prompts with no cached prefix skip disaggregation.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..read_deadlines import TIMEOUT_KINDS, DeadlineGuard, ReadDeadlines
from .health import FailureKind, LoopLagMonitor, timer_lateness
from .policy import (
    CacheAwarePolicy,
    LeastLoadPolicy,
    Role,
    RoutingPolicy,
    Worker,
    WorkerPool,
    make_policy,
    prompt_key,
)
from .upstream import UpstreamError, UpstreamPool, UpstreamResponse

log = logging.getLogger(__name__)

# Headers that describe one hop, or that only the router may set, and are never forwarded from clients.
INTERNAL_TOKEN_HEADER = "X-Sovereign-Internal-Token"
_HOP_HEADERS = {
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    # Workers' answers go back with their Content-Type only, never a Content-Encoding: ask for none.
    "accept-encoding",
    INTERNAL_TOKEN_HEADER.lower(),
}
# Request fields only the router may set: a client's value would let it pick the URL a decode worker
# POSTs the prompt and its KV ticket to.
ROUTER_ONLY_FIELDS = ("kv_transfer_params",)
# Errors writing to the client: it hung up. Never the worker's fault.
_CLIENT_GONE = (ConnectionError, RuntimeError)
MAX_BODY_BYTES = web.AppKey("max_body_bytes", int)
# Answers with a Content-Length up to this are read whole and sent in one write; longer ones, and
# streams (chunked, no length), are passed on as they arrive.
BUFFERED_ANSWER_BYTES = 1024 * 1024
DEADLINE_GUARD = web.AppKey("deadline_guard", DeadlineGuard)


@dataclass
class RouterConfig:
    policy: str = "cache-aware"
    health_interval_s: float = 5.0
    health_timeout_s: float = 2.0
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 3600.0
    max_attempts: int = 3
    # The worker's own failures in a row (connect errors, timeouts, failed health checks) that open its
    # circuit breaker; it half-opens after the cooldown, which doubles up to the maximum while trials fail.
    failure_threshold: int = 3
    breaker_cooldown_s: float = 5.0
    breaker_max_cooldown_s: float = 60.0
    # A health check timeout while the router's own loop ran this late (fraction of the timeout) is not
    # counted: the router was too busy to read the answer, the worker may be fine.
    health_lag_tolerance: float = 0.25
    max_body_bytes: int = 64 * 1024 * 1024
    # The deployment's shared secret: sent to decode workers so they honour the router's
    # kv_transfer_params (and no client's).
    internal_token: str | None = None
    # In prefill/decode mode, prompts shorter than this (in characters, the router sees no tokens)
    # with no cached prefix are prefilled on the decode worker: a transfer would cost more than it saves.
    disaggregation_threshold_chars: int = 512
    static_members: dict[Role, list[str]] = field(default_factory=dict)
    # When no worker can take a request (a one-replica pool restarting, every worker draining), hold it
    # up to this long for one to appear instead of answering 503 at once; 0: answer at once. At most
    # `max_waiting_requests` wait; more get 503.
    wait_for_worker_s: float = 0.0
    max_waiting_requests: int = 256
    # How long a client may take to send a request's headers and body, and to stay idle between requests.
    read_deadlines: ReadDeadlines = field(default_factory=ReadDeadlines)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "sovereign_router_requests",
            "Requests answered, by worker and status",
            ["worker", "code"],
            registry=self.registry,
        )
        self.retries = Counter(
            "sovereign_router_retries", "Requests retried on another worker", registry=self.registry
        )
        self.upstream_errors = Counter(
            "sovereign_router_upstream_errors",
            "Failed attempts against a worker",
            ["worker"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "sovereign_router_time_to_headers_seconds",
            "Arrival to the worker's response headers",
            registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.in_flight = Gauge(
            "sovereign_router_in_flight", "In-flight requests per worker", ["worker"], registry=self.registry
        )
        self.workers = Gauge(
            "sovereign_router_workers", "Workers by role and state", ["role", "state"], registry=self.registry
        )
        self.disaggregated = Counter(
            "sovereign_router_disaggregated_requests",
            "Requests sent through a prefill/decode pair",
            registry=self.registry,
        )
        self.client_disconnects = Counter(
            "sovereign_router_client_disconnects",
            "Clients that hung up before their response ended (never a worker failure)",
            registry=self.registry,
        )
        self.inconclusive_checks = Counter(
            "sovereign_router_health_checks_inconclusive",
            "Health check timeouts not counted because the router itself ran late",
            ["worker"],
            registry=self.registry,
        )
        self.stripped_fields = Counter(
            "sovereign_router_stripped_fields",
            "Router-only fields removed from client requests",
            ["field"],
            registry=self.registry,
        )
        self.read_timeouts = Counter(
            "sovereign_router_request_read_timeouts",
            "Requests or connections closed because the client sent headers or body too slowly",
            ["kind"],
            registry=self.registry,
        )
        for kind in TIMEOUT_KINDS:
            self.read_timeouts.labels(kind)
        # Labelled children looked up once: `labels()` takes a lock and builds a key on every call.
        self._in_flight_of: dict[str, Gauge] = {}
        self._requests_of: dict[tuple[str, int], Counter] = {}

    def set_in_flight(self, worker: Worker) -> None:
        gauge = self._in_flight_of.get(worker.url)
        if gauge is None:
            gauge = self._in_flight_of[worker.url] = self.in_flight.labels(worker.url)
        gauge.set(worker.in_flight)

    def count_request(self, worker_url: str, status: int) -> None:
        counter = self._requests_of.get((worker_url, status))
        if counter is None:
            counter = self._requests_of[worker_url, status] = self.requests.labels(worker_url, str(status))
        counter.inc()

    def refresh_workers(self, pool: WorkerPool) -> None:
        self.workers.clear()
        for worker in pool.workers():
            state = "ready" if worker.routable else ("alive" if worker.alive else "down")
            self.workers.labels(worker.role, state).inc()


def openai_error(
    status: int, message: str, err_type: str = "invalid_request_error", param: str | None = None
) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": err_type, "param": param, "code": status}}, status=status
    )


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.pool = WorkerPool(
            failure_threshold=config.failure_threshold,
            cooldown_s=config.breaker_cooldown_s,
            max_cooldown_s=config.breaker_max_cooldown_s,
        )
        self.policies: dict[Role, RoutingPolicy] = {
            "worker": make_policy(config.policy),
            "decode": make_policy(config.policy),
            # Prefill workers keep no state the router could exploit after the hand-off: spread load.
            "prefill": LeastLoadPolicy(),
        }
        self.metrics = RouterMetrics()
        self.lag = LoopLagMonitor()
        self._upstream: UpstreamPool | None = None
        self._tasks: list[asyncio.Task] = []
        # Set on SIGTERM: readiness answers 503 so the Service stops sending, requests are still served.
        self.stopping = False
        # Roles whose members come from discovery and have not been listed yet: not ready until they are.
        self._unsynced: set[Role] = set()
        self.waiting = 0
        for role, urls in config.static_members.items():
            self.set_members(role, set(urls))

    # ---- membership -------------------------------------------------------------------------------
    def expect_discovery(self, role: Role) -> None:
        """Members of `role` come from a watch: the router is not ready before its first listing."""
        self._unsynced.add(role)

    def set_members(self, role: Role, urls: set[str]) -> None:
        self._unsynced.discard(role)
        for gone in self.pool.set_members(role, {u.rstrip("/") for u in urls}):
            self.policies[role].forget(gone)
            if self._upstream is not None:
                self._upstream.forget(gone)
        self.metrics.refresh_workers(self.pool)

    @property
    def disaggregated(self) -> bool:
        return self.pool.has_members("prefill") and self.pool.has_members("decode")

    # ---- lifecycle --------------------------------------------------------------------------------
    async def start(self, app: web.Application) -> None:
        self._upstream = UpstreamPool(self.config.connect_timeout_s, self.config.request_timeout_s)
        self._tasks.append(asyncio.create_task(self.lag.run()))
        self._tasks.append(asyncio.create_task(self._health_loop()))

    async def stop(self, app: web.Application) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._upstream is not None:
            await self._upstream.close()

    def add_background(self, coro) -> None:  # type: ignore[no-untyped-def]
        self._tasks.append(asyncio.create_task(coro))

    # ---- health -----------------------------------------------------------------------------------
    async def check_worker(self, worker: Worker) -> None:
        assert self._upstream is not None
        loop = asyncio.get_running_loop()
        timeout_s = self.config.health_timeout_s
        started = loop.time()
        try:
            async with self._upstream.request(
                "GET", worker.url, "/health/ready", timeout_s=timeout_s
            ) as resp:
                await resp.read()
                # 503 means starting or draining: alive, but no new work.
                worker.ready = resp.status == 200
                self.pool.record_success(worker)
        except TimeoutError:
            now = loop.time()
            own_lateness = max(timer_lateness(started, now, timeout_s), self.lag.lag_since(started, now))
            if own_lateness > self.config.health_lag_tolerance * timeout_s:
                # The router, not the worker, was slow: this check proves nothing either way.
                self.metrics.inconclusive_checks.labels(worker.url).inc()
                log.info(
                    "health check of %s timed out while the router ran %.2fs late", worker.url, own_lateness
                )
                return
            self.pool.record_failure(worker, FailureKind.TIMEOUT)
        except UpstreamError:
            worker.ready = False
            self.pool.record_failure(worker, FailureKind.CONNECT)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check_worker(w) for w in self.pool.workers()))
        self.metrics.refresh_workers(self.pool)

    async def _health_loop(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.config.health_interval_s)

    # ---- handlers ---------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        routable = [w for w in self.pool.workers() if w.routable]
        return web.json_response(
            {"status": "ok", "workers": len(self.pool.workers()), "routable": len(routable)}
        )

    def in_flight(self) -> int:
        return sum(w.in_flight for w in self.pool.workers())

    async def ready(self, request: web.Request) -> web.Response:
        """200 while the router takes requests usefully: it knows its workers (discovery listed them)
        and one can serve, or it holds requests for one (`wait_for_worker_s`)."""
        if self.stopping:
            return web.json_response({"ready": False, "stopping": True}, status=503)
        if self._unsynced:
            return web.json_response({"ready": False, "discovering": sorted(self._unsynced)}, status=503)
        roles: list[Role] = ["prefill", "decode"] if self.disaggregated else ["worker"]
        # A disaggregated router can still serve with no prefill worker (decode prefills locally).
        needed: list[Role] = ["decode"] if self.disaggregated else ["worker"]
        serving = all(self.pool.routable(r) for r in needed)
        body: dict[str, object] = {r: len(self.pool.routable(r)) for r in roles}
        if not serving and self.config.wait_for_worker_s > 0:
            body["holding_up_to_s"] = self.config.wait_for_worker_s
        ok = serving or self.config.wait_for_worker_s > 0
        return web.json_response({"ready": ok, **body}, status=200 if ok else 503)

    async def _candidates(self, tried: list[Worker], deadline: float) -> tuple[Role, list[Worker]]:
        """The role to route to and its routable workers not tried yet; with none, wait for one until
        `deadline` (loop time), checking as discovery and health checks change the pool. A worker that
        left the pool and came back (a restarted pod at the same address) counts as new."""
        loop = asyncio.get_running_loop()
        waiting = False
        try:
            while True:
                role: Role = "decode" if self.disaggregated else "worker"
                exclude = {w.url for w in tried if self.pool.get(w.url) is w}
                candidates = self.pool.routable(role, exclude=exclude)
                if candidates or loop.time() >= deadline:
                    return role, candidates
                if not waiting:
                    if self.waiting >= self.config.max_waiting_requests:
                        return role, []
                    waiting = True
                    self.waiting += 1
                await asyncio.sleep(min(0.1, max(0.0, deadline - loop.time())))
        finally:
            if waiting:
                self.waiting -= 1

    async def metrics_handler(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def models(self, request: web.Request) -> web.StreamResponse:
        return await self._forward(request, "/v1/models", b"", None, "GET")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy_generation(request, "/v1/completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy_generation(request, "/v1/chat/completions")

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        return await self._forward(request, "/tokenize", await request.read(), None, "POST")

    async def detokenize(self, request: web.Request) -> web.StreamResponse:
        return await self._forward(request, "/detokenize", await request.read(), None, "POST")

    async def _proxy_generation(self, request: web.Request, path: str) -> web.StreamResponse:
        body = await request.read()
        payload, problem = parse_json_object(body)
        if payload is None:
            return openai_error(400, problem)
        stripped = [name for name in ROUTER_ONLY_FIELDS if name in payload]
        if stripped:
            for name in stripped:
                del payload[name]
                self.metrics.stripped_fields.labels(name).inc()
            body = json.dumps(payload).encode()
        return await self._forward(request, path, body, payload, "POST")

    async def _forward(
        self, request: web.Request, path: str, body: bytes, payload: dict | None, method: str
    ) -> web.StreamResponse:
        assert self._upstream is not None
        started = time.perf_counter()
        key = prompt_key(payload) if payload else ""
        headers, bad_header = forwardable_headers(request)
        if bad_header is not None:
            return openai_error(400, f"header {bad_header!r} is not valid UTF-8", param=bad_header)
        tried: list[Worker] = []
        last_error = "no worker is ready"
        busy: tuple[int, dict[str, str], bytes] | None = None  # the last 429, answered if all are busy
        deadline = asyncio.get_running_loop().time() + self.config.wait_for_worker_s
        for attempt in range(self.config.max_attempts):
            # A busy (429) pool answers at once: waiting would only queue behind its own queue.
            role, candidates = await self._candidates(tried, deadline if busy is None else 0.0)
            if not candidates:
                if self.config.wait_for_worker_s > 0 and busy is None:
                    last_error += f" (waited {self.config.wait_for_worker_s:g} s for one)"
                break
            if attempt:
                self.metrics.retries.inc()
            worker = self.policies[role].choose(candidates, key)
            tried.append(worker)
            send_body, send_headers = body, headers
            if payload is not None and role == "decode":
                send_body = self._with_transfer_params(payload, key, worker)
                if self.config.internal_token:
                    send_headers = {**headers, INTERNAL_TOKEN_HEADER: self.config.internal_token}
            worker.in_flight += 1
            worker.breaker.begin_attempt()
            self.metrics.set_in_flight(worker)
            response: web.StreamResponse | None = None
            try:
                async with self._upstream.request(
                    method, worker.url, path, send_body, send_headers
                ) as upstream:
                    if upstream.status in (429, 503):
                        # Busy (429), starting or draining (503): alive, but try another worker before
                        # anything was sent.
                        last_error = f"worker {worker.url} answered {upstream.status}"
                        self.pool.record_success(worker)
                        if upstream.status == 503:
                            worker.ready = False
                        else:
                            busy = (
                                429,
                                _passed_headers(upstream, ("Retry-After", "Content-Type")),
                                await upstream.read(),
                            )
                        continue
                    # Any other answer, a 500 included, is the request's own: the worker works.
                    self.pool.record_success(worker)
                    self.metrics.latency.observe(time.perf_counter() - started)
                    passed = _passed_headers(upstream, ("Content-Type", "Cache-Control"))
                    length = upstream.content_length
                    if length is not None and length <= BUFFERED_ANSWER_BYTES:
                        # A whole answer of known size (not a stream): read it, then send headers and
                        # body in one write. A worker failing meanwhile is retried: nothing was sent.
                        answer = await upstream.read()
                        if upstream.status < 400 and payload is not None:
                            self.policies[role].record(worker, key)
                        self.metrics.count_request(worker.url, upstream.status)
                        return web.Response(status=upstream.status, body=answer, headers=passed)
                    response = web.StreamResponse(status=upstream.status)
                    response.headers.update(passed)
                    try:
                        await response.prepare(request)
                    except _CLIENT_GONE:
                        self.metrics.client_disconnects.inc()
                        return response
                    async for chunk in upstream.iter_chunks():
                        try:
                            await response.write(chunk)
                        except _CLIENT_GONE:
                            # Leaving the block closes the upstream connection: the worker stops generating.
                            self.metrics.client_disconnects.inc()
                            return response
                    with contextlib.suppress(*_CLIENT_GONE):
                        await response.write_eof()
                    if upstream.status < 400 and payload is not None:
                        self.policies[role].record(worker, key)
                    self.metrics.count_request(worker.url, upstream.status)
                    return response
            except (TimeoutError, UpstreamError) as exc:
                last_error = f"worker {worker.url} failed: {exc.__class__.__name__}: {exc}"
                self.metrics.upstream_errors.labels(worker.url).inc()
                kind = FailureKind.TIMEOUT if isinstance(exc, TimeoutError) else FailureKind.CONNECT
                self.pool.record_failure(worker, kind)
                if response is not None:
                    # Bytes already reached the client: retrying would duplicate tokens. End the stream
                    # with an error event the OpenAI clients surface.
                    await self._fail_stream(response, last_error)
                    return response
            finally:
                worker.in_flight -= 1
                worker.breaker.end_attempt()
                self.metrics.set_in_flight(worker)
        if busy is not None:
            status, busy_headers, busy_body = busy
            self.metrics.requests.labels("none", str(status)).inc()
            return web.Response(status=status, headers=busy_headers, body=busy_body)
        self.metrics.requests.labels("none", "503").inc()
        return openai_error(503, f"no worker could serve the request: {last_error}", "service_unavailable")

    def _with_transfer_params(self, payload: dict, key: str, decode: Worker) -> bytes:
        """Pair the decode worker with a prefill worker, unless local prefill is the better deal."""
        prefill_candidates = self.pool.routable("prefill")
        policy = self.policies["decode"]
        cached = 0
        if isinstance(policy, CacheAwarePolicy):
            cached = policy.tree.match(key, alive={decode.url}).matched_chars
        uncached = len(key) - cached
        if not prefill_candidates or uncached < self.config.disaggregation_threshold_chars:
            return json.dumps(payload).encode()
        prefill = self.policies["prefill"].choose(prefill_candidates, key)
        self.metrics.disaggregated.inc()
        enriched = dict(payload)
        enriched["kv_transfer_params"] = {"prefill_url": prefill.url, "room": secrets.token_hex(8)}
        return json.dumps(enriched).encode()

    async def _fail_stream(self, response: web.StreamResponse, message: str) -> None:
        event = {"error": {"message": message, "type": "upstream_error", "param": None, "code": 502}}
        with contextlib.suppress(*_CLIENT_GONE):
            await response.write(f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode())
            await response.write_eof()


def parse_json_object(body: bytes) -> tuple[dict | None, str]:
    """The request body as a JSON object, or None and a message saying what is wrong with it."""
    try:
        payload = json.loads(body)
    except RecursionError:
        return None, "request body is nested too deeply"
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, over-long integers, bad bytes
        return None, f"request body is not valid JSON: {exc}"
    if not isinstance(payload, dict):
        return None, "request body must be a JSON object"
    return payload, ""


def forwardable_headers(request: web.Request) -> tuple[dict[str, str], str | None]:
    """The end-to-end headers to pass on, or the name of one that cannot be (non-UTF-8 bytes)."""
    headers: dict[str, str] = {}
    for name, value in request.headers.items():
        if name.lower() in _HOP_HEADERS:
            continue
        try:
            value.encode("utf-8")  # aiohttp keeps undecodable bytes as surrogate escapes
        except UnicodeEncodeError:
            return {}, name
        headers[name] = value
    return headers, None


def _passed_headers(upstream: UpstreamResponse, names: tuple[str, ...]) -> dict[str, str]:
    """The named headers of a worker's answer, under their usual spelling."""
    found = upstream.headers
    return {name: found[name.lower()] for name in names if name.lower() in found}


@web.middleware
async def openai_errors(request: web.Request, handler) -> web.StreamResponse:  # type: ignore[no-untyped-def]
    """Every error the router itself gives is an OpenAI-style JSON body, never aiohttp's plain text."""
    try:
        return await handler(request)
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[MAX_BODY_BYTES]
        return openai_error(413, f"request body is larger than the router's limit of {limit} bytes")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "invalid_request_error" if exc.status < 500 else "internal_error"
        return openai_error(exc.status, f"{request.method} {request.path}: {exc.reason}", kind)
    except Exception:
        log.exception("router: unexpected error handling %s %s", request.method, request.path)
        return openai_error(500, "internal error in the router", "internal_error")


def create_app(router: Router) -> web.Application:
    guard = DeadlineGuard(
        router.config.read_deadlines, on_timeout=lambda kind: router.metrics.read_timeouts.labels(kind).inc()
    )
    # Outside the deadline middleware, errors (a body over the size limit) become OpenAI errors.
    app = web.Application(
        middlewares=[openai_errors, guard.middleware()], client_max_size=router.config.max_body_bytes
    )
    app[MAX_BODY_BYTES] = router.config.max_body_bytes
    app[DEADLINE_GUARD] = guard
    app.router.add_get("/health", router.health)
    app.router.add_get("/health/ready", router.ready)
    app.router.add_get("/metrics", router.metrics_handler)
    app.router.add_get("/v1/models", router.models)
    app.router.add_post("/v1/completions", router.completions)
    app.router.add_post("/v1/chat/completions", router.chat_completions)
    app.router.add_post("/tokenize", router.tokenize)
    app.router.add_post("/detokenize", router.detokenize)
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    return app
