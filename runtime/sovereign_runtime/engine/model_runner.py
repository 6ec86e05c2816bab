"""Runs one scheduled batch through the model: owns the KV tensor, builds the attention metadata, samples.

The batch is flattened: the new tokens of every scheduled sequence, concatenated. Metadata is built
with one Python pass over the sequences (list slices, no per-token Python work) and tensor ops for the
per-token parts (slot mapping). Logits are computed only at the last new token of sequences that reach
the end of their known tokens (finished prompts and decodes), never for mid-prompt chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from ..model.context import AttentionMetadata, attention_context
from .grammar import Grammars
from .sampler import Sampler, SamplerOutput
from .scheduler import ScheduledBatch

if TYPE_CHECKING:
    from ..model.faults import FaultInjector


class PagedModel(Protocol):
    """The model contract (docs/CONTRACTS.md): what the runner needs from a model."""

    def bind_kv_cache(self, cache: torch.Tensor) -> None: ...

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class ModelRunner:
    def __init__(
        self,
        model: PagedModel,
        *,
        num_layers: int,
        kv_cache_dim: int,
        num_blocks: int,
        block_size: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        self.block_size = block_size
        self.kv_cache = torch.zeros(
            num_layers, num_blocks, block_size, kv_cache_dim, dtype=dtype, device=self.device
        )
        model.bind_kv_cache(self.kv_cache)
        self.sampler = Sampler()
        # The vocabulary's compiled grammars, for requests with a json_schema (set by the assembly,
        # which has the tokenizer; None: such requests are refused).
        self.grammars: Grammars | None = None
        # Test-only fault injection (sovereign_runtime.model.faults), told each forward's sequences.
        self.faults: FaultInjector | None = None
        # The last batch run, its forward's final hidden states and its metadata (the drafter's inputs).
        self.last_forward: tuple[ScheduledBatch, torch.Tensor, AttentionMetadata] | None = None

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, AttentionMetadata, list[int]]:
        """Flattened input ids, the attention metadata, and the rows whose logits are needed."""
        input_ids: list[int] = []
        starts: list[int] = []
        logit_rows: list[int] = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            start = seq.num_computed_tokens
            first = len(input_ids)
            if n == 1:
                input_ids.append(seq.token_ids[start])
            else:
                input_ids += seq.token_ids[start : start + n]
                draft = batch.draft(i)
                if draft:  # the last known token, then the draft it verifies
                    input_ids += draft
            starts.append(start)
            rows = batch.logit_rows(i)
            if rows:
                end = first + n
                logit_rows += range(end - rows, end) if rows > 1 else (end - 1,)
        ids, meta = paged_metadata(
            input_ids, [s.block_table for s in batch.seqs], starts, batch.num_new_tokens, self.block_size,
            self.device, None if batch.drafts is None else [bool(d) for d in batch.drafts],
        )  # fmt: skip
        return ids, meta, logit_rows

    # no_grad rather than inference_mode: model code may keep tensors (e.g. RoPE caches keyed on a
    # tensor's version counter) that inference tensors do not support.
    @torch.no_grad()
    def execute(
        self, batch: ScheduledBatch, after_layer: Callable[[int], None] | None = None
    ) -> SamplerOutput:
        """Run the batch; returns one sampled token per sequence with ``sample`` set (in batch order).

        ``after_layer(i)`` (optional) is called by the model once decoder layer ``i`` has written its KV.
        """
        ids, meta, logit_rows = self.prepare(batch)
        if self.faults is not None:
            self.faults.begin_step(
                [s.request_id for s in batch.seqs],
                [s.num_computed_tokens for s in batch.seqs],
                batch.num_new_tokens,
            )
        meta.after_layer = after_layer
        with attention_context(meta):
            hidden = self.model(ids, meta.positions)
        # The drafter (engine/speculative.py) runs the MTP layer over this forward's rows with the same
        # metadata: only the last batch run.
        self.last_forward = (batch, hidden, meta)
        if not logit_rows:
            return SamplerOutput([], [], [])
        if len(logit_rows) == hidden.shape[0]:  # every token is a last token (pure decode)
            logits = self.model.compute_logits(hidden)
        else:
            rows = torch.tensor(logit_rows, dtype=torch.int64, device=hidden.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows))
        # One entry per logit row: a sequence verifying a draft has several rows, all with its params.
        sampled = [s for i, s in enumerate(batch.seqs) for _ in range(batch.logit_rows(i))]
        matchers = [s.grammar for s in sampled]
        grammars = (self.grammars, matchers) if self.grammars is not None and any(matchers) else None
        params = [s.params for s in sampled]
        # Penalties count each row's tokens so far (a penalized sequence is never drafted: one row).
        history = None
        if any(p.penalized for p in params):
            history = [(s.token_ids, s.num_prompt_tokens) for s in sampled]
        return self.sampler(logits, params, [s.generator for s in sampled], grammars, history)


def paged_metadata(
    input_ids: list[int],
    tables: list[list[int]],
    starts: list[int],
    counts: list[int],
    block_size: int,
    device: torch.device,
    as_rows: list[bool] | None = None,
) -> tuple[torch.Tensor, AttentionMetadata]:
    """Input ids and attention metadata of a flattened step: sequence ``i`` computes positions
    ``[starts[i], starts[i] + counts[i])`` over its block table ``tables[i]``.

    ``as_rows[i]``: present sequence ``i``'s chunk to attention as one single-token query per position
    (context ``p + 1`` each, the same block table), so a verified draft runs through the decode path: the
    same kernel, hence the same numbers, as decoding those positions one step at a time, and batched.

    Few host->device tensors: one int64 (ids, positions[, slots]) and one int32 (offsets, lengths, block
    tables); building tensors dominates the per-step CPU cost for small batches.
    """
    if as_rows is not None and any(as_rows):
        rows_tables: list[list[int]] = []
        rows_starts: list[int] = []
        rows_counts: list[int] = []
        for table, start, n, split in zip(tables, starts, counts, as_rows, strict=True):
            if split:
                rows_tables += [table] * n
                rows_starts += range(start, start + n)
                rows_counts += [1] * n
            else:
                rows_tables.append(table)
                rows_starts.append(start)
                rows_counts.append(n)
        tables, starts, counts = rows_tables, rows_starts, rows_counts
    bs = block_size
    num_seqs, num_tokens = len(tables), len(input_ids)
    max_query_len = max(counts)
    query_start = [0]
    positions: list[int] = []
    context_lens: list[int] = []
    for start, n in zip(starts, counts, strict=True):
        query_start.append(query_start[-1] + n)
        context_lens.append(start + n)
        if n == 1:
            positions.append(start)
        else:
            positions += range(start, start + n)
    max_blocks = max(len(t) for t in tables)
    flat_tables: list[int] = []
    for t in tables:
        flat_tables += t
        flat_tables += [-1] * (max_blocks - len(t))
    i32 = torch.tensor(query_start + context_lens + flat_tables, dtype=torch.int32)
    block_tables = i32[2 * num_seqs + 1 :].view(num_seqs, max_blocks)
    if max_query_len == 1:
        # Pure decode: the slot of each new token is cheap to compute here, one per sequence.
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions, strict=True)]
        i64 = torch.tensor(input_ids + positions + slots, dtype=torch.int64)
        slot_mapping = i64[2 * num_tokens :]
    else:
        i64 = torch.tensor(input_ids + positions, dtype=torch.int64)
        pos = i64[num_tokens:]
        rows = torch.repeat_interleave(torch.arange(num_seqs), torch.tensor(counts))
        # slot = physical block of the token's page * block_size + offset in the page.
        slot_mapping = block_tables[rows, pos // bs].to(torch.int64) * bs + pos % bs
    if device.type != "cpu":
        i64, i32, slot_mapping = (t.to(device, non_blocking=True) for t in (i64, i32, slot_mapping))
        block_tables = i32[2 * num_seqs + 1 :].view(num_seqs, max_blocks)
    meta = AttentionMetadata(
        positions=i64[num_tokens : 2 * num_tokens],
        slot_mapping=slot_mapping,
        query_start_loc=i32[: num_seqs + 1],
        context_lens=i32[num_seqs + 1 : 2 * num_seqs + 1],
        block_tables=block_tables,
        max_query_len=max_query_len,
        max_context_len=max(context_lens),
        block_size=bs,
    )
    return i64[:num_tokens], meta
