"""A small torch model that honours the engine ↔ model contract without being DeepSeek-V3.

It writes one vector per token and layer into the paged cache at ``slot_mapping`` and attends over the
cache through ``block_tables``/``context_lens`` (causal inside the new tokens), so any mistake in the
engine's metadata, block bookkeeping or prefix reuse changes its outputs. ``reference_logits`` computes
the same function over a whole sequence without any cache: the oracle for engine tests.
"""

from __future__ import annotations

import math

import torch
from sovereign_runtime.model.context import get_attention_metadata
from torch import nn


class ToyConfig:
    def __init__(self, vocab_size: int, kv_dim: int, layers: int, max_position_embeddings: int) -> None:
        self.vocab_size = vocab_size
        self.num_hidden_layers = layers
        self.kv_lora_rank = kv_dim - 8
        self.qk_rope_head_dim = 8
        self.max_position_embeddings = max_position_embeddings
        self.eos_token_id = 0


class ToyPagedModel(nn.Module):
    def __init__(
        self, vocab: int = 64, dim: int = 32, kv_dim: int = 24, layers: int = 2, seed: int = 0
    ) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.config = ToyConfig(vocab, kv_dim, layers, 512)
        self.emb = nn.Parameter(torch.randn(vocab, dim, generator=g))
        self.wq = nn.Parameter(torch.randn(layers, dim, kv_dim, generator=g) / math.sqrt(dim))
        self.wk = nn.Parameter(torch.randn(layers, dim, kv_dim, generator=g) / math.sqrt(dim))
        self.wo = nn.Parameter(torch.randn(layers, kv_dim, dim, generator=g) / math.sqrt(kv_dim))
        self.head = nn.Parameter(torch.randn(dim, vocab, generator=g) * 3 / math.sqrt(dim))
        self.freqs = torch.exp(-torch.arange(0, dim, 2) / dim * math.log(1000.0))
        self.cache: torch.Tensor | None = None

    def bind_kv_cache(self, cache: torch.Tensor) -> None:
        self.cache = cache

    def _embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        angles = positions.float().view(-1, 1) * self.freqs.view(1, -1)
        return self.emb[ids] + torch.cat([angles.sin(), angles.cos()], dim=-1)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        meta = get_attention_metadata()
        assert self.cache is not None
        h = self._embed(input_ids, positions)
        qs = meta.query_start_loc.tolist()
        ctx = meta.context_lens.tolist()
        for layer in range(self.cache.shape[0]):
            k = h @ self.wk[layer]
            flat = self.cache[layer].view(-1, self.cache.shape[-1])
            flat[meta.slot_mapping] = k.to(flat.dtype)
            q = h @ self.wq[layer]
            out = torch.empty_like(q)
            for i in range(len(ctx)):
                n_blocks = -(-ctx[i] // meta.block_size)
                blocks = meta.block_tables[i, :n_blocks].long()
                keys = self.cache[layer][blocks].reshape(-1, flat.shape[-1])[: ctx[i]].float()
                qi = q[qs[i] : qs[i + 1]]
                n = qi.shape[0]
                scores = qi @ keys.T / math.sqrt(keys.shape[-1])
                qpos = torch.arange(ctx[i] - n, ctx[i]).view(-1, 1)
                scores = scores.masked_fill(torch.arange(ctx[i]).view(1, -1) > qpos, float("-inf"))
                out[qs[i] : qs[i + 1]] = torch.softmax(scores, -1) @ keys
            h = h + out @ self.wo[layer]
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.head).float()

    @torch.no_grad()
    def reference_logits(self, tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor(tokens)
        h = self._embed(ids, torch.arange(len(tokens)))
        causal = torch.triu(torch.ones(len(tokens), len(tokens), dtype=torch.bool), 1)
        for layer in range(self.config.num_hidden_layers):
            k = h @ self.wk[layer]
            q = h @ self.wq[layer]
            scores = (q @ k.T / math.sqrt(k.shape[-1])).masked_fill(causal, float("-inf"))
            h = h + (torch.softmax(scores, -1) @ k) @ self.wo[layer]
        return self.compute_logits(h)

    def reference_greedy(self, prompt: list[int], max_tokens: int, eos: int | None = 0) -> list[int]:
        tokens = list(prompt)
        out: list[int] = []
        for _ in range(max_tokens):
            t = int(self.reference_logits(tokens)[-1].argmax())
            out.append(t)
            tokens.append(t)
            if t == eos:
                break
        return out
