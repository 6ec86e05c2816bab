"""``LLMEngine`` (synchronous steps) and ``AsyncEngine`` (a background thread serving asyncio callers).

Timestamps are ``time.monotonic()`` seconds: subtract them, never compare them with wall-clock time.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .block_manager import KVLayout, plan_num_blocks
from .model_runner import ModelRunner, PagedModel
from .sampler import make_generator
from .sampling import SamplingParams
from .scheduler import ScheduledBatch, Scheduler, SchedulerConfig, SchedulerStats
from .sequence import Sequence


@dataclass
class EngineConfig:
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    # KV capacity (see plan_num_blocks): explicit block count, or GiB, or a fraction of free memory.
    num_kv_blocks: int | None = None
    kv_cache_gib: float | None = None
    kv_memory_fraction: float | None = None
    device: str = "cpu"
    dtype: torch.dtype | None = None  # default: the model's parameter dtype


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the params.logprobs most likely (token_id, logprob), best first


@dataclass
class RequestOutput:
    """What one request gained in one engine step (a streaming delta), plus running totals and times."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None  # one per new token when params.logprobs is set
    finished: bool
    finish_reason: str | None  # "stop" (EOS or stop token), "length", "abort"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    arrival_time: float = 0.0  # monotonic seconds, when the engine accepted the request
    first_token_time: float | None = None  # when the first output token was produced
    time: float = 0.0  # when this output was produced (ITL = difference between consecutive ones)


@dataclass
class EngineStats(SchedulerStats):
    prefix_cache_hit_rate: float = 0.0
    prompt_tokens_total: int = 0  # prompt tokens run through the model (cache hits excluded)
    generation_tokens_total: int = 0
    num_blocks: int = 0
    block_size: int = 0


# Prefill-side KV export of one request: ``hook(seq, layer, start, end)`` (see ``LLMEngine.kv_export_hooks``).
KVExportHook = Callable[[Sequence, int, int, int], None]


class _LayerExport:
    """One step's per-layer export: the model calls it after each decoder layer (``after_layer``).

    Built only for batches holding an exported sequence. A hook that raises is dropped from the engine's
    hooks and from the rest of this step: a broken transfer fails that request's transfer, never the batch.
    """

    def __init__(
        self,
        hooks: dict[str, KVExportHook],
        targets: list[tuple[Sequence, KVExportHook, int, int]],
        layers: int,
    ) -> None:
        self.hooks, self.targets, self.layers = hooks, targets, layers
        self.next_layer = 0

    @classmethod
    def for_batch(cls, engine: LLMEngine, batch: ScheduledBatch) -> _LayerExport | None:
        hooks = engine.kv_export_hooks
        targets = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            hook = hooks.get(seq.request_id)
            if hook is not None:
                # Positions this step writes; read before ``update`` advances num_computed_tokens.
                targets.append((seq, hook, seq.num_computed_tokens, seq.num_computed_tokens + n))
        # Only the cache's layers are exported: an MTP layer the engine does not cache never reports.
        return cls(hooks, targets, int(engine.runner.kv_cache.shape[0])) if targets else None

    def __call__(self, layer: int) -> None:
        if layer >= self.layers:
            return
        for target in list(self.targets):
            seq, hook, start, end = target
            try:
                hook(seq, layer, start, end)
            except Exception:
                self.targets.remove(target)
                self.hooks.pop(seq.request_id, None)
        self.next_layer = max(self.next_layer, layer + 1)

    def finish(self) -> None:
        """Export the layers the model did not report (a model that ignores ``after_layer``)."""
        for layer in range(self.next_layer, self.layers):
            self(layer)


class LLMEngine:
    """Synchronous engine: ``add_request``, then ``step()`` until ``has_unfinished()`` is False."""

    def __init__(
        self,
        model: PagedModel,
        *,
        num_layers: int,
        kv_cache_dim: int,
        max_position_embeddings: int,
        vocab_size: int,
        eos_token_ids: set[int] | None = None,
        config: EngineConfig | None = None,
    ) -> None:
        self.config = cfg = config or EngineConfig()
        self.vocab_size = vocab_size
        self.device = torch.device(cfg.device)
        dtype = cfg.dtype or _activation_dtype(model)
        max_model_len = cfg.max_model_len or max_position_embeddings
        layout = KVLayout(num_layers, cfg.block_size, kv_cache_dim, dtype)
        # More blocks than max_num_seqs full contexts (twice, for the prefix cache) is wasted host RAM.
        useful = 2 * cfg.max_num_seqs * -(-max_model_len // cfg.block_size)
        num_blocks = plan_num_blocks(
            layout,
            self.device,
            num_kv_blocks=cfg.num_kv_blocks,
            kv_cache_gib=cfg.kv_cache_gib,
            memory_fraction=cfg.kv_memory_fraction,
            max_useful_blocks=useful,
        )
        self.layout = layout
        # A request must fit the pool on its own (else it would preempt itself forever): cap the context.
        max_model_len = min(max_model_len, num_blocks * cfg.block_size)
        self.scheduler = Scheduler(
            SchedulerConfig(
                block_size=cfg.block_size,
                max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                max_model_len=max_model_len,
                enable_prefix_caching=cfg.enable_prefix_caching,
            ),
            num_blocks,
            eos_token_ids=eos_token_ids,
        )
        self.runner = ModelRunner(
            model,
            num_layers=num_layers,
            kv_cache_dim=kv_cache_dim,
            num_blocks=num_blocks,
            block_size=cfg.block_size,
            device=self.device,
            dtype=dtype,
        )
        self.max_model_len = max_model_len
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        # Prefill side of disaggregation: request id -> ``hook(seq, layer, start, end)``, called on the
        # engine thread during each forward that computes part of that request, right after decoder layer
        # ``layer`` wrote the KV of positions ``[start, end)`` (copy the rows out before returning: the
        # next step may overwrite them). Set and cleared by sovereign_runtime.disagg.
        self.kv_export_hooks: dict[str, KVExportHook] = {}

    @classmethod
    def from_model(cls, model: Any, config: EngineConfig | None = None) -> LLMEngine:
        """Build around a loaded ``sovereign_runtime.model`` model (reads its ``config``)."""
        mc = model.config
        eos = mc.eos_token_id
        eos_ids = set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())
        return cls(
            model,
            num_layers=mc.num_hidden_layers,
            kv_cache_dim=mc.kv_lora_rank + mc.qk_rope_head_dim,
            max_position_embeddings=mc.max_position_embeddings,
            vocab_size=mc.vocab_size,
            eos_token_ids=eos_ids,
            config=config,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path, config: EngineConfig | None = None) -> LLMEngine:
        from ..model import load_model  # imported late: the model package is optional for engine tests

        cfg = config or EngineConfig()
        model, _ = load_model(path, cfg.device, cfg.dtype)
        return cls.from_model(model, cfg)

    # ---- requests -----------------------------------------------------------------------------------
    def make_sequence(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> Sequence:
        """Validate a request without touching engine state (safe from any thread)."""
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams")
        params.validate()
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        if any(not 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        seq = Sequence(request_id or uuid.uuid4().hex, list(prompt_token_ids), len(prompt_token_ids), params)
        seq.generator = make_generator(params.seed, self.device)
        self.scheduler.check_request(seq)
        return seq

    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        seq = self.make_sequence(prompt_token_ids, params, request_id)
        self.add_sequence(seq)
        return seq.request_id

    def add_sequence(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.scheduler.abort(request_id)
        return None if seq is None else self._output(seq, [], None, time.monotonic())

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # ---- the loop -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; returns an output per sequence that got a token."""
        sched = self.scheduler
        batch = sched.schedule()
        if not batch.seqs:
            return []
        export = _LayerExport.for_batch(self, batch) if self.kv_export_hooks else None
        out = self.runner.execute(batch, export)
        if export is not None:
            export.finish()  # layers the model did not report (a model without the callback)
        sampled = [s for s, x in zip(batch.seqs, batch.sample, strict=True) if x]
        self.prompt_tokens_total += sum(
            min(n, s.num_prompt_tokens - s.num_computed_tokens)
            for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
            if s.num_computed_tokens < s.num_prompt_tokens
        )
        now = time.monotonic()
        sched.update(batch, out.token_ids, now)
        self.generation_tokens_total += len(sampled)
        outputs = []
        for i, seq in enumerate(sampled):
            lp = None
            if out.logprobs[i] is not None:
                lp = [TokenLogprob(out.token_ids[i], out.logprobs[i], out.top_logprobs[i] or [])]  # type: ignore[arg-type]
            outputs.append(self._output(seq, [out.token_ids[i]], lp, now))
        return outputs

    # ---- remote prefill (decode side of disaggregation) --------------------------------------------
    def reserve_remote(self, seq: Sequence) -> RemoteSlot | None:
        """Hold blocks for the prompt; the slot says where the uncached rows go. None: no room now."""
        if not self.scheduler.reserve(seq):
            return None
        return RemoteSlot(
            seq.request_id,
            seq.num_computed_tokens,
            seq.num_prompt_tokens,
            list(seq.block_table),
            self.runner.kv_cache,
            self.scheduler.block_size,
            # A tensor-parallel leader must copy received rows into its workers' caches too.
            getattr(self.runner.model, "write_kv_rows", None),
        )

    def commit_remote(
        self, request_id: str, token: int, logprob: TokenLogprob | None, now: float
    ) -> RequestOutput | None:
        seq = self.scheduler.commit(request_id, token, now)
        if seq is None:
            return None
        # The prefill drew the first token from its own generator, seeded alike: draw past it here.
        self.runner.sampler.skip_token(seq.params, seq.generator, self.vocab_size)
        self.generation_tokens_total += 1
        lp = [logprob] if logprob is not None and seq.params.logprobs is not None else None
        return self._output(seq, [token], lp, now)

    def _output(
        self, seq: Sequence, new: list[int], lp: list[TokenLogprob] | None, now: float
    ) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new,
            new_logprobs=lp,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_output_tokens,
            cached_tokens=seq.num_cached_tokens or 0,
            arrival_time=seq.arrival_time,
            first_token_time=seq.first_token_time,
            time=now,
        )

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Convenience for tests and scripts: run prompts to completion, return the output token ids."""
        ids = [self.add_request(p, params) for p in prompts]
        result: dict[str, list[int]] = {i: [] for i in ids}
        while self.has_unfinished():
            for o in self.step():
                result[o.request_id] += o.new_token_ids
        return [result[i] for i in ids]

    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        cache = self.scheduler.cache
        return EngineStats(
            **vars(s),
            prefix_cache_hit_rate=cache.hit_rate if cache is not None else 0.0,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            num_blocks=self.scheduler.pool.num_blocks,
            block_size=self.scheduler.block_size,
        )


def _activation_dtype(model: Any) -> torch.dtype:
    """The model's compute dtype: its first 16/32-bit float parameter (FP8 weights do not count)."""
    for p in model.parameters():
        if p.dtype in (torch.float32, torch.bfloat16, torch.float16):
            return p.dtype
    return torch.float32


@dataclass
class RemoteSlot:
    """Where a remotely computed prompt's KV goes: rows for positions ``[num_cached, num_prompt)``
    belong at ``kv_cache[layer, block_table[p // block_size], p % block_size]``."""

    request_id: str
    num_cached: int
    num_prompt: int
    block_table: list[int]
    kv_cache: torch.Tensor
    block_size: int
    # Writes rows into ``kv_cache`` (``writer(layer, slot_index, rows)``) when a plain ``index_copy_`` is
    # not enough: under tensor parallelism it replicates them to every rank. None: write directly.
    write_kv_rows: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None


@dataclass
class RemoteFirstToken:
    token_id: int
    logprob: TokenLogprob | None = None


# Fetches a prompt's KV into the slot; returns the first token, or None (or raises) to prefill locally.
RemoteFetch = Callable[[RemoteSlot], Awaitable[RemoteFirstToken | None]]


class AsyncEngine:
    """Runs an ``LLMEngine`` on a background thread; ``generate`` streams ``RequestOutput`` deltas.

    Requests are validated in the caller's thread (errors raise ``ValueError`` at once); adds and aborts
    reach the engine thread through a command queue it drains before each step, so the event loop never
    waits for a model step. Closing or cancelling a ``generate`` iterator aborts its request; the engine
    frees the blocks before its next step.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
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
    ) -> AsyncIterator[RequestOutput]:
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
    ) -> AsyncIterator[RequestOutput]:
        """Like ``generate``, but the prompt's KV comes from elsewhere: blocks are reserved for the whole
        prompt, ``fetch`` fills the uncached rows and returns the first token, and the request joins the
        batch as a decode. If the pool has no room, or ``fetch`` fails, the request is prefilled locally;
        closing the iterator at any point aborts it and frees its blocks."""
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
        """The engine thread's outputs for one request, up to and including the finished one."""
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
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
                except ValueError as e:
                    self._deliver(arg.request_id, e)
            elif kind == "reserve":
                try:
                    slot = self.engine.reserve_remote(arg)
                    if slot is None:  # no room for the whole prompt now: queue it as a local prefill
                        self.engine.add_sequence(arg)
                    self._deliver(arg.request_id, slot)
                except ValueError as e:
                    self._deliver(arg.request_id, e)
            elif kind == "local":
                self.engine.scheduler.prefill_locally(arg)
            elif kind == "commit":
                rid, first = arg
                out = self.engine.commit_remote(rid, first.token_id, first.logprob, time.monotonic())
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
        failed = list(self.engine.scheduler.requests)
        for rid in failed:
            self.engine.abort(rid)
        self._stats = self.engine.stats()  # before the callers hear of it, as after a step
        for rid in failed:
            self._deliver(rid, error)
