"""Continuous batching with chunked prefill, admission control, preemption and prefix reuse.

Each step gets a token budget. Running decodes go first (one token each), then running sequences whose
prompt is partly prefilled, then new requests from the queue in arrival order, so a long prompt is split
over several steps while decodes keep producing a token every step (mixed batches). A request is
admitted only when blocks for its next chunk exist (free, or cached pages that can be evicted);
otherwise it waits. When a running sequence needs a block and none is left, the youngest running
sequence is preempted: its computed full pages go into the prefix cache, its blocks are released and it
re-enters the queue front to be recomputed (cheaply, through the cache, if its pages survived).
Prompt pages are published to the prefix cache as soon as they are computed (not only when a request
finishes), so concurrent requests sharing a long system prompt reuse it from the next step on.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from .api import InvalidRequest, SchedulerStats
from .block_manager import BlockPool
from .radix_cache import RadixCache
from .sequence import Sequence, SequenceStatus

# Tokens one step computes: running decodes first, then prefill chunks up to the rest. vLLM's default for
# its CPU API server; against 512 it prefills a 1000-token prompt 1.14x faster on CPU (one forward over the
# weights instead of two) at the price of a longer step for the decodes that share it (docs/runtime.md;
# docs/BENCHMARKS.md "Fifth run").
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass
class SchedulerConfig:
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int = 4096
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # new tokens per sequence; they start at seq.num_computed_tokens
    sample: list[bool]  # True where this chunk ends the sequence's known tokens: it gets a new token
    # Speculative decoding: per sequence, the draft tokens its chunk carries after its last known token
    # (its new tokens are then ``1 + len(draft)``, every one with logits); None when no sequence has one.
    drafts: list[list[int]] | None = None

    def draft(self, i: int) -> list[int]:
        return self.drafts[i] if self.drafts is not None else []

    def logit_rows(self, i: int) -> int:
        """Rows of logits sequence ``i`` gets: none mid-prompt, one, or one per position it verifies."""
        return (1 + len(self.draft(i))) if self.sample[i] else 0

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def max_query_len(self) -> int:
        return max(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, num_blocks: int, eos_token_ids: set[int] | None = None
    ) -> None:
        self.config = config
        self.block_size = config.block_size
        self.pool = BlockPool(num_blocks)
        self.cache = RadixCache(self.pool, config.block_size) if config.enable_prefix_caching else None
        self.eos_token_ids = set(eos_token_ids or ())
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}
        # Remote prefill (disaggregation): blocks held for a prompt whose KV another instance computes.
        self.reserved: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.num_degenerate = 0  # requests ended by repetition detection

    # ---- requests -----------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise ValueError(f"request_id {seq.request_id!r} is already in use")
        self.check_request(seq)
        seq.status = SequenceStatus.WAITING
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    def check_request(self, seq: Sequence) -> None:
        """Reject a request that could never run (reads only configuration: safe from any thread)."""
        cfg = self.config
        if seq.num_prompt_tokens < 1:
            raise InvalidRequest("prompt", "must contain at least one token")
        if seq.num_prompt_tokens >= cfg.max_model_len:
            raise InvalidRequest(
                "prompt",
                f"has {seq.num_prompt_tokens} tokens; the context is {cfg.max_model_len} tokens "
                "and at least one must remain for the completion",
            )
        longest = min(seq.num_prompt_tokens + seq.params.max_tokens, cfg.max_model_len)
        if self._blocks_for(longest) > self.pool.num_blocks:
            raise InvalidRequest(
                None,  # the pool is too small for the request as a whole, no one field is at fault
                f"prompt plus max_tokens needs {longest} tokens of KV cache; the pool holds "
                f"{self.pool.num_blocks * self.block_size}",
            )

    def abort(self, request_id: str, reason: str = "abort") -> Sequence | None:
        """Stop a request now and free its blocks (its pages are not cached: their content may be what
        failed); returns it, or None if unknown or already finished. ``reason``: its finish_reason."""
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        if self.reserved.pop(request_id, None) is None:  # a reserved request is in neither queue
            if seq.status is SequenceStatus.RUNNING:
                self.running.remove(seq)
            else:
                self.waiting.remove(seq)
        self._release(seq, cache_pages=False)
        self._finish(seq, reason)
        return seq

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling ---------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        chosen: dict[Sequence, int] = {}
        preempted = False

        # Running sequences: decodes first so a long prefill never stalls them, then partial prefills.
        for decode_pass in (True, False):
            for seq in list(self.running):
                if budget <= 0:
                    break
                if seq.status is not SequenceStatus.RUNNING or seq in chosen:
                    continue
                remaining = seq.num_uncomputed_tokens
                if (remaining == 1) != decode_pass:
                    continue
                if seq.draft:  # verify the draft in the same forward: its positions follow the last token
                    del seq.draft[max(0, budget - 1) :]
                    if seq.draft and not self._grow(seq, seq.num_tokens + len(seq.draft)):
                        seq.draft.clear()  # no room for the draft's KV: an ordinary decode instead
                    remaining += len(seq.draft)
                n = min(remaining, budget)
                while not self._grow(seq, seq.num_computed_tokens + n):
                    victim = next(s for s in reversed(self.running) if s not in chosen)
                    self._preempt(victim)
                    preempted = True
                    if victim is seq:
                        break
                if seq.status is SequenceStatus.RUNNING:
                    chosen[seq] = n
                    budget -= n

        # New work only when nothing had to be preempted this step (otherwise it would thrash).
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                self._reuse_prefix(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            if not self._grow(seq, seq.num_computed_tokens + n, may_evict_only_if_enough=True):
                self._release(seq, cache_pages=False)
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if seq.num_cached_tokens is None:  # first admission: this is the request's cache lookup
                seq.num_cached_tokens = seq.num_computed_tokens
                if self.cache is not None:
                    self.cache.record_lookup(seq.num_prompt_tokens, seq.num_computed_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chosen[seq] = n
            budget -= n

        seqs = list(chosen)
        counts = list(chosen.values())
        sample = [
            s.num_computed_tokens + n == s.num_tokens + len(s.draft)
            for s, n in zip(seqs, counts, strict=True)
        ]
        drafts = [list(s.draft) for s in seqs] if any(s.draft for s in seqs) else None
        return ScheduledBatch(seqs, counts, sample, drafts)

    def update(self, batch: ScheduledBatch, sampled: list[int], now: float | None = None) -> list[Sequence]:
        """Advance after the model ran ``batch``; ``sampled`` holds one token per ``sample`` row.

        Returns the sequences that finished in this step (their blocks are already released).
        """
        return self.update_tokens(batch, [[t] for t in sampled], now)

    def update_tokens(
        self, batch: ScheduledBatch, tokens: list[list[int]], now: float | None = None
    ) -> list[Sequence]:
        """``update`` where a sampled sequence may gain several tokens: a verified draft's accepted tokens
        and the token after them. Its KV is kept only for the accepted positions; blocks that held nothing
        but rejected positions go back to the pool at once. Tokens after a stop are dropped."""
        finished: list[Sequence] = []
        it = iter(tokens)
        now = time.monotonic() if now is None else now
        for i, (seq, n, gets_token) in enumerate(
            zip(batch.seqs, batch.num_new_tokens, batch.sample, strict=True)
        ):
            new = next(it) if gets_token else None
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            drafted = bool(batch.draft(i))
            seq.draft = []
            # A verified draft: the last known token and each accepted draft token now have their KV.
            advance = len(new) if drafted and new else n
            seq.num_computed_tokens += advance
            if self.cache is not None and seq.num_computed_tokens - advance < seq.num_prompt_tokens:
                self._cache_prompt_pages(seq)
            if not new:
                continue
            reason = None
            for token in new:
                seq.token_ids.append(token)
                if seq.first_token_time is None:
                    seq.first_token_time = now
                reason = self._stop_reason(seq, token)
                if reason is not None:
                    break
            if reason is not None:
                self.running.remove(seq)
                seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
                self._release(seq, cache_pages=True)
                self._finish(seq, reason)
                finished.append(seq)
            elif drafted:
                self._trim(seq)
        return finished

    def _trim(self, seq: Sequence) -> None:
        """Free the blocks past ``seq``'s known tokens (they held only rejected draft positions)."""
        keep = self._blocks_for(seq.num_tokens)
        if len(seq.block_table) > keep:
            self.pool.decref(seq.block_table[keep:])
            del seq.block_table[keep:]

    def grow_for_draft(self, seq: Sequence, num_draft: int) -> int:
        """Blocks for ``seq``'s next ``num_draft`` draft positions past its known tokens, as many as the
        pool has without evicting cached pages; returns how many draft tokens fit."""
        while num_draft > 0:
            need = self._blocks_for(seq.num_tokens + num_draft) - len(seq.block_table)
            if need <= self.pool.num_free:
                if need > 0:
                    seq.block_table.extend(self.pool.allocate(need))
                return num_draft
            num_draft -= 1
        return 0

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        """Called once per new output token (already appended)."""
        p = seq.params
        n_out = seq.num_output_tokens
        if seq.repetition is not None and seq.repetition.feed(token):
            self.num_degenerate += 1
            return "error"  # degenerate output: the last repetition_window tokens repeat one pattern
        if n_out >= p.min_tokens and (
            token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)
        ):
            return "stop"
        if n_out >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    # ---- remote prefill -----------------------------------------------------------------------------
    def reserve(self, seq: Sequence) -> bool:
        """Hold blocks for ``seq``'s whole prompt, reusing cached prefix pages, without scheduling it.

        Another instance computes the uncached part; ``commit`` then makes ``seq`` a running decode and
        ``prefill_locally`` queues it for an ordinary prefill instead. False (nothing held) when the pool
        cannot hold the prompt now.
        """
        if seq.request_id in self.requests:
            raise ValueError(f"request_id {seq.request_id!r} is already in use")
        self.check_request(seq)
        self._reuse_prefix(seq)
        if not self._grow(seq, seq.num_prompt_tokens, may_evict_only_if_enough=True):
            self._release(seq, cache_pages=False)
            seq.num_computed_tokens = 0
            return False
        seq.num_cached_tokens = seq.num_computed_tokens
        if self.cache is not None:
            self.cache.record_lookup(seq.num_prompt_tokens, seq.num_computed_tokens)
        seq.status = SequenceStatus.WAITING
        self.requests[seq.request_id] = seq
        self.reserved[seq.request_id] = seq
        return True

    def commit(self, request_id: str, first_token: int, now: float | None = None) -> Sequence | None:
        """The reserved blocks now hold the prompt's KV: ``seq`` joins the batch as a decode with its
        first token already sampled (or finishes at once). None if the request is no longer reserved."""
        seq = self.reserved.pop(request_id, None)
        if seq is None:
            return None
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.token_ids.append(first_token)
        seq.first_token_time = time.monotonic() if now is None else now
        reason = self._stop_reason(seq, first_token)
        if reason is not None:
            self._release(seq, cache_pages=True)
            self._finish(seq, reason)
        else:
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return seq

    def prefill_locally(self, request_id: str) -> bool:
        """The remote prefill failed: drop the reserved blocks (their content is not trusted) and queue
        the request for an ordinary prefill, at the front since it already waited."""
        seq = self.reserved.pop(request_id, None)
        if seq is None:
            return False
        self._release(seq, cache_pages=False)
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)
        return True

    # ---- blocks -------------------------------------------------------------------------------------
    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _grow(self, seq: Sequence, num_tokens: int, may_evict_only_if_enough: bool = False) -> bool:
        """Make ``seq``'s block table cover ``num_tokens`` tokens; False if the pool cannot."""
        need = self._blocks_for(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        short = need - self.pool.num_free
        if short > 0:
            if self.cache is None:
                return False
            if may_evict_only_if_enough and short > self.cache.num_evictable_blocks:
                return False  # do not throw cached pages away for an admission that fails anyway
            self.cache.evict(short)
            if self.pool.num_free < need:
                return False
        seq.block_table.extend(self.pool.allocate(need))
        return True

    def _reuse_prefix(self, seq: Sequence) -> None:
        if self.cache is None:
            return
        # Leave at least one token to compute: the model must run to produce the next token's logits.
        node, blocks = self.cache.match_prefix(seq.token_ids, max_tokens=seq.num_tokens - 1)
        if blocks:
            self.cache.lock(node)
            self.pool.incref(blocks)
            seq.cache_node = node
            seq.block_table = list(blocks)
            seq.num_computed_tokens = len(blocks) * self.block_size

    def _cache_prompt_pages(self, seq: Sequence) -> None:
        """Publish the prompt pages computed so far, so requests admitted later reuse them at once.

        The sequence keeps its blocks and moves its lock down to the node that ends at its last full
        page, so its own pages (now also the tree's) stay unevictable while it runs.
        """
        assert self.cache is not None
        pages = seq.num_computed_tokens // self.block_size
        if pages == 0:
            return
        tokens = seq.token_ids[: pages * self.block_size]
        self.cache.insert(tokens, seq.block_table[:pages])
        node, _ = self.cache.match_prefix(tokens)
        self.cache.lock(node)
        if seq.cache_node is not None:
            self.cache.unlock(seq.cache_node)
        seq.cache_node = node

    def _release(self, seq: Sequence, cache_pages: bool) -> None:
        if self.cache is not None and cache_pages:
            pages = seq.num_computed_tokens // self.block_size
            if pages:
                self.cache.insert(seq.token_ids[: pages * self.block_size], seq.block_table[:pages])
        if seq.block_table:
            self.pool.decref(seq.block_table)
            seq.block_table = []
        if seq.cache_node is not None:
            assert self.cache is not None
            self.cache.unlock(seq.cache_node)
            seq.cache_node = None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq, cache_pages=True)
        seq.num_computed_tokens = 0
        seq.draft = []
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.requests.pop(seq.request_id, None)

    # ---- introspection ------------------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        evictable = self.cache.num_evictable_blocks if self.cache is not None else 0
        in_use = self.pool.num_used - evictable
        waiting_prompt = sum(s.num_uncomputed_tokens for s in self.waiting) + sum(
            s.num_uncomputed_tokens for s in self.running if s.num_uncomputed_tokens > 1
        )
        return SchedulerStats(
            num_requests_running=len(self.running),
            num_requests_waiting=len(self.waiting),
            kv_cache_usage=in_use / self.pool.num_blocks,
            num_free_blocks=self.pool.num_free + evictable,
            num_cached_blocks=self.cache.num_cached_blocks if self.cache is not None else 0,
            prefix_cache_queries=self.cache.queries if self.cache is not None else 0,
            prefix_cache_hits=self.cache.hits if self.cache is not None else 0,
            prompt_tokens_waiting=waiting_prompt,
            num_preemptions=self.num_preemptions,
        )

    def check(self) -> None:
        """Invariants used by the tests: every block reference is accounted for."""
        self.pool.check()
        if self.cache is not None:
            self.cache.check()
        expected = [0] * self.pool.num_blocks
        for seq in self.running:
            assert seq.status is SequenceStatus.RUNNING
            assert self._blocks_for(seq.num_computed_tokens) <= len(seq.block_table)
            assert len(seq.block_table) <= self._blocks_for(seq.num_tokens + len(seq.draft))
            for b in seq.block_table:
                expected[b] += 1
        for seq in self.waiting:
            assert seq.status is SequenceStatus.WAITING and not seq.block_table and seq.cache_node is None
        for seq in self.reserved.values():
            assert seq.status is SequenceStatus.WAITING and seq not in self.waiting
            assert len(seq.block_table) == self._blocks_for(seq.num_prompt_tokens)
            for b in seq.block_table:
                expected[b] += 1
        if self.cache is not None:
            for blocks, locked in self.cache.cached_pages():
                for b in blocks:
                    expected[b] += 1
                if not locked:
                    assert all(self.pool.ref_count(b) == 1 for b in blocks), "unlocked page in use"
        for b in range(self.pool.num_blocks):
            assert self.pool.ref_count(b) == expected[b], (
                f"block {b}: refs {self.pool.ref_count(b)} != {expected[b]}"
            )
