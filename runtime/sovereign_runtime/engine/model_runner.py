"""Runs one scheduled batch through the model: owns the KV tensor, builds the attention metadata, samples.

The batch is flattened: the new tokens of every scheduled sequence, concatenated. Metadata is built
with one Python pass over the sequences (list slices, no per-token Python work) and tensor ops for the
per-token parts (slot mapping). Logits are computed only at the last new token of sequences that reach
the end of their known tokens (finished prompts and decodes), never for mid-prompt chunks.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..model.context import AttentionMetadata, attention_context
from .sampler import Sampler, SamplerOutput
from .scheduler import ScheduledBatch


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

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, AttentionMetadata, list[int]]:
        """Flattened input ids, the attention metadata, and the rows whose logits are needed."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        seq_index: list[int] = []
        query_start = [0]
        context_lens: list[int] = []
        tables: list[list[int]] = []
        logit_rows: list[int] = []
        for i, (seq, n, sample) in enumerate(
            zip(batch.seqs, batch.num_new_tokens, batch.sample, strict=True)
        ):
            start = seq.num_computed_tokens
            end = start + n
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            seq_index += [i] * n
            query_start.append(query_start[-1] + n)
            context_lens.append(end)
            tables.append(seq.block_table)
            if sample:
                logit_rows.append(query_start[-1] - 1)
        max_blocks = max(len(t) for t in tables)
        padded = [t + [-1] * (max_blocks - len(t)) for t in tables]

        block_tables = torch.tensor(padded, dtype=torch.int32)
        pos = torch.tensor(positions, dtype=torch.int64)
        rows = torch.tensor(seq_index, dtype=torch.int64)
        # slot = physical block of the token's page * block_size + offset in the page.
        slots = block_tables[rows, pos // bs].to(torch.int64) * bs + pos % bs
        dev = self.device
        meta = AttentionMetadata(
            positions=pos.to(dev, non_blocking=True),
            slot_mapping=slots.to(dev, non_blocking=True),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32).to(dev, non_blocking=True),
            context_lens=torch.tensor(context_lens, dtype=torch.int32).to(dev, non_blocking=True),
            block_tables=block_tables.to(dev, non_blocking=True),
            max_query_len=max(batch.num_new_tokens),
            max_context_len=max(context_lens),
            block_size=bs,
        )
        ids = torch.tensor(input_ids, dtype=torch.int64).to(dev, non_blocking=True)
        return ids, meta, logit_rows

    # no_grad rather than inference_mode: model code may keep tensors (e.g. RoPE caches keyed on a
    # tensor's version counter) that inference tensors do not support.
    @torch.no_grad()
    def execute(self, batch: ScheduledBatch) -> SamplerOutput:
        """Run the batch; returns one sampled token per sequence with ``sample`` set (in batch order)."""
        ids, meta, logit_rows = self.prepare(batch)
        with attention_context(meta):
            hidden = self.model(ids, meta.positions)
        if not logit_rows:
            return SamplerOutput([], [], [])
        rows = torch.tensor(logit_rows, dtype=torch.int64, device=hidden.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        sampled = [s for s, x in zip(batch.seqs, batch.sample, strict=True) if x]
        return self.sampler(logits, [s.params for s in sampled], [s.generator for s in sampled])
