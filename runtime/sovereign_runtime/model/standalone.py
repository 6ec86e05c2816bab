"""A minimal paged-cache driver for using the model without the engine (tests, scripts, benchmarks).

``PagedRunner`` owns a KV cache and a trivial block allocator, builds ``AttentionMetadata`` for a list of
(sequence, new tokens) pairs and runs one step. It is deliberately simple; the engine's model runner is the
production path.

Why it ships in the package although serving never imports it: it is the independent reference the engine
is held against (the server's greedy output equals ``greedy_generate``; tensor-parallel shards and the HF
parity tests run through it), the benchmarks that time the model alone (``bench/mla_prefill_forms.py``,
``bench/kv_bytes_per_token.py``) drive it, and a user can script the model with it. Tests and benchmarks
therefore share this one copy; it needs nothing the model package does not already need.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .context import AttentionMetadata, attention_context
from .deepseek_v3 import DeepseekV3ForCausalLM


class PagedRunner:
    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        num_blocks: int = 256,
        block_size: int = 16,
        dtype: torch.dtype | None = None,
        include_mtp: bool = False,
    ) -> None:
        param = model.lm_head.weight
        layers = len(model.attention_layers()) if include_mtp else model.config.num_hidden_layers
        split = getattr(model, "kv_cache_layers", None)  # a pipeline-parallel leader keeps its stage's
        if split is not None:
            layers = split(layers)[0]
        self.model = model
        self.block_size = block_size
        self.device = param.device
        self.cache = torch.zeros(
            layers,
            num_blocks,
            block_size,
            model.config.kv_cache_dim,
            dtype=dtype or param.dtype,
            device=self.device,
        )
        model.bind_kv_cache(self.cache)
        # Hand out blocks in a scrambled order so tests exercise non-contiguous block tables.
        self._free = [int(b) for b in torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))]
        self._blocks: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}
        self._next_id = 0

    def new_sequence(self) -> int:
        sid = self._next_id
        self._next_id += 1
        self._blocks[sid], self._lens[sid] = [], 0
        return sid

    def free(self, sid: int) -> None:
        self._free.extend(self._blocks.pop(sid))
        self._lens.pop(sid)

    def context_len(self, sid: int) -> int:
        return self._lens[sid]

    def metadata(self, work: Sequence[tuple[int, Sequence[int]]]) -> tuple[torch.Tensor, AttentionMetadata]:
        """Allocate slots for each sequence's new tokens; returns (input_ids, metadata)."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        lens: list[int] = []
        for sid, tokens in work:
            start = self._lens[sid]
            blocks = self._blocks[sid]
            for pos in range(start, start + len(tokens)):
                if pos // self.block_size >= len(blocks):
                    blocks.append(self._free.pop())
                slots.append(blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
                positions.append(pos)
            ids.extend(int(t) for t in tokens)
            self._lens[sid] = start + len(tokens)
            starts.append(len(ids))
            lens.append(self._lens[sid])
        width = max(len(self._blocks[sid]) for sid, _ in work)
        tables = torch.full((len(work), width), -1, dtype=torch.int32)
        for row, (sid, _) in enumerate(work):
            tables[row, : len(self._blocks[sid])] = torch.tensor(self._blocks[sid], dtype=torch.int32)
        dev = self.device
        meta = AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=tables.to(dev),
            max_query_len=max(len(t) for _, t in work),
            max_context_len=max(lens),
            block_size=self.block_size,
        )
        return torch.tensor(ids, dtype=torch.int64, device=dev), meta

    def step(self, work: Sequence[tuple[int, Sequence[int]]], all_logits: bool = False) -> torch.Tensor:
        """Feed each sequence its new tokens in one batch; fp32 logits of every token or of each last token."""
        input_ids, meta = self.metadata(work)
        with attention_context(meta):
            hidden = self.model(input_ids, meta.positions)
        if not all_logits:
            hidden = hidden[meta.query_start_loc[1:].long() - 1]
        return self.model.compute_logits(hidden)


def prompt_logits(
    model: DeepseekV3ForCausalLM, token_ids: Sequence[int], chunk_size: int | None = None
) -> torch.Tensor:
    """fp32 logits [len, vocab] for one prompt through a temporary paged cache (optionally chunked prefill)."""
    runner = PagedRunner(model, num_blocks=(len(token_ids) + 15) // 16 + 1)
    sid = runner.new_sequence()
    chunk = chunk_size or len(token_ids)
    parts = [
        runner.step([(sid, token_ids[i : i + chunk])], all_logits=True)
        for i in range(0, len(token_ids), chunk)
    ]
    return torch.cat(parts)


def greedy_generate(
    model: DeepseekV3ForCausalLM, prompts: Sequence[Sequence[int]], max_new_tokens: int, block_size: int = 16
) -> list[list[int]]:
    """Greedy continuations of all prompts served together: one batched prefill, then batched decode steps."""
    longest = max(len(p) for p in prompts) + max_new_tokens
    blocks = len(prompts) * ((longest + block_size - 1) // block_size)
    runner = PagedRunner(model, num_blocks=blocks, block_size=block_size)
    sids = [runner.new_sequence() for _ in prompts]
    logits = runner.step(list(zip(sids, prompts, strict=True)))
    outputs: list[list[int]] = [[] for _ in prompts]
    for _ in range(max_new_tokens):
        next_ids = logits.argmax(-1).tolist()
        for out, t in zip(outputs, next_ids, strict=True):
            out.append(int(t))
        if len(outputs[0]) == max_new_tokens:
            break
        logits = runner.step([(sid, [t]) for sid, t in zip(sids, next_ids, strict=True)])
    return outputs
