"""The aiohttp application: OpenAI routes, health, drain and metrics over one ``ServerState``."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AsyncExitStack, aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from ..engine.api import EngineStats
from ..engine.sampling import SamplingDefaults, SamplingParams
from ..read_deadlines import DeadlineGuard, ReadDeadlines
from ..tokenizer import THINK_START, ChatTemplateError, ReasoningParser
from .edge import PARSE_INLINE_BYTES, check_prompt_size, parse_body, text_bytes
from .generation import Step, collect, merged, run_request
from .metrics import ServerMetrics
from .output_health import OutputHealthMonitor
from .protocol import (
    APIError,
    ChatRequest,
    SamplingRequest,
    choice_params,
    parse_chat_request,
    parse_completion_request,
    parse_detokenize_request,
    parse_tokenize_request,
    resolve_max_tokens,
    sampling_params,
)
from .responses import (
    SSE_DONE,
    Envelope,
    chat_delta_choice,
    chat_logprobs,
    chat_message_choice,
    completion_choice,
    sse,
    usage,
)
from .state import LoadedRuntime, Loader, ServerState
from .tools import ToolChoiceOutput, detect_format

log = logging.getLogger("sovereign_runtime.server")

STATE = web.AppKey("state", ServerState)
CONFIG = web.AppKey("config", "ServerConfig")
METRICS = web.AppKey("metrics", ServerMetrics)
LOADER = web.AppKey("loader", object)
DEADLINE_GUARD = web.AppKey("deadline_guard", DeadlineGuard)
KEYED_PATHS = frozenset({"/drain", "/tokenize", "/detokenize"})  # beside /v1/*: need the API key
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy default for /v1/completions


@dataclass
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    drain_timeout_s: float = 30.0
    warmup: bool = True
    model_root: str | None = None
    # Larger bodies get 413 before they are read in full.
    max_body_bytes: int = 8 * 1024 * 1024
    # Requests admitted but not yet running in the engine; past this a new one gets 429 + Retry-After
    # (the router tries another worker), instead of waiting behind all of them.
    max_waiting_requests: int = 256
    # The output self-test (when the loader provides one): rerun every this many seconds; 0: startup only.
    self_test_interval_s: float = 300.0
    # Default repetition window for requests that do not set repetition_window (0: off).
    repetition_window: int = 0
    # What requests that leave temperature, top_p, top_k, min_p or repetition_penalty out sample
    # with (`serve --generation-config`: the model's generation_config.json, or OpenAI's defaults).
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    # How long a client may take to send a request's headers and body, and to stay idle between requests.
    read_deadlines: ReadDeadlines = field(default_factory=ReadDeadlines)
    # Longest a generation request may run, from arrival to its last token; 0: no limit. A request's
    # own request_timeout may ask for less, never more.
    request_timeout_s: float = 0.0
    # Test-only (`--debug-hold-compiling-s`): hold startup in phase `compiling` this long, as a slow
    # kernel compilation would, so startup probes and the operator's phase reports can be exercised.
    debug_hold_compiling_s: float = 0.0
    # Test-only (`--debug-hold-compiling-cached-s`): the hold is a compilation the JIT cache keeps; a
    # start that finds the mark of a completed hold in `debug_hold_cache_dir` holds this long instead.
    debug_hold_cached_s: float | None = None
    debug_hold_cache_dir: str | None = None


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status, dumps=lambda o: json.dumps(o, ensure_ascii=False))


class QueueFull(APIError):
    """429: the server's waiting queue is full; the client (or the router) should try again elsewhere."""

    RETRY_AFTER_S = 1

    def __init__(self, message: str) -> None:
        super().__init__(message, status=429, code="queue_full", type="rate_limit_exceeded")


def _error_response(err: APIError) -> web.Response:
    response = _json(err.body(), status=err.status)
    if isinstance(err, QueueFull):
        response.headers["Retry-After"] = str(QueueFull.RETRY_AFTER_S)
    return response


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as err:
        return _error_response(err)
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[CONFIG].max_body_bytes
        return _error_response(
            APIError(
                f"the request body is larger than this server's limit of {limit} bytes (--max-body-bytes)",
                status=413,
                code="request_too_large",
            )
        )
    except web.HTTPException as exc:
        if not request.path.startswith("/v1/") or exc.status < 400:
            raise
        kind = "not_found" if exc.status == 404 else "invalid_request_error"
        return _error_response(
            APIError(f"{request.method} {request.path}: {exc.reason}", status=exc.status, type=kind)
        )
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return _error_response(APIError("internal server error", status=500, type="internal_error"))


def _auth_middleware(api_key: str) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        # Probes and scrapes stay open; the API (tokenizing too: it costs CPU) and the drain switch need
        # the key.
        if request.path.startswith("/v1/") or request.path in KEYED_PATHS:
            # Undecodable header bytes arrive as surrogate escapes: compare them as the bytes they were.
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, expected):
                raise APIError(
                    "invalid or missing API key: send 'Authorization: Bearer <key>'",
                    status=401,
                    code="invalid_api_key",
                )
        return await handler(request)

    return _auth


def create_app(
    config: ServerConfig,
    *,
    loader: Loader | None = None,
    runtime: LoadedRuntime | None = None,
) -> web.Application:
    """Build the app. Give either a ``loader`` (run later by ``start_loading``) or a ready ``runtime``."""
    if (loader is None) == (runtime is None):
        raise ValueError("give exactly one of loader or runtime")
    # Outside the deadline middleware, errors (a body over the size limit) become OpenAI errors.
    guard = DeadlineGuard(
        config.read_deadlines, on_timeout=lambda kind: app[METRICS].read_timeouts.labels(kind).inc()
    )
    middlewares = [_errors, guard.middleware()]
    if config.api_key:
        middlewares.append(_auth_middleware(config.api_key))
    app = web.Application(middlewares=middlewares, client_max_size=config.max_body_bytes)
    state = ServerState(drain_timeout_s=config.drain_timeout_s)
    app[STATE] = state
    app[CONFIG] = config
    app[DEADLINE_GUARD] = guard
    app[METRICS] = ServerMetrics(
        config.served_model_name,
        stats=lambda: state.runtime.engine.stats() if state.runtime else None,
        phase=lambda: state.phase,
        self_test=state.self_test_health,
        startup=state.startup_timing,
    )
    app[LOADER] = loader
    if runtime is not None:
        state.runtime = runtime
        state.report("ready", 1.0, "")
    api = _Api(app)
    app.router.add_get("/health", api.health)
    app.router.add_get("/health/ready", api.ready)
    app.router.add_get("/health/startup", api.startup)
    app.router.add_post("/drain", api.drain)
    app.router.add_get("/metrics", api.metrics)
    app.router.add_get("/v1/models", api.models)
    app.router.add_post("/v1/chat/completions", api.chat)
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/tokenize", api.tokenize)
    app.router.add_post("/detokenize", api.detokenize)
    app.on_cleanup.append(_close_runtime)
    return app


async def _close_runtime(app: web.Application) -> None:
    for task in (app[STATE].startup_task, app[STATE].self_test_task):
        if task is not None and not task.done():
            task.cancel()
    rt = app[STATE].runtime
    if rt is not None and rt.close is not None:
        result = rt.close()
        if asyncio.iscoroutine(result):
            await result


def speculation_report(card: dict[str, Any], stats: EngineStats) -> dict[str, Any]:
    """``/health/startup``'s view of speculative decoding (the operator reports it per pool): what
    ``/v1/models`` says, plus the measured acceptance since the process started."""
    report = dict(card)
    if card.get("enabled"):
        report.update(
            drafting=stats.spec_decode_drafting,
            verify_steps_total=stats.spec_decode_num_drafts_total,
            draft_tokens_total=stats.spec_decode_num_draft_tokens_total,
            accepted_tokens_total=stats.spec_decode_num_accepted_tokens_total,
            acceptance_rate=round(stats.spec_decode_acceptance_rate, 4),
            mean_accept_length=round(stats.spec_decode_mean_accept_length, 4),
        )
    return report


def start_loading(app: web.Application) -> asyncio.Task[None]:
    """Run the loader in a thread, then warm up; call after the server is listening."""
    task = asyncio.get_running_loop().create_task(_startup(app))
    app[STATE].startup_task = task
    return task


async def _startup(app: web.Application) -> None:
    state, config, loader = app[STATE], app[CONFIG], app[LOADER]
    if loader is None:
        return
    try:
        state.report("loading_weights", 0.0, "starting")
        rt: LoadedRuntime = await asyncio.to_thread(loader, state.report)
        if rt.on_loop_start is not None:
            result = rt.on_loop_start()
            if asyncio.iscoroutine(result):
                await result
        state.runtime = rt
        if config.debug_hold_compiling_s > 0:
            await _hold_compiling(state, config)
        if config.warmup:
            await _warm_up(state, rt)
        if rt.self_test is not None:
            # Ready only once this process answers correctly; then again every interval, in the background.
            state.report("self_test", 0.0, "output self-test")
            monitor = OutputHealthMonitor(
                state, rt.self_test, rt.saturated or (lambda: False), config.self_test_interval_s
            )
            await monitor.run_once()
            state.self_test_task = asyncio.get_running_loop().create_task(monitor.periodic())
        state.report("ready", 1.0, "")
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.exception("startup failed")
        state.error = f"{type(exc).__name__}: {exc}"
        state.report("failed", state.progress, state.error)
        state.stop_requested.set()


HOLD_DETAIL = "held by --debug-hold-compiling-s (test only)"


# What a completed hold leaves in the JIT cache directory (--debug-hold-compiling-cached-s).
HOLD_CACHE_MARK = "sovereign-debug-hold.json"


def jit_cache_dir(environ: Mapping[str, str]) -> str:
    """Where Triton keeps compiled kernels: $TRITON_CACHE_DIR (the operator points it at the pod's JIT
    cache volume), else Triton's own default."""
    return environ.get("TRITON_CACHE_DIR") or str(Path.home() / ".triton" / "cache")


async def _hold_compiling(state: ServerState, config: ServerConfig) -> None:
    """Stay in phase `compiling`, progress rising with the time held (test-only hook): the configured
    time, or the cached time when the JIT cache holds the mark of an earlier completed hold."""
    seconds, mark, warm = config.debug_hold_compiling_s, None, False
    if config.debug_hold_cached_s is not None and config.debug_hold_cache_dir:
        mark = Path(config.debug_hold_cache_dir) / HOLD_CACHE_MARK
        warm = mark.exists()
        seconds = config.debug_hold_cached_s if warm else seconds
    log.warning(
        "startup held in phase compiling for %g s (--debug-hold-compiling-s%s, tests only)",
        seconds,
        f"; the JIT cache {mark.parent} is {'warm' if warm else 'cold'}" if mark is not None else "",
    )
    tick_s = min(1.0, max(0.05, seconds / 20))
    started = time.monotonic()
    while (elapsed := time.monotonic() - started) < seconds:
        state.report("compiling", elapsed / seconds, HOLD_DETAIL, quiet=elapsed > 0)
        await asyncio.sleep(min(tick_s, seconds - elapsed))
    state.report("compiling", 1.0, HOLD_DETAIL)
    if mark is not None and not warm:
        # Only a hold that completed is "compiled": a start cut short leaves the cache as cold as it was.
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.write_text(json.dumps({"held_s": seconds}))


async def _warm_up(state: ServerState, rt: LoadedRuntime) -> None:
    """Run real requests so kernels compile and caches fill before /health/ready says yes."""
    token = rt.tokenizer.bos_token_id or 0
    for phase, batch in (("compiling", 1), ("warming_up", 2)):
        state.report(phase, 0.0, f"{batch} warm-up request(s)")

        async def one(i: int, batch: int = batch, phase: str = phase) -> None:
            params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
            async with aclosing(
                rt.engine.generate([token] * (4 + i), params, request_id=f"warmup-{phase}-{i}")
            ) as g:
                async for _ in g:
                    pass

        await asyncio.gather(*(one(i) for i in range(batch)))
        state.report(phase, 1.0, "done")


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class _Api:
    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.state = app[STATE]
        self.config = app[CONFIG]
        self.server_metrics = app[METRICS]

    # ---- health, drain, metrics -------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return _json({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        if self.state.draining:
            return _json({"status": "draining", "in_flight": self.state.in_flight}, status=503)
        failure = self.state.output_failure
        if self.state.started and failure is not None:
            check = (self.state.self_test or {}).get("failing_check")
            return _json(
                {"status": "output_unhealthy", "failing_check": check, "reason": failure}, status=503
            )
        if not self.state.ready:
            return _json({"status": "starting", **self.state.snapshot()}, status=503)
        rt = self.state.runtime
        group = rt.group_problem() if rt is not None and rt.group_problem is not None else None
        if group is not None:  # ready only while every rank of the replica is
            return _json({"status": "group_unhealthy", "reason": group}, status=503)
        return _json({"status": "ready"})

    async def startup(self, request: web.Request) -> web.Response:
        snap = self.state.snapshot()
        rt = self.state.runtime
        if rt is not None and rt.speculative is not None:
            snap["speculative_decoding"] = speculation_report(rt.speculative, rt.engine.stats())
        return _json(snap, status=200 if snap["phase"] == "ready" else 503)

    async def drain(self, request: web.Request) -> web.Response:
        self.state.begin_drain("POST /drain")
        return _json({"status": "draining", "in_flight": self.state.in_flight}, status=202)

    async def metrics(self, request: web.Request) -> web.Response:
        body = self.server_metrics.render()
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def models(self, request: web.Request) -> web.Response:
        card: dict[str, Any] = {
            "id": self.config.served_model_name,
            "object": "model",
            "created": int(self.state.started_at),
            "owned_by": "sovereign",
            "root": self.config.model_root or self.config.served_model_name,
        }
        if self.state.runtime is not None:
            card["max_model_len"] = self.state.runtime.max_model_len
            if self.state.runtime.speculative is not None:
                card["speculative_decoding"] = self.state.runtime.speculative
        return _json({"object": "list", "data": [card]})

    # ---- shared request plumbing -------------------------------------------------------------------

    def _runtime(self) -> LoadedRuntime:
        if self.state.draining:
            raise APIError(
                "the server is draining and accepts no new requests", status=503, type="service_unavailable"
            )
        rt = self.state.runtime
        failure = self.state.output_failure
        if self.state.started and failure is not None:
            raise APIError(
                f"this server's output self-test is failing ({failure}); it takes no requests until a"
                " self-test passes",
                status=503,
                type="service_unavailable",
            )
        if rt is None or not self.state.ready:
            raise APIError(
                f"the model is not ready yet (phase {self.state.phase})",
                status=503,
                type="service_unavailable",
            )
        return rt

    async def _body(self, request: web.Request) -> Any:
        raw = await request.read()
        if len(raw) > PARSE_INLINE_BYTES:  # keep the event loop answering while a big body parses
            return await asyncio.to_thread(parse_body, raw)
        return parse_body(raw)

    def _admit(self, rt: LoadedRuntime) -> None:
        """429 with Retry-After when the queue of admitted requests not yet running is full."""
        stats = rt.engine.stats()
        running = stats.num_requests_running if stats is not None else 0
        waiting = max(0, self.state.in_flight - running)
        if waiting >= self.config.max_waiting_requests:
            self.server_metrics.rejected.labels(self.config.served_model_name, "queue_full").inc()
            raise QueueFull(
                f"{waiting} requests are already waiting (--max-waiting-requests"
                f" {self.config.max_waiting_requests}); retry shortly or on another replica"
            )

    def _timeout_s(self, sampling: SamplingRequest) -> float | None:
        """The request's deadline in seconds: the shorter of its own and the server's, None if neither."""
        limits = [t for t in (sampling.request_timeout, self.config.request_timeout_s) if t]
        return min(limits) if limits else None

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.served_model_name:
            raise APIError(
                f"the model '{model}' does not exist; this server serves '{self.config.served_model_name}'",
                status=404,
                param="model",
                code="model_not_found",
            )

    # ---- /v1/chat/completions ----------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        rt = self._runtime()
        self._admit(rt)
        req = parse_chat_request(await self._body(request))
        self._check_model(req.model)
        tool_output, keep_ids = self._tool_output(rt, req)
        prompt_text, prompt_ids = await self._render_chat(rt, req)
        max_tokens = resolve_max_tokens(req.sampling, len(prompt_ids), rt.max_model_len, None)
        params = self._sampling_params(rt, req.sampling, max_tokens)
        # A template that opens the reasoning trace for the model; not under a schema, which allows no
        # trace (response_format, a forced tool call): all of that output is the answer.
        started_thinking = params.json_schema is None and prompt_text.rstrip().endswith(THINK_START)
        rid = _new_id("chatcmpl")
        choices = choice_params(params, req.sampling.n)
        streams = [
            run_request(
                rt.engine,
                rt.tokenizer,
                self.server_metrics,
                prompt_ids,
                choice,
                req.sampling.stop,
                rid if len(choices) == 1 else f"{rid}-{j}",
                req.sampling.param_names,
                self._timeout_s(req.sampling),
                keep_ids,
            )
            for j, choice in enumerate(choices)
        ]
        outputs = [tool_output] + [tool_output.fresh() for _ in choices[1:]]
        self.state.request_started()
        try:
            async with AsyncExitStack() as stack:
                for stream in streams:
                    await stack.enter_async_context(aclosing(stream))
                if req.stream:
                    return await self._chat_stream(
                        request, rt, req.include_usage, streams, rid, started_thinking, outputs
                    )
                return await self._chat_full(rt, streams, rid, started_thinking, outputs)
        finally:
            self.state.request_finished()

    def _sampling_params(
        self, rt: LoadedRuntime, sampling: SamplingRequest, max_tokens: int
    ) -> SamplingParams:
        """The engine's parameters for one prompt under this server's defaults."""
        return sampling_params(
            sampling,
            max_tokens,
            rt.tokenizer.vocab_size,
            self.config.repetition_window,
            self.config.sampling_defaults,
        )

    async def _render_chat(self, rt: LoadedRuntime, req: ChatRequest) -> tuple[str, list[int]]:
        """The conversation through the chat template and the tokenizer: its text and token ids."""
        contents = [m.get("content") for m in req.messages]
        size = text_bytes([c for c in contents if isinstance(c, str)])
        check_prompt_size(size, rt.max_model_len, rt.tokenizer.max_token_bytes, "messages")
        try:
            # Template and tokenizer run on a thread: a long conversation must not stall the loop.
            return await asyncio.to_thread(
                rt.tokenizer.encode_chat,
                req.messages,
                req.add_generation_prompt,
                req.tools.tools if req.tools is not None else None,
                req.template_kwargs,
            )
        except ChatTemplateError as exc:
            raise APIError(str(exc), param="messages", code="invalid_value") from None

    def _tool_output(self, rt: LoadedRuntime, req: ChatRequest) -> tuple[ToolChoiceOutput, frozenset[int]]:
        """How the request's ``tool_choice`` reads the output, and the marker tokens to keep in its text.
        A forced call (``required``, a named function) is already under its schema (protocol.py);
        ``auto`` needs the model's tool-call markers. Refused (400) where the model could not do what was
        asked."""
        tokenizer = rt.tokenizer
        if any("tool_calls" in m for m in req.messages) and not tokenizer.template_renders_tool_calls:
            raise APIError(
                "this model's chat template does not write an assistant turn's 'tool_calls', so the"
                " conversation cannot be rendered faithfully; serve it with --chat-template set to a"
                " template that does",
                param="messages",
                code="unsupported_value",
            )
        tools = req.tools
        if tools is None or tools.choice == "none":
            return ToolChoiceOutput("none"), frozenset()
        if not tokenizer.template_renders_tools:
            raise APIError(
                "this model's chat template does not write 'tools' into the prompt (DeepSeek-V3's own"
                " template does not), so the model would not see them; serve it with --chat-template set"
                " to a template that renders 'tools'",
                param="tools",
                code="unsupported_value",
            )
        if tools.choice == "auto":
            detected = detect_format(tokenizer.token_to_id)
            if detected is None:
                raise APIError(
                    "this model's vocabulary has none of the tool-call markers this server reads"
                    " (DeepSeek's <｜tool▁calls▁begin｜> ...), so its calls could not be told from text;"
                    " 'tool_choice': 'required' or a named function still work",
                    param="tool_choice",
                    code="unsupported_value",
                )
            fmt, marker_ids = detected
            return ToolChoiceOutput("auto", fmt), marker_ids
        return ToolChoiceOutput(tools.choice, function=tools.function), frozenset()

    async def _chat_full(
        self,
        rt: LoadedRuntime,
        streams: list[AsyncIterator[Step]],
        rid: str,
        started_thinking: bool,
        outputs: list[ToolChoiceOutput],
    ) -> web.Response:
        results = await asyncio.gather(*(collect(s) for s in streams))
        choices = []
        for index, (outcome, tools) in enumerate(zip(results, outputs, strict=True)):
            reasoning, text = ReasoningParser.split(outcome.text, started_thinking)
            content, _ = tools.feed(text)
            rest, _, finish = tools.finish(outcome.last.finish_reason or "stop")
            content += rest
            calls = [c.body() for c in tools.calls]
            logprobs = chat_logprobs(rt.tokenizer, outcome.logprobs)
            # A turn that only calls tools has null content, as OpenAI's.
            message_content = None if calls and not content.strip() else content
            choices.append(chat_message_choice(message_content, reasoning, logprobs, finish, calls, index))
        envelope = self._envelope(rid, "chat.completion")
        return _json(envelope.body(choices, usage=usage((r.last for r in results), len(results))))

    async def _chat_stream(
        self,
        request: web.Request,
        rt: LoadedRuntime,
        include_usage: bool,
        streams: list[AsyncIterator[Step]],
        rid: str,
        started_thinking: bool,
        outputs: list[ToolChoiceOutput],
    ) -> web.StreamResponse:
        resp = await self._open_stream(request)
        envelope = self._envelope(rid, "chat.completion.chunk")
        parsers = [ReasoningParser(started_thinking) for _ in streams]
        no_usage_yet = {"usage": None} if include_usage else {}

        def chunk(
            index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None
        ) -> bytes:
            return sse(envelope.body([chat_delta_choice(delta, finish, logprobs, index)], **no_usage_yet))

        for index in range(len(streams)):
            await resp.write(chunk(index, {"role": "assistant", "content": ""}))
        finals: dict[int, Step] = {}
        try:
            async with aclosing(merged(streams)) as events:
                async for index, step in events:
                    finals[index] = step
                    parser, tools = parsers[index], outputs[index]
                    reasoning, text = parser.feed(step.text)
                    finish = step.finish_reason
                    if finish is not None:
                        r2, c2 = parser.flush()
                        reasoning, text = reasoning + r2, text + c2
                    content, calls = tools.feed(text)
                    if finish is not None:
                        rest, more, finish = tools.finish(finish)
                        content, calls = content + rest, calls + more
                    logprobs = chat_logprobs(rt.tokenizer, step.logprobs)
                    if reasoning:
                        await resp.write(chunk(index, {"reasoning_content": reasoning}))
                    if content or (logprobs and not calls):
                        await resp.write(chunk(index, {"content": content}, logprobs=logprobs))
                        logprobs = None
                    if calls:
                        await resp.write(chunk(index, {"tool_calls": calls}, logprobs=logprobs))
                    if finish is not None:
                        await resp.write(chunk(index, {}, finish=finish))
        except Exception as exc:
            await self._stream_error(resp, exc)
            return resp
        if include_usage and finals:
            ordered = [finals[i] for i in sorted(finals)]
            await resp.write(sse(envelope.body([], usage=usage(ordered, len(ordered)))))
        await resp.write(SSE_DONE)
        await resp.write_eof()
        return resp

    async def _stream_error(self, resp: web.StreamResponse, exc: Exception) -> None:
        # Headers are already sent: report the failure in-band, then end the stream cleanly.
        if isinstance(exc, ConnectionResetError):
            raise exc
        log.exception("request failed while streaming")
        err = (
            exc
            if isinstance(exc, APIError)
            else APIError("internal server error", status=500, type="internal_error")
        )
        await resp.write(sse(err.body()))
        await resp.write(SSE_DONE)
        await resp.write_eof()

    async def _open_stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        await resp.prepare(request)
        return resp

    def _envelope(self, rid: str, kind: str) -> Envelope:
        return Envelope(rid, kind, int(time.time()), self.config.served_model_name)

    # ---- /tokenize, /detokenize (vLLM's) -------------------------------------------------------------

    async def tokenize(self, request: web.Request) -> web.Response:
        rt = self._runtime()
        req = parse_tokenize_request(await self._body(request))
        self._check_model(req.model)
        if req.chat is not None:
            _, ids = await self._render_chat(rt, req.chat)
        else:
            assert req.prompt is not None
            check_prompt_size(
                text_bytes([req.prompt]), rt.max_model_len, rt.tokenizer.max_token_bytes, "prompt"
            )
            ids = await asyncio.to_thread(rt.tokenizer.encode, req.prompt, req.add_special_tokens)
        return _json({"count": len(ids), "max_model_len": rt.max_model_len, "tokens": ids})

    async def detokenize(self, request: web.Request) -> web.Response:
        rt = self._runtime()
        model, tokens = parse_detokenize_request(await self._body(request), rt.tokenizer.vocab_size)
        self._check_model(model)
        return _json({"prompt": rt.tokenizer.decode(tokens)})

    # ---- /v1/completions ---------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        rt = self._runtime()
        self._admit(rt)
        req = parse_completion_request(await self._body(request), rt.tokenizer.vocab_size)
        self._check_model(req.model)
        jobs = []
        for prompt in req.prompts:
            if isinstance(prompt, str):
                check_prompt_size(
                    text_bytes([prompt]), rt.max_model_len, rt.tokenizer.max_token_bytes, "prompt"
                )
                ids = await asyncio.to_thread(rt.tokenizer.encode, prompt)
            else:
                ids = prompt
            if not ids:
                raise APIError("'prompt' must not be empty", param="prompt", code="invalid_value")
            max_tokens = resolve_max_tokens(
                req.sampling, len(ids), rt.max_model_len, COMPLETION_DEFAULT_MAX_TOKENS
            )
            params = self._sampling_params(rt, req.sampling, max_tokens)
            # A prompt's n choices are consecutive: choice index = prompt index x n + j, as OpenAI's.
            jobs += [(ids, choice) for choice in choice_params(params, req.sampling.n)]
        rid = _new_id("cmpl")
        self.state.request_started()
        try:
            streams = [
                run_request(
                    rt.engine,
                    rt.tokenizer,
                    self.server_metrics,
                    ids,
                    params,
                    req.sampling.stop,
                    f"{rid}-{i}",
                    req.sampling.param_names,
                    self._timeout_s(req.sampling),
                )
                for i, (ids, params) in enumerate(jobs)
            ]
            try:
                prompt_ids = [ids for ids, _ in jobs] if req.return_token_ids else None
                if req.stream:
                    return await self._completion_stream(
                        request, rt, req.include_usage, streams, rid, prompt_ids, req.sampling.n
                    )
                return await self._completion_full(rt, streams, rid, prompt_ids, req.sampling.n)
            finally:
                for s in streams:
                    await s.aclose()
        finally:
            self.state.request_finished()

    async def _completion_full(
        self,
        rt: LoadedRuntime,
        streams: list[AsyncIterator[Step]],
        rid: str,
        prompt_ids: list[list[int]] | None,
        n: int,
    ) -> web.Response:
        results = await asyncio.gather(*(collect(s) for s in streams))
        choices = [
            completion_choice(rt.tokenizer, i, r.text, r.logprobs, r.last.finish_reason)
            for i, r in enumerate(results)
        ]
        if prompt_ids is not None:
            for choice, ids, r in zip(choices, prompt_ids, results, strict=True):
                choice.update(prompt_token_ids=ids, token_ids=r.token_ids)
        envelope = self._envelope(rid, "text_completion")
        return _json(envelope.body(choices, usage=usage((r.last for r in results), n)))

    async def _completion_stream(
        self,
        request: web.Request,
        rt: LoadedRuntime,
        include_usage: bool,
        streams: list[AsyncIterator[Step]],
        rid: str,
        prompt_ids: list[list[int]] | None,
        n: int,
    ) -> web.StreamResponse:
        resp = await self._open_stream(request)
        envelope = self._envelope(rid, "text_completion")
        no_usage_yet = {"usage": None} if include_usage else {}
        finals: dict[int, Step] = {}
        prompt_ids_sent: set[int] = set()
        try:
            async with aclosing(merged(streams)) as events:
                async for i, step in events:
                    finals[i] = step
                    empty = not step.text and step.finish_reason is None and not step.logprobs
                    if empty and (prompt_ids is None or not step.token_ids):
                        continue
                    choice = completion_choice(rt.tokenizer, i, step.text, step.logprobs, step.finish_reason)
                    if prompt_ids is not None:
                        # As vLLM streams them: the prompt's ids in a choice's first chunk, each chunk its new ids.
                        choice["token_ids"] = step.token_ids
                        if i not in prompt_ids_sent:
                            prompt_ids_sent.add(i)
                            choice["prompt_token_ids"] = prompt_ids[i]
                    await resp.write(sse(envelope.body([choice], **no_usage_yet)))
        except Exception as exc:
            await self._stream_error(resp, exc)
            return resp
        if include_usage:
            ordered = [finals[i] for i in sorted(finals)]
            await resp.write(sse(envelope.body([], usage=usage(ordered, n))))
        await resp.write(SSE_DONE)
        await resp.write_eof()
        return resp
