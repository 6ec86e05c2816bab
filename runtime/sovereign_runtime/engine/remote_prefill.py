"""The decode side of disaggregation inside the engine: a prompt whose KV another instance computes.

Blocks are reserved for the whole prompt (reusing cached prefix pages); a ``RemoteFetch`` fills the
uncached rows of the ``RemoteSlot`` and returns the first token, which commits the request as a running
decode. If the fetch fails, the reserved blocks are dropped and the request is prefilled locally.
``RemotePrefill`` runs on the engine thread; ``AsyncEngine.generate_remote`` drives it from asyncio.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch

from .api import RequestOutput, TokenLogprob
from .engine import LLMEngine
from .sequence import Sequence


@dataclass
class RemoteSlot:
    """Where a remotely computed prompt's KV goes: rows for positions ``[num_cached, num_prompt)``
    belong at ``kv_cache[layer, block_table[p // block_size], p % block_size]``."""

    request_id: str
    num_cached: int
    num_prompt: int
    block_table: list[int]
    # The decoder layers' cache: a tensor, or a pipeline-parallel leader's StagedKVCache (its shape).
    kv_cache: Any
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


class RemotePrefill:
    """Reserve, commit or fall back, for one ``LLMEngine`` (call only on its thread)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def reserve(self, seq: Sequence) -> RemoteSlot | None:
        """Hold blocks for the prompt; the slot says where the uncached rows go. None: no room now."""
        engine = self.engine
        if not engine.scheduler.reserve(seq):
            return None
        return RemoteSlot(
            seq.request_id,
            seq.num_computed_tokens,
            seq.num_prompt_tokens,
            list(seq.block_table),
            engine.transfer_kv_cache,
            engine.scheduler.block_size,
            # A tensor-parallel leader must copy received rows into its workers' caches too.
            getattr(engine.runner.model, "write_kv_rows", None),
        )

    def commit(self, request_id: str, first: RemoteFirstToken, now: float) -> RequestOutput | None:
        """The slot holds the prompt's KV: the request continues as a decode after ``first``. None if the
        request is no longer reserved (aborted meanwhile)."""
        engine = self.engine
        seq = engine.scheduler.commit(request_id, first.token_id, now)
        if seq is None:
            return None
        # The prefill drew the first token from its own generator, seeded alike: draw past it here.
        engine.runner.sampler.skip_token(seq.params, seq.generator, engine.vocab_size)
        # The prefill constrained the first token with the same schema: the grammar continues after it.
        if seq.grammar is not None and not engine.advance_grammar(seq, first.token_id):
            return engine.refuse_grammar_token(seq, first.token_id, now)
        return engine.token_output(seq, first.token_id, first.logprob, now)

    def prefill_locally(self, request_id: str) -> None:
        """The fetch failed: drop the reserved blocks and queue the request for an ordinary prefill."""
        self.engine.scheduler.prefill_locally(request_id)
