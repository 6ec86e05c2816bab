"""MLA decode attention over the paged latent cache (weight-absorbed form).

After absorption MLA decode is multi-query attention with ONE shared KV head: every query head holds
``q = [q_lat ‖ q_pe]`` (kv_lora_rank + qk_rope_head_dim wide, 576 for V3), the key of a cached token is its
whole cache row ``[c ‖ k_pe]`` and the value is its latent ``c`` (the first kv_lora_rank values). The output is
the attention-weighted latent ``o_lat`` per head; the caller maps it through W_UV.

``mla_decode`` dispatches to the Triton kernel on CUDA and to ``mla_decode_reference`` elsewhere; both take
the same arguments. The Triton version splits each sequence's context across programs (split-KV, so a
single long sequence still fills the GPU) and merges the partial results with their log-sum-exp.
"""

from __future__ import annotations

import os

import torch

__all__ = [
    "context_slots",
    "default_num_splits",
    "mla_decode",
    "mla_decode_gathered",
    "mla_decode_reference",
    "mla_decode_triton",
]


def context_slots(
    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Cache slot of every context position [batch, max_len] and the validity mask [batch, max_len].

    Slots of padding blocks clamp to 0 and must be masked; the mask is None when every sequence has
    max_len tokens (single-stream decode). The slots are the same for every layer of a step, so callers
    that run many layers compute them once (``AttentionMetadata.memo``).
    """
    batch = block_tables.shape[0]
    lens = context_lens.tolist()  # one host sync for both the max and the min
    max_len = max(lens)
    num_blocks = (max_len + block_size - 1) // block_size
    offsets = torch.arange(block_size, device=block_tables.device)
    tables = block_tables[:, :num_blocks].long().clamp(min=0) * block_size
    slots = (tables[:, :, None] + offsets).reshape(batch, -1)[:, :max_len]
    if min(lens) == max_len:
        return slots, None
    valid = torch.arange(max_len, device=slots.device)[None, :] < context_lens[:, None].to(slots.device)
    return slots, valid


def mla_decode_gathered(
    q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor | None, scale: float, kv_lora_rank: int
) -> torch.Tensor:
    """The reference's attention over already-gathered rows: q [batch, heads, D], kv [batch, L, D].

    ``valid`` [batch, L] masks padding positions (None: all valid). Returns o_lat in q's dtype.
    """
    kv = kv.float()
    scores = torch.bmm(q.float(), kv.transpose(1, 2)) * scale  # [batch, heads, L]
    if valid is not None:
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.bmm(probs, kv[..., :kv_lora_rank]).to(q.dtype)


def mla_decode_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Torch reference (used on CPU).

    q: [batch, heads, D] with D = kv_lora_rank + rope dim; kv_cache: [num_blocks, block_size, D] (one layer);
    block_tables: [batch, max_blocks] int (padded with -1); context_lens: [batch] int, each ≥ 1.
    Returns o_lat [batch, heads, kv_lora_rank] in q's dtype. ``num_splits`` is accepted for signature parity.
    """
    del num_splits
    slots, valid = context_slots(block_tables, context_lens, kv_cache.shape[1])
    slots = slots.to(q.device)
    kv = kv_cache.reshape(-1, kv_cache.shape[-1])[slots.reshape(-1)].view(*slots.shape, -1)
    return mla_decode_gathered(q, kv, None if valid is None else valid.to(q.device), scale, kv_lora_rank)


def default_num_splits(batch: int, heads: int, max_context_len: int, block_n: int = 64) -> int:
    """Enough KV splits to give ~2 programs per SM on a big GPU without making splits tinier than a tile."""
    programs = batch * ((heads + 15) // 16)
    target = 264  # ~2 × the SM count of an H100/H200 (132)
    splits = max(1, target // max(programs, 1))
    return max(1, min(splits, (max_context_len + block_n - 1) // block_n, 64))


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode: Triton on CUDA, the torch reference elsewhere (same signature and result)."""
    if q.is_cuda:
        return mla_decode_triton(q, kv_cache, block_tables, context_lens, scale, kv_lora_rank, num_splits)
    return mla_decode_reference(q, kv_cache, block_tables, context_lens, scale, kv_lora_rank)


# ----------------------------------------------------------------------------------------------------
# Triton kernel. Imported lazily so that CPU-only use never needs a working Triton.
# ----------------------------------------------------------------------------------------------------

_kernels: tuple[object, object] | None = None


def _build_kernels() -> tuple[object, object]:
    import triton
    import triton.language as tl

    @triton.jit
    def _split_kernel(
        q_ptr,  # [B, H, D]
        kv_ptr,  # [num_blocks, block_size, D]
        tables_ptr,  # [B, max_blocks]
        lens_ptr,  # [B]
        o_ptr,  # [B, H, S, R] fp32: normalised partial outputs
        lse_ptr,  # [B, H, S] fp32: log-sum-exp of each split's scores
        scale,
        stride_qb,
        stride_qh,
        stride_kvb,
        stride_kvt,
        stride_tb,
        stride_ob,
        stride_oh,
        stride_os,
        stride_lb,
        stride_lh,
        H,
        R,
        DR,
        BLOCK_SIZE: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_DR: tl.constexpr,
        FP32_DOT: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        b = tl.program_id(0)
        hb = tl.program_id(1)
        s = tl.program_id(2)
        ctx = tl.load(lens_ptr + b)
        split_len = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = s * split_len
        end = tl.minimum(start + split_len, ctx)

        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        rs = tl.arange(0, BLOCK_R)
        drs = tl.arange(0, BLOCK_DR)
        h_ok = heads < H
        r_ok = rs < R
        dr_ok = drs < DR
        q_row = q_ptr + b * stride_qb + heads[:, None] * stride_qh
        q_lat = tl.load(q_row + rs[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
        q_pe = tl.load(q_row + R + drs[None, :], mask=h_ok[:, None] & dr_ok[None, :], other=0.0)
        if FP32_DOT:
            q_lat = q_lat.to(tl.float32)
            q_pe = q_pe.to(tl.float32)

        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            toks = n0 + tl.arange(0, BLOCK_N)
            t_ok = toks < end
            blocks = tl.load(tables_ptr + b * stride_tb + toks // BLOCK_SIZE, mask=t_ok, other=0)
            row = kv_ptr + blocks.to(tl.int64) * stride_kvb + (toks % BLOCK_SIZE) * stride_kvt
            c = tl.load(row[:, None] + rs[None, :], mask=t_ok[:, None] & r_ok[None, :], other=0.0)
            k_pe = tl.load(row[:, None] + R + drs[None, :], mask=t_ok[:, None] & dr_ok[None, :], other=0.0)
            if FP32_DOT:
                c = c.to(tl.float32)
                k_pe = k_pe.to(tl.float32)
            scores = tl.dot(q_lat, tl.trans(c), input_precision=PRECISION)
            scores += tl.dot(q_pe, tl.trans(k_pe), input_precision=PRECISION)
            scores = scores * scale
            scores = tl.where(t_ok[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=PRECISION)
            m_i = m_new

        has_tokens = l_i > 0
        out = acc / tl.where(has_tokens, l_i, 1.0)[:, None]
        lse = tl.where(has_tokens, m_i + tl.log(tl.where(has_tokens, l_i, 1.0)), float("-inf"))
        o_row = o_ptr + b * stride_ob + heads[:, None] * stride_oh + s * stride_os
        tl.store(o_row + rs[None, :], out, mask=h_ok[:, None] & r_ok[None, :])
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + s, lse, mask=h_ok)

    @triton.jit
    def _merge_kernel(
        o_ptr,  # [B, H, S, R] fp32
        lse_ptr,  # [B, H, S] fp32
        out_ptr,  # [B, H, R]
        stride_ob,
        stride_oh,
        stride_os,
        stride_lb,
        stride_lh,
        stride_outb,
        stride_outh,
        R,
        NUM_SPLITS: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        ss = tl.arange(0, BLOCK_S)
        rs = tl.arange(0, BLOCK_R)
        s_ok = ss < NUM_SPLITS
        lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + ss, mask=s_ok, other=float("-inf"))
        m = tl.max(lse, axis=0)
        w = tl.where(lse > float("-inf"), tl.exp(lse - m), 0.0)
        o = tl.load(
            o_ptr + b * stride_ob + h * stride_oh + ss[:, None] * stride_os + rs[None, :],
            mask=s_ok[:, None] & (rs[None, :] < R),
            other=0.0,
        )
        merged = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
        tl.store(out_ptr + b * stride_outb + h * stride_outh + rs, merged, mask=rs < R)

    return _split_kernel, _merge_kernel


def _next_pow2(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def mla_decode_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Split-KV Triton kernel plus a log-sum-exp merge; same contract as ``mla_decode_reference``."""
    global _kernels
    if _kernels is None:
        _kernels = _build_kernels()
    split_kernel, merge_kernel = _kernels

    batch, heads, width = q.shape
    rope_dim = width - kv_lora_rank
    block_size = kv_cache.shape[1]
    q = q.contiguous()
    kv_cache = kv_cache.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    context_lens = context_lens.to(device=q.device, dtype=torch.int32).contiguous()
    if num_splits is None:
        num_splits = default_num_splits(batch, heads, int(context_lens.max().item()))

    # Under the interpreter tl.dot needs fp32 operands (bf16 dots are not supported there).
    fp32_dot = os.environ.get("TRITON_INTERPRET") == "1" or q.dtype == torch.float32
    block_h = 16
    block_n = 16 if fp32_dot else 32
    block_r = _next_pow2(kv_lora_rank)
    block_dr = _next_pow2(rope_dim)
    partial = torch.empty(batch, heads, num_splits, kv_lora_rank, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
    out = torch.empty(batch, heads, kv_lora_rank, dtype=q.dtype, device=q.device)

    grid = (batch, (heads + block_h - 1) // block_h, num_splits)
    split_kernel[grid](
        q,
        kv_cache,
        block_tables,
        context_lens,
        partial,
        lse,
        float(scale),
        q.stride(0),
        q.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        block_tables.stride(0),
        partial.stride(0),
        partial.stride(1),
        partial.stride(2),
        lse.stride(0),
        lse.stride(1),
        heads,
        kv_lora_rank,
        rope_dim,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        BLOCK_DR=block_dr,
        FP32_DOT=fp32_dot,
        # fp32 inputs get exact fp32 dots (not TF32) so fp32 models match the reference on GPUs too.
        PRECISION="ieee" if fp32_dot else "tf32",
        num_warps=8 if block_r >= 256 else 4,  # V3's 512-wide latent tile wants more threads per program
        num_stages=2,
    )
    merge_kernel[(batch, heads)](
        partial,
        lse,
        out,
        partial.stride(0),
        partial.stride(1),
        partial.stride(2),
        lse.stride(0),
        lse.stride(1),
        out.stride(0),
        out.stride(1),
        kv_lora_rank,
        NUM_SPLITS=num_splits,
        BLOCK_S=_next_pow2(num_splits, minimum=2),
        BLOCK_R=block_r,
    )
    return out
