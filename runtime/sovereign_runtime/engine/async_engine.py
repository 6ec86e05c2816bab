"""``AsyncEngine``: an ``LLMEngine`` on a background thread, serving asyncio callers."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any

from .api import EngineStats, RequestOutput
from .engine import EngineConfig, LLMEngine
from .remote_prefill import RemoteFetch, RemoteFirstToken, RemotePrefill
from .sampling import SamplingParams
from .sequence import Sequence


class AsyncEngine:
    """Runs an ``LLMEngine`` on a background thread; ``generate`` streams ``RequestOutput`` deltas.

    Requests are validated in the caller's thread (errors raise ``InvalidRequest`` at once); adds and aborts
    reach the engine thread through a command queue it drains before each step, so the event loop never
    waits for a model step. Closing or cancelling a ``generate`` iterator aborts its request; the engine
    frees the blocks before its next step.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.remote = RemotePrefill(engine)
        self._commands: deque[tuple[str, Any]] = deque()
        self._wake = threading.Condition()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._stats = engine.stats()
        self._stopped = False
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="sovereign-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(cls, path: str | Path, config: EngineConfig | None = None) -> AsyncEngine:
        return cls(LLMEngine.from_pretrained(path, config))

    # ---- public -------------------------------------------------------------------------------------
    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        await self._compile_grammar(params)
        rid, seq, queue = self._open_stream(prompt_token_ids, params, request_id)
        self._send("add", seq)
        finished = False
        try:
            async for item in self._relay(queue):
                finished = item.finished
                yield item
        finally:
            self._close_stream(rid, finished)

    async def generate_remote(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        fetch: RemoteFetch,
        request_id: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Like ``generate``, but the prompt's KV comes from elsewhere: blocks are reserved for the whole
        prompt, ``fetch`` fills the uncached rows and returns the first token, and the request joins the
        batch as a decode. If the pool has no room, or ``fetch`` fails, the request is prefilled locally;
        closing the iterator at any point aborts it and frees its blocks."""
        await self._compile_grammar(params)
        rid, seq, queue = self._open_stream(prompt_token_ids, params, request_id)
        self._send("reserve", seq)
        finished = False
        try:
            slot = await queue.get()
            if isinstance(slot, BaseException):
                raise slot
            first: RemoteFirstToken | None = None
            if slot is not None:
                try:
                    first = await fetch(slot)
                except Exception:
                    first = None  # the fetcher recorded why; a local prefill still answers
            if first is None:
                self._send("local", rid)
            else:
                self._send("commit", (rid, first))
            async for item in self._relay(queue):
                finished = item.finished
                yield item
        finally:
            self._close_stream(rid, finished)

    async def _compile_grammar(self, params: SamplingParams) -> None:
        """Compile a request's schema off the event loop (a large one can take a while); the
        matcher ``make_sequence`` builds then finds it in xgrammar's cache."""
        grammars = self.engine.runner.grammars
        if params.json_schema is not None and grammars is not None:
            await asyncio.to_thread(grammars.compile, params.json_schema)

    def _open_stream(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None
    ) -> tuple[str, Sequence, asyncio.Queue[Any]]:
        """Validate and register one request's output queue (on the caller's event loop)."""
        if self._stopped:
            raise RuntimeError("engine is shut down")
        rid = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        if rid in self._streams:
            raise ValueError(f"request_id {rid!r} is already in use")
        seq = self.engine.make_sequence(prompt_token_ids, params, rid)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[rid] = (asyncio.get_running_loop(), queue)
        return rid, seq, queue

    @staticmethod
    async def _relay(queue: asyncio.Queue[Any]) -> AsyncIterator[RequestOutput]:
        """The engine thread's outputs for one request, up to and including the finished one; a request the
        engine failed (non-finite logits, an exception its inputs caused) raises ``RequestFailed``."""
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.error is not None:
                raise item.error
            yield item
            if item.finished:
                return

    def _close_stream(self, rid: str, finished: bool) -> None:
        self._streams.pop(rid, None)
        if not finished:  # the caller stopped listening early: free the request's blocks now
            self._send("abort", rid)

    def abort(self, request_id: str) -> None:
        self._send("abort", request_id)

    def stats(self) -> EngineStats:
        """The latest snapshot, taken by the engine thread after each step."""
        return self._stats

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def fail_streams(self, error: BaseException) -> None:
        """Deliver ``error`` to every open request now, without the engine thread: it may be blocked in a
        collective with a dead peer (the replica's group failed). Safe from any thread."""
        for rid in list(self._streams):
            self._deliver(rid, error)

    def shutdown(self) -> None:
        self._stopped = True
        with self._wake:
            self._wake.notify()
        self._thread.join(timeout=30)

    # ---- engine thread ------------------------------------------------------------------------------
    def _send(self, kind: str, arg: Any) -> None:
        with self._wake:
            self._commands.append((kind, arg))
            self._wake.notify()

    def _deliver(self, rid: str, item: Any) -> None:
        stream = self._streams.get(rid)
        if stream is not None:
            loop, queue = stream
            # RuntimeError: the caller's loop is closed; nobody is listening any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(queue.put_nowait, item)

    def _drain_commands(self) -> None:
        while self._commands:
            kind, arg = self._commands.popleft()
            if kind == "add":
                try:
                    self.engine.add_sequence(arg)
                except ValueError as e:  # InvalidRequest, or a request id already in use
                    self._deliver(arg.request_id, e)
            elif kind == "reserve":
                try:
                    slot = self.remote.reserve(arg)
                    if slot is None:  # no room for the whole prompt now: queue it as a local prefill
                        self.engine.add_sequence(arg)
                    self._deliver(arg.request_id, slot)
                except ValueError as e:
                    self._deliver(arg.request_id, e)
            elif kind == "local":
                self.remote.prefill_locally(arg)
            elif kind == "commit":
                rid, first = arg
                out = self.remote.commit(rid, first, time.monotonic())
                if out is not None:
                    self._deliver(rid, out)
            else:
                out = self.engine.abort(arg)
                if out is not None:
                    self._deliver(arg, out)

    def _loop(self) -> None:
        engine = self.engine
        while True:
            with self._wake:
                while not self._commands and not engine.has_unfinished() and not self._stopped:
                    self._wake.wait()
                if self._stopped:
                    break
                self._drain_commands()
            try:
                outputs = engine.step() if engine.has_unfinished() else []
            except Exception as e:  # a model error fails the requests in flight, not the process
                self._fail_all(e)
                continue
            # Snapshot first: a caller that saw an output must not then read older stats.
            self._stats = engine.stats()
            for o in outputs:
                self._deliver(o.request_id, o)
        self._fail_all(RuntimeError("engine is shut down"))

    def _fail_all(self, error: BaseException) -> None:
        failed = self.engine.abort_all()
        self._stats = self.engine.stats()  # before the callers hear of it, as after a step
        for rid in failed:
            self._deliver(rid, error)
