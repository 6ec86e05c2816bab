"""Prefill and decode roles of `serve`: the handshake over HTTP, the KV over a `transport`.

Flow for one request the router pairs (decode D, prefill P, room R):

1. D gets the OpenAI request with `kv_transfer_params: {"prefill_url": P, "room": R}`. The engine
   reserves blocks for the whole prompt (reusing D's cached prefix pages, `num_cached` tokens), and D
   expects room R with layout layers x (prompt - num_cached) x kv_dim.
2. D posts `/v1/internal/prefill` to P with the prompt ids, the sampling parameters, R, its ticket
   (how to reach the room) and `num_cached`.
3. P runs the prompt (max one new token). Inside each forward chunk, right after decoder layer i wrote
   its KV, the engine's KV-export hook copies that layer's new rows out of P's paged cache and queues
   one frame, so the transfer overlaps the computation of layers i+1... (and of the next chunk). P then
   sends `done` with the first token (and its logprob) and waits for D's ack; P's blocks are released
   by its engine like any finished request's.
4. D writes each layer's rows into its reserved blocks as they arrive, and on `done` commits the
   request as a running decode whose first token is already emitted.

Anything failing on D's side (prefill unreachable, HTTP error, idle or total timeout, missing rows)
drops the reserved blocks and prefills locally; a failing P aborts its request. Nothing waits
without a deadline, and a guard makes sure no late frame lands in blocks that were given back.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import functools
import hmac
import logging
import re
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import torch
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram

from ..engine.api import RequestOutput, TokenLogprob
from ..engine.async_engine import AsyncEngine
from ..engine.remote_prefill import RemoteFirstToken, RemoteSlot
from ..engine.sampling import SamplingParams
from ..engine.sequence import Sequence
from ..server.app import METRICS
from .kv_rows import read_layer_rows, write_rows
from .nixl_transport import NixlKVReceiver, NixlKVSender
from .transport import KVLayout, KVReceiver, KVSender, KVStream, KVTransferError, TcpKVReceiver, TcpKVSender

log = logging.getLogger("sovereign_runtime.disagg")

ROLES = ("unified", "prefill", "decode")
TRANSPORTS = ("tcp", "rdma")
PREFILL_PATH = "/v1/internal/prefill"
HEALTH_PATH = "/health/kv"
# The deployment's shared secret on internal calls (router -> decode, decode -> prefill): what proves a
# peer is one of the deployment's own pods rather than a client.
INTERNAL_TOKEN_HEADER = "X-Sovereign-Internal-Token"
_ROOM = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_HEALTH_WINDOW_S = 60.0  # a failure newer than the last success within this window is unhealthy

# The `kv_transfer_params` of the request being handled (set per request by the middleware).
TRANSFER_PARAMS: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "kv_transfer_params", default=None
)


@dataclass
class DisaggConfig:
    role: str = "unified"
    transport: str = "tcp"  # tcp | rdma (NIXL)
    kv_host: str = "0.0.0.0"  # where the decode's KV receiver listens (TCP)
    kv_port: int = 8001
    advertise_host: str | None = None  # the address prefill instances dial; default: kv_host
    transfer_timeout_s: float = 30.0  # whole remote prefill, handshake to ack
    idle_timeout_s: float = 10.0  # no frame (heartbeats included) for this long fails a room
    # With a token, kv_transfer_params are honoured only from a peer that sends it (the router), and
    # /v1/internal/prefill answers only callers that send it; without one, both trust the network.
    internal_token: str | None = None
    api_key: str | None = None  # this server's own API key, sent on calls to the prefill instance


def has_internal_token(request: web.Request, token: str | None) -> bool:
    """Whether the request carries the deployment's internal token (always true when none is set)."""
    if token is None:
        return True
    given = request.headers.get(INTERNAL_TOKEN_HEADER, "").encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given, token.encode())


class _Metrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, role: str) -> None:
        labels = {"model_name": model_name, "role": role}
        names = ["model_name", "role"]
        self.bytes = Counter(
            "sovereign:kv_transfer_bytes",
            "KV-cache payload bytes sent or received.",
            names,
            registry=registry,
        ).labels(**labels)
        self.tokens = Counter(
            "sovereign:kv_transfer_tokens",
            "Prompt tokens whose KV was sent or received.",
            names,
            registry=registry,
        ).labels(**labels)
        self.seconds = Histogram(
            "sovereign:kv_transfer_seconds",
            "One remote prefill's KV transfer, handshake to acknowledgement.",
            names,
            registry=registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
        ).labels(**labels)
        self.failures = Counter(
            "sovereign:kv_transfer_failures", "Failed KV transfers.", names, registry=registry
        ).labels(**labels)
        self.fallbacks = Counter(
            "sovereign:kv_transfer_fallbacks",
            "Disaggregated requests the decode instance prefilled itself after a failed transfer.",
            names,
            registry=registry,
        ).labels(**labels)


@dataclass
class _Health:
    ok: int = 0
    failed: int = 0
    fallbacks: int = 0
    bytes: int = 0
    tokens: int = 0
    last_error: str | None = None
    last_error_time: float | None = None
    last_ok_time: float | None = None

    def failure(self, message: str) -> None:
        self.failed += 1
        self.last_error, self.last_error_time = message, time.time()

    def success(self, nbytes: int, tokens: int) -> None:
        self.ok += 1
        self.bytes += nbytes
        self.tokens += tokens
        self.last_ok_time = time.time()

    @property
    def healthy(self) -> bool:
        if self.last_error_time is None:
            return True
        recent = time.time() - self.last_error_time < _HEALTH_WINDOW_S
        return not recent or (self.last_ok_time or 0.0) > self.last_error_time


class _Exporter:
    """The prefill side's KV-export hook for one request (runs on the engine thread, inside the forward
    pass): after decoder layer `layer` wrote a chunk, that layer's new rows are copied and queued, so the
    sender's thread transfers them while the next layers compute."""

    def __init__(
        self,
        stream: KVStream,
        kv_cache: torch.Tensor,
        num_cached: int,
        num_prompt: int,
        on_error: Callable[[], None] = lambda: None,
    ) -> None:
        self.stream, self.kv_cache, self.on_error = stream, kv_cache, on_error
        self.num_cached, self.num_prompt = num_cached, num_prompt
        self.num_layers = int(kv_cache.shape[0])
        self.sent = num_cached  # rows below this position are on their way (or the decode has them)
        self.bytes = 0
        self.error: str | None = None

    def __call__(self, seq: Sequence, layer: int, start: int, end: int) -> None:
        # From `sent`, not `start`: on the first chunk the rows this prefill had cached (past what the
        # decode holds) are in the cache but not recomputed, and the decode needs them too.
        end = min(end, self.num_prompt)
        if end <= self.sent or self.error is not None:
            return
        try:
            rows = read_layer_rows(self.kv_cache, seq.block_table, layer, self.sent, end)
            self.stream.send_layer(layer, self.sent - self.num_cached, rows)
        except Exception as exc:
            self.error = f"{exc.__class__.__name__}: {exc}"
            self.on_error()  # the decode is gone: stop computing the rest of the prompt
            raise
        self.bytes += rows.numel() * rows.element_size()
        if layer == self.num_layers - 1:  # every layer of this chunk is queued
            self.sent = end


class DisaggEngine:
    """The server's engine: requests tagged with `kv_transfer_params` are prefilled remotely."""

    def __init__(self, inner: AsyncEngine, service: DisaggService) -> None:
        self.inner = inner
        self.service = service

    def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        kv = TRANSFER_PARAMS.get()
        if kv is None or not self.service.claim_room(kv["room"]):
            return self.inner.generate(prompt_token_ids, params, request_id)
        prompt = list(prompt_token_ids)

        async def fetch(slot: RemoteSlot) -> RemoteFirstToken | None:
            return await self.service.fetch(slot, kv, prompt, params)

        async def outputs() -> AsyncGenerator[RequestOutput, None]:
            stream = self.inner.generate_remote(prompt, params, fetch, request_id)
            try:
                async for out in stream:
                    yield out
            finally:
                await stream.aclose()
                self.service.release_room(kv["room"])  # also when fetch never ran (no blocks: local)

        return outputs()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class DisaggService:
    """Everything one `serve` process needs for its role: transport, endpoints, metrics, health."""

    def __init__(self, config: DisaggConfig, model_name: str) -> None:
        if config.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {config.role!r}")
        if config.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {config.transport!r}")
        self.config = config
        self.model_name = model_name
        self.engine: AsyncEngine | None = None
        self.receiver: KVReceiver | None = None
        self.sender: KVSender | None = None
        self.health = _Health()
        self.metrics: _Metrics | None = None
        self._session: aiohttp.ClientSession | None = None
        self._rooms: set[str] = set()

    # ---- wiring into the server --------------------------------------------------------------------
    def wrap_runtime(self, runtime: Any) -> Any:
        """The loaded runtime with its engine wrapped (a `LoadedRuntime`)."""
        if self.config.role == "unified":
            return runtime
        self.engine = runtime.engine
        return dataclasses.replace(runtime, engine=DisaggEngine(runtime.engine, self))

    def wrap_loader(self, loader: Callable[[Any], Any]) -> Callable[[Any], Any]:
        return lambda progress: self.wrap_runtime(loader(progress))

    def install(self, app: web.Application) -> None:
        """Routes, middleware, metrics and transport lifecycle; call before the app starts."""
        self.metrics = _Metrics(app[METRICS].registry, self.model_name, self.config.role)
        app.router.add_get(HEALTH_PATH, self.health_handler)
        if self.config.role == "prefill":
            app.router.add_post(PREFILL_PATH, self.prefill_handler)
        if self.config.role == "decode":
            app.middlewares.append(_transfer_params_middleware(self.config.internal_token))
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)

    async def _start(self, app: web.Application) -> None:
        cfg = self.config
        if cfg.role == "decode":
            if cfg.transport == "rdma":
                self.receiver = NixlKVReceiver()
            else:
                self.receiver = TcpKVReceiver(cfg.kv_host, cfg.kv_port, cfg.advertise_host)
            await self.receiver.start()  # type: ignore[attr-defined]
            log.info("KV receiver (%s) listening on %s", cfg.transport, self.address)
        elif cfg.role == "prefill":
            if cfg.transport == "rdma":
                self.sender = NixlKVSender(transfer_timeout_s=cfg.transfer_timeout_s)
            else:
                self.sender = TcpKVSender()
        if cfg.role != "unified":
            self._session = aiohttp.ClientSession()

    async def _stop(self, app: web.Application) -> None:
        if self.receiver is not None:
            await self.receiver.stop()  # type: ignore[attr-defined]
        if self._session is not None:
            await self._session.close()

    @property
    def address(self) -> str | None:
        return getattr(self.receiver, "address", None) or getattr(self.receiver, "name", None)

    def claim_room(self, room: str) -> bool:
        """One request per room (an n>1 completion shares the router's room: the rest run locally)."""
        if self.receiver is None or self.engine is None or room in self._rooms:
            return False
        self._rooms.add(room)
        return True

    def release_room(self, room: str) -> None:
        self._rooms.discard(room)

    # ---- decode side -------------------------------------------------------------------------------
    async def fetch(
        self, slot: RemoteSlot, kv: dict[str, str], prompt: list[int], params: SamplingParams
    ) -> RemoteFirstToken | None:
        """Have the prefill instance fill `slot`; the first token, or None to prefill locally."""
        assert self.receiver is not None and self._session is not None and self.metrics is not None
        room, url = kv["room"], kv["prefill_url"].rstrip("/") + PREFILL_PATH
        cache = slot.kv_cache
        num_layers, num_rows = cache.shape[0], slot.num_prompt - slot.num_cached
        layout = KVLayout(num_layers, num_rows, cache.shape[3], cache.dtype)
        guard = threading.Lock()
        received = [0] * num_layers
        is_open = True

        def on_layer(layer: int, first: int, rows: torch.Tensor) -> None:
            with guard:  # a late frame must never land in blocks the engine took back
                if not is_open:
                    raise KVTransferError(f"room {room} is closed")
                if first < 0 or first + rows.shape[0] > num_rows:
                    raise KVTransferError(f"rows [{first}, {first + rows.shape[0]}) outside [0, {num_rows})")
                # Under tensor parallelism this returns once every rank has the rows queued ahead of any
                # later step; the request is committed (scheduled to decode) only after all of them.
                write_rows(cache, slot.block_table, layer, slot.num_cached + first, rows, slot.write_kv_rows)
                received[layer] += rows.shape[0]

        started = time.perf_counter()
        call: asyncio.Task[dict[str, Any]] | None = None
        try:
            transfer = self.receiver.expect(room, on_layer, layout, self.config.idle_timeout_s)
            # Cancelled or failed after we stopped waiting: mark the outcome as seen.
            transfer.add_done_callback(lambda f: f.cancelled() or f.exception())
            body = {
                "room": room,
                "ticket": self.receiver.ticket(room),
                "prompt_token_ids": prompt,
                "num_cached_tokens": slot.num_cached,
                "sampling": dataclasses.asdict(params),
            }
            call = asyncio.create_task(self._call_prefill(url, body))
            result, answer = await asyncio.wait_for(
                asyncio.gather(transfer, call), timeout=self.config.transfer_timeout_s
            )
            if any(n != num_rows for n in received):
                raise KVTransferError(f"room {room}: got {received} rows per layer, expected {num_rows}")
            done = result.done
            first = RemoteFirstToken(int(done["first_token"]), _logprob(done.get("logprob")))
        except Exception as exc:
            message = f"remote prefill at {url} failed: {exc.__class__.__name__}: {exc or 'timeout'}"
            log.warning("%s; prefilling locally", message)
            self.health.failure(message)
            self.health.fallbacks += 1
            self.metrics.failures.inc()
            self.metrics.fallbacks.inc()
            return None
        finally:
            with guard:
                is_open = False
            self.receiver.cancel(room, "request ended")  # no-op after success
            if call is not None and not call.done():
                call.cancel()
        seconds = time.perf_counter() - started
        self.health.success(result.bytes, num_rows)
        self.metrics.bytes.inc(result.bytes)
        self.metrics.tokens.inc(num_rows)
        self.metrics.seconds.observe(seconds)
        log.debug("room %s: %d tokens, %d B in %.3f s (%s)", room, num_rows, result.bytes, seconds, answer)
        return first

    async def _call_prefill(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        assert self._session is not None
        # The prefill instance authenticates internal calls like any client's (same API key), and
        # takes only its own deployment's peers (the internal token).
        headers = {}
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        if self.config.internal_token:
            headers[INTERNAL_TOKEN_HEADER] = self.config.internal_token
        async with self._session.post(url, json=body, headers=headers) as resp:
            answer = await resp.json(content_type=None)
            if resp.status != 200:
                raise KVTransferError(f"prefill answered {resp.status}: {answer}")
            return dict(answer)

    # ---- prefill side ------------------------------------------------------------------------------
    async def prefill_handler(self, request: web.Request) -> web.Response:
        if not has_internal_token(request, self.config.internal_token):
            return _error(403, f"{PREFILL_PATH} is internal: only this deployment's decode pods may call it")
        try:
            body = await request.json()
            prompt = [int(t) for t in body["prompt_token_ids"]]
            room, ticket = str(body["room"]), dict(body["ticket"])
            num_cached = int(body.get("num_cached_tokens", 0))
            # The decode sends the request's own parameters; the prefill samples its first token only.
            params = SamplingParams(**dict(body.get("sampling") or {})).for_first_token()
            if not prompt or not 0 <= num_cached < len(prompt) or not _ROOM.match(room):
                raise ValueError("need a non-empty prompt, 0 <= num_cached_tokens < its length, a room id")
        except (ValueError, KeyError, TypeError) as exc:
            return _error(400, f"bad prefill request: {exc}")
        if self.engine is None or self.sender is None:
            return _error(503, "the prefill instance is not ready")
        assert self.metrics is not None
        started = time.perf_counter()
        try:
            stream = await asyncio.to_thread(self.sender.open, ticket)
        except (KVTransferError, OSError, KeyError) as exc:
            self._prefill_failed(f"room {room}: cannot open the KV stream: {exc}")
            return _error(502, f"cannot open the KV stream to the decode instance: {exc}")
        rid = f"prefill-{room}"
        cache = self.engine.engine.transfer_kv_cache
        exporter = _Exporter(
            stream, cache, num_cached, len(prompt), functools.partial(self.engine.abort, rid)
        )
        hooks = self.engine.engine.kv_export_hooks
        hooks[rid] = exporter
        try:
            last = None
            async for out in self.engine.generate(prompt, params, rid):
                last = out
            if exporter.error is not None or last is None or not last.new_token_ids:
                raise KVTransferError(exporter.error or "the prefill produced no token")
            if exporter.sent != len(prompt):
                raise KVTransferError(f"exported rows up to {exporter.sent} of {len(prompt)}")
            lp = last.new_logprobs[0] if last.new_logprobs else None
            done = {
                "first_token": last.new_token_ids[0],
                "logprob": None
                if lp is None
                else {"token_id": lp.token_id, "logprob": lp.logprob, "top": lp.top},
                "prompt_tokens": len(prompt),
                "cached_tokens": last.cached_tokens,
            }
            await asyncio.to_thread(stream.finish, done, self.config.transfer_timeout_s)
        except asyncio.CancelledError:
            # The decode hung up: tell its receiver (if still there) and let the writer thread end.
            threading.Thread(target=stream.fail, args=("prefill cancelled",), daemon=True).start()
            self._prefill_failed(f"room {room}: the decode instance went away")
            raise
        except Exception as exc:
            await asyncio.to_thread(stream.fail, str(exc))
            self._prefill_failed(f"room {room}: {exc.__class__.__name__}: {exc}")
            return _error(502, f"prefill of room {room} failed: {exc}")
        finally:
            hooks.pop(rid, None)
        sent_tokens = len(prompt) - num_cached
        self.health.success(exporter.bytes, sent_tokens)
        self.metrics.bytes.inc(exporter.bytes)
        self.metrics.tokens.inc(sent_tokens)
        self.metrics.seconds.observe(time.perf_counter() - started)
        return web.json_response({**done, "room": room, "sent_tokens": sent_tokens, "bytes": exporter.bytes})

    def _prefill_failed(self, message: str) -> None:
        log.warning("%s", message)
        self.health.failure(message)
        if self.metrics is not None:
            self.metrics.failures.inc()

    # ---- health ------------------------------------------------------------------------------------
    def health_body(self) -> dict[str, Any]:
        h = self.health
        listening = self.config.role != "decode" or self.receiver is not None
        return {
            "role": self.config.role,
            "transport": self.config.transport if self.config.role != "unified" else None,
            "address": self.address,
            "transfers_ok": h.ok,
            "transfers_failed": h.failed,
            "fallbacks": h.fallbacks,
            "bytes": h.bytes,
            "tokens": h.tokens,
            "last_error": h.last_error,
            "last_error_time": h.last_error_time,
            "healthy": listening and h.healthy,
        }

    async def health_handler(self, request: web.Request) -> web.Response:
        body = self.health_body()
        return web.json_response(body, status=200 if body["healthy"] else 503)


def _logprob(entry: Any) -> TokenLogprob | None:
    if not entry:
        return None
    top = [(int(t), float(v)) for t, v in entry.get("top") or []]
    return TokenLogprob(int(entry["token_id"]), float(entry["logprob"]), top)


def _error(status: int, message: str) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "upstream_error"
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


def _transfer_params_middleware(internal_token: str | None) -> Any:
    """Lift `kv_transfer_params` out of an OpenAI request body into `TRANSFER_PARAMS`, from the router
    only: without the internal token (when one is set) a client's value is ignored."""

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        params: dict[str, str] | None = None
        is_generation = request.method == "POST" and request.path in (
            "/v1/chat/completions",
            "/v1/completions",
        )
        if is_generation and has_internal_token(request, internal_token):
            with contextlib.suppress(ValueError, UnicodeDecodeError, RecursionError):
                body = await request.json()  # cached: the handler reads the same bytes again
                raw = body.get("kv_transfer_params") if isinstance(body, dict) else None
                if isinstance(raw, dict):
                    url, room = raw.get("prefill_url"), raw.get("room")
                    url_ok = isinstance(url, str) and url.startswith(("http://", "https://"))
                    if url_ok and isinstance(room, str) and _ROOM.match(room):
                        params = {"prefill_url": url, "room": room}
        token = TRANSFER_PARAMS.set(params)
        try:
            return await handler(request)
        finally:
            TRANSFER_PARAMS.reset(token)

    return middleware
