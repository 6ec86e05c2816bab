"""DeepSeek-V3 building blocks: RMSNorm, dense MLP, the MoE with grouped top-k routing, MLA attention.

Module and parameter names follow the HF checkpoint (``self_attn.q_a_proj``, ``mlp.experts.3.up_proj``, ...)
so weights load by name. The only global state read here is the attention metadata context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.mla_decode import context_slots, mla_decode, mla_decode_gathered
from .config import ModelConfig
from .context import AttentionMetadata, get_attention_metadata, scratch
from .fp8 import dense_weight
from .parallel import reduce_partial_sums
from .rope import RotaryEmbedding


def _linear(in_features: int, out_features: int) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=False)


# oneDNN's blocked weight layout on CPU (what vLLM's CPU linears and inductor's frozen graphs use): measured
# 1.2-1.7x faster than MKL's ``mm`` from 4 rows up, slower for 1-3 rows except for wide outputs (the LM head).
# docs/engine.md has the measurements.
_ONEDNN = (
    torch.backends.mkldnn.is_available()
    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    and hasattr(torch.ops.mkldnn, "_linear_pointwise")
)
PACKED_MIN_ROWS = 4
PACKED_ALWAYS_MIN_OUT = 2048
_PACK_ROWS_HINT = 16


def _packed_weight(linear: nn.Linear, weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in oneDNN's layout (a copy, made on first use), or None where it does not apply: not
    fp32 on CPU, or a linear marked ``pack_on_cpu = False`` (routed experts: most of a MoE model's memory,
    and they see few rows per step, where packing does not pay)."""
    if not _ONEDNN or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    if not linear.__dict__.get("pack_on_cpu", True):
        return None
    cached = linear.__dict__.get("_packed")
    if cached is None or cached[0] is not weight or cached[1] != (weight.data_ptr(), weight._version):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_ROWS_HINT)
        cached = linear.__dict__["_packed"] = (weight, (weight.data_ptr(), weight._version), packed)
    return cached[2]


def forget_derived_weights(model: nn.Module) -> None:
    """Drop every copy derived from a weight (packed layouts): call after writing weights in place through
    ``.data``, which neither changes a weight's identity nor bumps its version."""
    for module in model.modules():
        module.__dict__.pop("_packed", None)
        module.__dict__.pop("_dense_cache", None)
        module.__dict__.pop("_expert_linears", None)


def _apply(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``linear(x)`` for the hot decode path: a plain linear on a 2-D input is one ``mm`` with the weight's
    transpose, kept as a view (no copy) while the weight stays the same tensor and storage. ``F.linear``
    makes the same ``mm`` call but transposes the weight again on every call, and ``nn.Module.__call__``
    adds its hook bookkeeping; at decode sizes both cost about as much as the product itself. On CPU, from
    ``PACKED_MIN_ROWS`` rows (or for wide outputs) the product runs on oneDNN's packed copy instead.
    """
    if type(linear) is not nn.Linear:
        return linear(x)
    weight = linear.weight
    if x.dim() != 2:
        return F.linear(x, weight)
    if (
        x.shape[0] >= PACKED_MIN_ROWS or weight.shape[0] >= PACKED_ALWAYS_MIN_OUT
    ) and x.dtype == weight.dtype:
        packed = _packed_weight(linear, weight)
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    cached = linear.__dict__.get("_weight_t")
    if cached is None or cached[0] is not weight or cached[1].data_ptr() != weight.data_ptr():
        cached = linear.__dict__["_weight_t"] = (weight, weight.t())
    return torch.mm(x, cached[1])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # fp32: no casts. Written out rather than F.rms_norm, whose CPU composite costs several times
            # these small ops at decode sizes; sum / n is how CPU ``mean`` computes it. n and eps are 0-dim
            # fp32 tensors made once (a Python number is wrapped into a new tensor on every op); they hold
            # the values the scalars would be cast to, so the arithmetic is the reference's, bit for bit.
            n, eps = self._constants(x.shape[-1])
            return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) / n + eps) * self.weight
        # Normalise in fp32 and scale after casting back, as the reference implementation does.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    def _constants(self, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """0-dim CPU fp32 tensors (usable with tensors on any device) for dim and eps; made on first use."""
        cached = self.__dict__.get("_consts")
        if cached is None or cached[0] != (dim, self.eps):
            f32 = {"dtype": torch.float32, "device": "cpu"}
            values = (torch.tensor(float(dim), **f32), torch.tensor(self.eps, **f32))
            cached = self.__dict__["_consts"] = ((dim, self.eps), values)
        return cached[1]


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = _linear(hidden, intermediate)
        self.up_proj = _linear(hidden, intermediate)
        self.down_proj = _linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _apply(self.down_proj, F.silu(_apply(self.gate_proj, x)) * _apply(self.up_proj, x))


def grouped_topk(
    scores: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    mask_value: float = float("-inf"),
    method: str = "noaux_tc",
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's expert selection from router scores [tokens, experts].

    ``method`` "noaux_tc" (V3): selection uses ``scores + bias``; a group scores the sum of its two
    best biased experts; only the best ``topk_group`` groups stay eligible and the others are masked
    with ``mask_value`` (−inf: biased scores can be negative, so masking with 0 would let masked
    experts win). "group_limited_greedy" (V2): a group scores its best expert. "greedy" (V2-Lite):
    no groups. The weights are the unbiased scores of the chosen experts, optionally renormalised,
    times ``routed_scaling_factor``. Returns (weights [tokens, top_k] fp32, expert ids [tokens, top_k]).
    """
    tokens, experts = scores.shape
    choice = scores if correction_bias is None else scores + correction_bias
    if n_group > 1 and method != "greedy":
        grouped = choice.view(tokens, n_group, experts // n_group)
        if method == "group_limited_greedy":
            group_scores = grouped.amax(dim=-1)
        else:
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        keep = group_scores.topk(topk_group, dim=-1).indices
        dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, keep, False)
        choice = grouped.masked_fill(dropped[:, :, None], mask_value).view(tokens, experts)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


class Router(nn.Module):
    """The MoE gate: fp32 weight and correction bias (kept in fp32 whatever the model dtype)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        n = int(config.n_routed_experts or 0)
        self.weight = nn.Parameter(torch.empty(n, config.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(n, dtype=torch.float32), requires_grad=False)
        self.config = config

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        logits = F.linear(x.float(), self.weight.float())
        if c.scoring_func == "sigmoid":
            scores = logits.sigmoid()
            bias = self.e_score_correction_bias
        else:  # DeepSeek-V2 style softmax routing has no correction bias
            scores = logits.softmax(dim=-1)
            bias = None
        return grouped_topk(
            scores,
            bias,
            c.num_experts_per_tok,
            c.n_group,
            c.topk_group,
            c.norm_topk_prob,
            c.routed_scaling_factor,
            method=c.topk_method,
        )


# Up to this many tokens the routed experts run token by token (see MoE.forward).
_PER_TOKEN_MOE_MAX = 5
# Routed experts whose weights together take at most this many bytes (they stay in the CPU's caches) run
# densely for batches of 2 to DENSE_MOE_MAX_TOKENS tokens: every expert on every token in two products,
# the unchosen ones weighted 0. The op count no longer depends on the tokens or their routing and there is
# no host sync. On the built-in model (8 experts, 1.5 MiB) the dense form measured 0.7x the one-token
# path's speed for 1 token (it reads every expert), about even at 2, 1.4-1.8x at 8-32, 1.1-1.2x at 64,
# 0.8x at 128 (docs/engine.md).
DENSE_MOE_MAX_BYTES = 4 << 20
DENSE_MOE_MAX_TOKENS = 32


def _small_linears(linears: list[nn.Module]) -> bool:
    """Plain linears whose weights together take at most ``DENSE_MOE_MAX_BYTES``."""
    if any(type(lin) is not nn.Linear for lin in linears):
        return False
    total = sum(lin.weight.numel() * lin.weight.element_size() for lin in linears)
    return total <= DENSE_MOE_MAX_BYTES


class MoE(nn.Module):
    """Routed + shared experts. Under tensor parallelism (``tp_size`` > 1) every expert holds its 1/N slice
    of the intermediate dim and the output is this rank's partial sum (the decoder layer reduces it)."""

    def __init__(self, config: ModelConfig, tp_size: int = 1) -> None:
        super().__init__()
        n = int(config.n_routed_experts or 0)
        width = config.moe_intermediate_size // tp_size
        self.experts = nn.ModuleList(MLP(config.hidden_size, width) for _ in range(n))
        for linear in self.experts.modules():
            if isinstance(linear, nn.Linear):
                linear.pack_on_cpu = False  # see _packed_weight
        self.gate = Router(config)
        self.shared_experts = (
            MLP(config.hidden_size, width * config.n_shared_experts) if config.n_shared_experts else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        tokens = x.shape[0]
        stacked = self._dense_stack(x) if 2 <= tokens <= DENSE_MOE_MAX_TOKENS else None
        if stacked is not None:
            out = self._dense(x, weights, ids, *stacked)
        elif tokens == 1:
            out = self._one_token(x, weights, ids)
        elif tokens <= _PER_TOKEN_MOE_MAX and not x.is_cuda:
            # A verified draft's few rows on CPU: token by token skips the grouping's sort, count and
            # scatter (on CUDA each token's expert ids would cost a device sync).
            out = torch.cat(
                [self._one_token(x[t : t + 1], weights[t : t + 1], ids[t : t + 1]) for t in range(tokens)]
            )
        else:
            out = self._grouped(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def _dense_stack(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The routed experts stacked for the dense form, or None where it does not apply: experts that
        are not plain linears (FP8) or not of ``x``'s dtype, or more than ``DENSE_MOE_MAX_BYTES`` of them.

        ``gate_up`` [E * 2I, H] holds expert e's gate rows then its up rows, ``down`` [E, H, I] the down
        projections in their own layout (products read them transposed, as ``mm`` reads a linear's weight:
        for one token each expert's output then matched the expert module's bit for bit on Intel hosts; to fp32 rounding on others). A copy, affordable
        because it is small; rebuilt when any expert weight is replaced or updated in place
        (``forget_derived_weights`` for writes through ``.data``).
        """
        linears = self.__dict__.get("_expert_linears")
        if linears is None:
            # Decided once (until forget_derived_weights): large expert sets never pay the check below.
            linears = [(e.gate_proj, e.up_proj, e.down_proj) for e in self.experts]
            if not _small_linears([lin for triple in linears for lin in triple]):
                linears = []
            self.__dict__["_expert_linears"] = linears
        if not linears:
            return None
        weights = [lin.__dict__["_parameters"].get("weight") for triple in linears for lin in triple]
        key = (x.dtype, x.device, *((id(w), w._version, w.data_ptr()) for w in weights if w is not None))
        cached = self.__dict__.get("_dense_cache")
        if cached is not None and cached[0] == key:
            return cached[1]
        if (
            len(key) != 2 + len(weights)
            or not _small_linears([lin for triple in linears for lin in triple])
            or any(w.dtype != x.dtype or w.device != x.device for w in weights)
        ):
            self.__dict__["_dense_cache"] = (key, None)
            return None
        with torch.no_grad():
            gate_up = torch.cat([torch.cat([g.weight, u.weight]) for g, u, _ in linears])
            down = torch.stack([d.weight for _, _, d in linears])
        stacked = (gate_up, down)
        self.__dict__["_dense_cache"] = (key, stacked)
        return stacked

    def _dense(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
    ) -> torch.Tensor:
        """Every routed expert on every token; each token's output sums its chosen experts' outputs
        times their routing weights (the others are weighted 0), in ascending expert order."""
        tokens, experts, width = x.shape[0], down.shape[0], down.shape[2]
        h = torch.mm(x, gate_up.t()).view(tokens, experts, 2 * width)
        act = F.silu(h[..., :width]) * h[..., width:]  # [T, E, I]
        y = torch.bmm(act.transpose(0, 1), down.transpose(1, 2))  # [E, T, H]
        # Weights stay fp32 until after the product, as in the reference.
        routing = weights.new_zeros(tokens, experts).scatter_(1, ids, weights)
        return (y * routing.t()[:, :, None]).sum(0).to(x.dtype)

    def _one_token(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Single-token decode: run the chosen experts on the token directly (no sort, gather or scatter).

        Sums in ascending expert order, as the grouped path's index_add does, so the result is the same.
        """
        chosen = ids[0].tolist()
        out: torch.Tensor | None = None
        for slot in sorted(range(len(chosen)), key=chosen.__getitem__):
            # Weights stay fp32 until after the product, as in the reference.
            y = (self.experts[chosen[slot]](x) * weights[:, slot : slot + 1]).to(x.dtype)
            out = y if out is None else out + y
        assert out is not None
        return out

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        # Group the (token, slot) pairs by expert and run each used expert once on its tokens.
        flat_ids = ids.reshape(-1)
        order = flat_ids.argsort(stable=True)
        counts = torch.bincount(flat_ids, minlength=len(self.experts)).tolist()
        token_of = order // ids.shape[1]
        slot_w = weights.reshape(-1)[order]
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            tok = token_of[start : start + count]
            # Weights stay fp32 until after the product, as in the reference.
            y = self.experts[expert](x[tok]) * slot_w[start : start + count, None]
            out.index_add_(0, tok, y.to(x.dtype))
            start += count
        return out


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of a chunk's queries q [T, H, D] at absolute ``positions`` (the last T of the context)
    over the context's keys k [L, H, D] and values v [L, H, Dv], each query seeing the keys at or before
    its position: [T, H, Dv].

    On CPU, PyTorch's fused attention kernel (flash: tiled, no [H, T, L] score tensor, no separate softmax
    pass) only takes a V as wide as Q and K; MLA's is narrower (v_head_dim < qk_head_dim), which sends SDPA
    to its math path, 1.5x slower for a 488-token chunk over 1000 keys and 1.6x for 512 over 4000
    (docs/engine.md). Zero columns appended to V leave the first Dv outputs unchanged. A chunk that is the
    whole context (positions 0..L-1) is plain causal attention, which the kernel masks by blocks instead of
    reading a [T, L] mask. CUDA keeps SDPA's own choice for the given shapes.
    """
    q_len, ctx, width = q.shape[0], k.shape[0], v.shape[-1]
    mask: torch.Tensor | None = None
    causal = False
    if not q.is_cuda and q_len == ctx:
        causal = True
    else:
        key_pos = torch.arange(ctx, device=positions.device)
        mask = key_pos[None, :] <= positions[:, None]
    if not q.is_cuda and width < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - width))
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, is_causal=causal, scale=scale
    )
    return o[..., :width].transpose(0, 1)


# The absorbed form's multiply-adds per context token run at about this fraction of the expanded form's
# speed on CPU (einsums over latent rows against one large product): fitted to bench/mla_prefill_forms.py.
ABSORBED_CPU_EFFICIENCY = 0.8


def absorbed_prefill_pays(config: ModelConfig, query_len: int) -> bool:
    """Whether attending in latent space costs fewer (efficiency-weighted) multiply-adds per context token
    and head than expanding K/V for it: ``q (2r + rope)`` for the absorbed scores and values against
    ``r (nope + v)`` for the expansion plus ``q (nope + rope + v)`` for expanded attention (r: kv_lora_rank).

    With DeepSeek-V3's head dims up to 126 new tokens absorb; with the bench's mid-size model (nope, rope, v
    64) up to 56.
    """
    r, nope, rope, v = (
        config.kv_lora_rank,
        config.qk_nope_head_dim,
        config.qk_rope_head_dim,
        config.v_head_dim,
    )
    absorbed = query_len * (2 * r + rope)
    expanded = r * (nope + v) + query_len * (nope + rope + v)
    return absorbed <= ABSORBED_CPU_EFFICIENCY * expanded


class MLAAttention(nn.Module):
    """Multi-head latent attention over the paged latent cache.

    Each call writes the new tokens' [normalised latent ‖ rotated k_pe] into their cache slots, then attends
    over every sequence's whole context from the cache. Sequences with one new token (decode) use weight
    absorption and the MLA decode kernel; longer ones (prefill chunks) expand K/V from the latent.
    """

    # Prefill form: "naive" expands per-head K/V from the latent, "absorbed" attends in latent space, "auto"
    # absorbs when the new tokens are a short chunk over a cached prefix (radix-cache hits, a chat's next
    # turn), where expanding K/V for the whole context dominates; fresh prompts and long chunks expand.
    # On CPU (absorbed_prefill_pays; bench/mla_prefill_forms.py --grid, docs/BENCHMARKS.md) the chunk must
    # be short enough for the cost model below and the context at least 4x the chunk. Elsewhere (not
    # measured on a GPU yet) the earlier rule stays: a context of at least 16x the chunk.
    cpu_absorb_context_ratio: int = 4
    absorb_context_ratio: int = 16
    prefill_form: str = "auto"

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, tp_size: int = 1) -> None:
        super().__init__()
        self.config = config
        self.rotary = rotary
        # Under tensor parallelism this rank's heads; o_proj then yields a partial sum the layer reduces.
        self.num_heads = config.num_attention_heads // tp_size
        self.scale = config.softmax_scale
        h, d = config.hidden_size, config.qk_head_dim
        if config.q_lora_rank is None:
            self.q_proj = _linear(h, self.num_heads * d)
        else:
            self.q_a_proj = _linear(h, config.q_lora_rank)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank)  # eps 1e-6 as in the reference, not rms_norm_eps
            self.q_b_proj = _linear(config.q_lora_rank, self.num_heads * d)
        self.kv_a_proj_with_mqa = _linear(h, config.kv_cache_dim)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank)
        self.kv_b_proj = _linear(
            config.kv_lora_rank, self.num_heads * (config.qk_nope_head_dim + config.v_head_dim)
        )
        self.o_proj = _linear(self.num_heads * config.v_head_dim, h)
        self.kv_cache: torch.Tensor | None = (
            None  # [num_blocks, block_size, kv_cache_dim], bound by the engine
        )

    # Projections -------------------------------------------------------------------------------------
    def _project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q_nope [T, H, nope], rotated q_pe [T, H, rope] and the cache rows [T, kv_cache_dim].

        A cache row is the normalised latent c then the rotated k_pe. q_pe and k_pe rotate in one call
        (k_pe as an extra head): RoPE is elementwise, so the values are those of two separate calls.
        """
        c = self.config
        if c.q_lora_rank is None:
            q = _apply(self.q_proj, x)
        else:
            q = _apply(self.q_b_proj, self.q_a_layernorm(_apply(self.q_a_proj, x)))
        q = q.view(x.shape[0], self.num_heads, c.qk_head_dim)
        # Slices rather than Tensor.split: the same views without its Python-level overhead.
        nope, rank = c.qk_nope_head_dim, c.kv_lora_rank
        q_nope, q_pe = q[..., :nope], q[..., nope:]
        kv = _apply(self.kv_a_proj_with_mqa, x)
        latent, k_pe = kv[:, :rank], kv[:, None, rank:]
        pe = RotaryEmbedding.apply(torch.cat([q_pe, k_pe], dim=1), cos, sin)
        return q_nope, pe[:, : self.num_heads], torch.cat([self.kv_a_layernorm(latent), pe[:, -1]], dim=-1)

    def _w_uk_uv(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head into W_UK [H, nope, r] and W_UV^T [H, r, v] (batched-matmul operands).

        Derived once per weight version and dtype (views of a dense weight; FP8 weights are dequantised
        per call as before, so their dense copy is never kept).
        """
        weight = self.kv_b_proj.weight
        key = (id(weight), weight.data_ptr(), weight._version, dtype)
        cached = self.__dict__.get("_absorbed")
        if cached is not None and cached[0] == key:
            return cached[1], cached[2]
        c = self.config
        w = dense_weight(self.kv_b_proj, dtype).view(
            self.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank
        )
        w_uk, w_uv_t = w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim :].transpose(1, 2)
        if isinstance(self.kv_b_proj, nn.Linear) and w.data_ptr() == weight.data_ptr():
            self.__dict__["_absorbed"] = (key, w_uk, w_uv_t)
        return w_uk, w_uv_t

    # Forward -----------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError("no KV cache bound: call model.bind_kv_cache(cache) first")
        meta = get_attention_metadata()
        cos, sin = self.rotary.cos_sin(positions)
        q_nope, q_pe, latents = self._project(x, cos, sin)
        cache = self.kv_cache
        cache.view(-1, cache.shape[-1]).index_copy_(0, meta.slot_mapping, latents.to(cache.dtype))

        if meta.is_decode:
            out = self._decode(q_nope, q_pe, meta.block_tables, meta.context_lens, meta)
        else:
            out = self._mixed(q_nope, q_pe, positions, meta)
        return _apply(self.o_proj, out.reshape(x.shape[0], -1))

    def _decode(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        meta: AttentionMetadata | None = None,
    ) -> torch.Tensor:
        """Weight-absorbed attention for one query per sequence: no per-head K or V is built.

        With ``meta`` (the whole step is decode) off CUDA, the context's cache slots are computed once per
        step and shared by every layer, and each layer only gathers its rows and runs the reference math.
        """
        w_uk, w_uv_t = self._w_uk_uv(q_nope.dtype)
        # Per-head matmuls as batched products over heads ([H, T, ·]); einsum's overhead shows at decode sizes.
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, r]
        q = torch.cat([q_lat, q_pe], dim=-1)
        cache, rank = self.kv_cache, self.config.kv_lora_rank
        if meta is not None and not q.is_cuda:
            slots, valid = meta.memo(
                "decode_slots", lambda: context_slots(block_tables, context_lens, cache.shape[1])
            )
            # index_select of the flat slots, not cache[slots]: the same rows, ~3x faster on CPU (advanced
            # indexing with a 2-D index takes a slower generic path); into a buffer every layer and step
            # reuses (a fresh one's page faults cost more than the copy).
            flat, dim = cache.view(-1, cache.shape[-1]), cache.shape[-1]
            kv = scratch("decode_kv_rows", (*slots.shape, dim), cache.dtype, cache.device)  # [T, L, dim]
            torch.index_select(flat, 0, slots.reshape(-1), out=kv.view(-1, dim))
            o_lat = mla_decode_gathered(q, kv, valid, self.scale, rank)
        else:
            o_lat = mla_decode(q, cache, block_tables, context_lens, self.scale, rank)
        return torch.bmm(o_lat.to(w_uv_t.dtype).transpose(0, 1), w_uv_t).transpose(0, 1)

    def _mixed(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """A batch with prefill chunks: decode sequences together through the absorbed path, others one by one."""
        c = self.config
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, c.v_head_dim)
        starts = meta.query_start_loc.tolist()
        qlens = [starts[i + 1] - starts[i] for i in range(meta.batch_size)]
        decode_seqs = [i for i, n in enumerate(qlens) if n == 1]
        if decode_seqs:
            idx = torch.tensor(decode_seqs, device=q_nope.device)
            rows = torch.tensor([starts[i] for i in decode_seqs], device=q_nope.device)
            out[rows] = self._decode(
                q_nope[rows],
                q_pe[rows],
                meta.block_tables[idx],
                meta.context_lens[idx.to(meta.context_lens.device)],
            )
        context_lens = meta.context_lens.tolist()
        for i, n in enumerate(qlens):
            if n <= 1:
                continue
            s, e = starts[i], starts[i] + n
            kv = self._gather(meta.block_tables[i], context_lens[i], meta.block_size)
            out[s:e] = self._prefill(q_nope[s:e], q_pe[s:e], positions[s:e], kv)
        return out

    def _gather(self, block_table: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
        pos = torch.arange(context_len, device=block_table.device)
        slots = block_table[pos // block_size].long() * block_size + pos % block_size
        cache = self.kv_cache
        return cache.view(-1, cache.shape[-1]).index_select(0, slots.to(cache.device))

    def _absorb_prefill(self, query_len: int, context_len: int, *, on_cpu: bool) -> bool:
        if self.prefill_form != "auto":
            return self.prefill_form == "absorbed"
        if on_cpu:
            return context_len >= self.cpu_absorb_context_ratio * query_len and absorbed_prefill_pays(
                self.config, query_len
            )
        return context_len >= self.absorb_context_ratio * query_len

    def _prefill(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        """Causal attention of one sequence's new tokens over its cached context [L, kv_cache_dim]."""
        c = self.config
        kv = kv.to(q_nope.dtype)
        latent, k_pe = kv.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        ctx = kv.shape[0]
        if self._absorb_prefill(q_nope.shape[0], ctx, on_cpu=q_nope.device.type == "cpu"):
            key_pos = torch.arange(ctx, device=positions.device)
            allowed = key_pos[None, :] <= positions[:, None]  # [q, L] causal by absolute position
            w_uk, w_uv_t = self._w_uk_uv(q_nope.dtype)
            q = torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_uk), q_pe], dim=-1)  # [q, H, r+dr]
            scores = torch.einsum("thd,ld->htl", q, kv) * self.scale
            probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1, dtype=torch.float32).to(kv.dtype)
            return torch.einsum("htr,hrv->thv", torch.einsum("htl,lr->htr", probs, latent), w_uv_t)
        kv_exp = _apply(self.kv_b_proj, latent).view(ctx, self.num_heads, -1)
        k_nope, v = kv_exp.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, self.num_heads, -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        return causal_attention(q, k, v, positions, self.scale)


class DecoderLayer(nn.Module):
    """Attention then MLP/MoE, each residual. With ``tp_size`` > 1 both halves are sharded
    (model/parallel.py) and each ends with one all-reduce of the ranks' partial sums."""

    # The process group the partial sums are reduced over (None: the default group). Set by
    # ``model.parallel.set_tensor_parallel_group`` when pipeline stages each have their own.
    tp_group: object | None = None

    def __init__(
        self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, tp_size: int = 1
    ) -> None:
        super().__init__()
        self.tp_size = tp_size
        self.self_attn = MLAAttention(config, rotary, tp_size)
        self.mlp: nn.Module = (
            MoE(config, tp_size)
            if config.is_moe_layer(layer_idx)
            else MLP(config.hidden_size, config.intermediate_size // tp_size)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            x = x + self.self_attn(self.input_layernorm(x), positions)
            return x + self.mlp(self.post_attention_layernorm(x))
        group = self.tp_group
        x = x + reduce_partial_sums(self.self_attn(self.input_layernorm(x), positions), self.tp_size, group)
        return x + reduce_partial_sums(self.mlp(self.post_attention_layernorm(x)), self.tp_size, group)
