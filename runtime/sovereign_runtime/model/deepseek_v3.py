"""DeepSeek-V3 for causal LM over the paged latent cache, with its multi-token-prediction (MTP) module."""

from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .context import current_attention_metadata
from .layers import DecoderLayer, RMSNorm, _apply, _linear
from .rope import RotaryEmbedding


class SharedHead(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = _linear(config.hidden_size, config.vocab_size)


class MTPLayer(DecoderLayer):
    """One MTP depth: ``eh_proj(cat(enorm(embed(next_token)), hnorm(hidden)))`` then a full decoder layer.

    Checkpoint names sit beside the decoder layer's own (``model.layers.{N}.enorm``, ``.self_attn...``), so it
    subclasses ``DecoderLayer`` and adds its projections and the shared head.
    """

    def __init__(
        self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, tp_size: int = 1
    ) -> None:
        super().__init__(config, layer_idx, rotary, tp_size)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = _linear(2 * config.hidden_size, config.hidden_size)
        self.shared_head = SharedHead(config)

    def predict(
        self, token_embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Hidden states of this depth (before the shared head); the embedding half comes first."""
        x = _apply(self.eh_proj, torch.cat([self.enorm(token_embeds), self.hnorm(hidden)], dim=-1))
        return super().forward(x, positions)


class DeepseekV3Model(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, tp_size: int = 1) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, rotary, tp_size) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV3ForCausalLM(nn.Module):
    """``model(input_ids, positions) -> hidden [tokens, hidden]`` under an ``attention_context``.

    Bind the paged cache first with ``bind_kv_cache``; ``compute_logits`` maps the rows you need to fp32 logits.
    ``tp_size`` > 1 builds one tensor-parallel rank's shard (model/parallel.py); every rank of the group must
    then run each forward together.
    """

    def __init__(self, config: ModelConfig, tp_size: int = 1) -> None:
        super().__init__()
        self.config = config
        self.tp_size = tp_size
        rotary = RotaryEmbedding(config.rope, config.qk_rope_head_dim, config.max_position_embeddings)
        self.model = DeepseekV3Model(config, rotary, tp_size)
        self.lm_head = _linear(config.hidden_size, config.vocab_size)
        n = config.num_hidden_layers
        self.mtp = nn.ModuleList(
            MTPLayer(config, n + k, rotary, tp_size) for k in range(config.num_nextn_predict_layers)
        )

    # Why a checkpoint that declares MTP layers serves without them (set by the loader), or None.
    mtp_unavailable: str | None = None

    def attention_layers(self) -> list[nn.Module]:
        """Attention modules in cache-layer order: the decoder layers, then the MTP layers."""
        return [layer.self_attn for layer in self.model.layers] + [m.self_attn for m in self.mtp]

    def bind_kv_cache(self, cache: torch.Tensor) -> None:
        """Bind ``cache [layers, num_blocks, block_size, kv_cache_dim]``; layers = decoder layers (+ MTP layers)."""
        c = self.config
        if cache.dim() != 4 or cache.shape[-1] != c.kv_cache_dim:
            raise ValueError(
                f"KV cache must be [layers, num_blocks, block_size, {c.kv_cache_dim}], got {tuple(cache.shape)}"
            )
        layers = self.attention_layers()
        if cache.shape[0] not in (c.num_hidden_layers, len(layers)):
            raise ValueError(
                f"KV cache has {cache.shape[0]} layers; expected {c.num_hidden_layers} (or {len(layers)} with MTP)"
            )
        for i, attn in enumerate(layers):
            attn.kv_cache = cache[i] if i < cache.shape[0] else None

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        # Missing context or cache: the first attention layer raises the error that names it.
        meta = current_attention_metadata()
        after = meta.after_layer if meta is not None else None
        for i, layer in enumerate(self.model.layers):
            x = layer(x, positions)
            if after is not None:
                after(i)
        return self.model.norm(x)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return _apply(self.lm_head, hidden).float()

    @torch.no_grad()
    def mtp_hidden(
        self, hidden: torch.Tensor, next_token_ids: torch.Tensor, positions: torch.Tensor, depth: int = 0
    ) -> torch.Tensor:
        """Run MTP depth ``depth`` on the main model's output ``hidden`` and the tokens that follow.

        Needs a cache bound with the MTP layers included. Returns hidden states for ``compute_mtp_logits``.
        """
        embeds = self.model.embed_tokens(next_token_ids)
        return self.mtp[depth].predict(embeds, hidden, positions)

    @torch.no_grad()
    def compute_mtp_logits(self, hidden: torch.Tensor, depth: int = 0) -> torch.Tensor:
        return self.mtp_head(hidden, depth)[1]

    @torch.no_grad()
    def mtp_head(self, hidden: torch.Tensor, depth: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared head on MTP hidden states: the normed state (what a chained draft step reads as
        its hidden input) and fp32 logits."""
        head = self.mtp[depth].shared_head
        normed = head.norm(hidden)
        return normed, _apply(head.head, normed).float()
