"""Rotary position embedding with YaRN scaling, in DeepSeek-V3's interleaved-pair convention.

The checkpoint's rope dimensions form interleaved pairs (x0, x1), (x2, x3), ... each rotated by one
frequency. Like HF transformers, the rotated result is written de-interleaved (all first elements of the
pairs, then all second elements). Queries and keys use the same layout, so dot products equal the
interleaved form; matching HF's layout keeps the cached k_pe bit-compatible with it.
"""

from __future__ import annotations

import math

import torch

from .config import RopeConfig, yarn_mscale


def _yarn_correction_dim(rotations: float, dim: int, base: float, original_len: int) -> float:
    return (dim * math.log(original_len / (rotations * 2 * math.pi))) / (2 * math.log(base))


def rope_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] (fp32) and the factor that scales cos and sin."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    extrapolation = 1.0 / pos_freqs
    if rope.rope_type == "default":
        return extrapolation, 1.0
    interpolation = 1.0 / (rope.factor * pos_freqs)
    original = int(rope.original_max_position_embeddings or 4096)
    low = _yarn_correction_dim(rope.beta_fast, dim, rope.theta, original)
    high = _yarn_correction_dim(rope.beta_slow, dim, rope.theta, original)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    # High-frequency dims (ramp 0) keep their frequency, low-frequency dims (ramp 1) are interpolated.
    # Written as HF writes it so the frequencies agree to the last bit.
    keep = 1 - ramp
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    if rope.attention_factor is not None:
        attention_factor = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(
            rope.factor, rope.mscale_all_dim
        )
    else:
        attention_factor = yarn_mscale(rope.factor)
    return inv_freq, attention_factor


class RotaryEmbedding(torch.nn.Module):
    """Applies RoPE by absolute position; the cos/sin table is computed lazily per device (not a weight)."""

    def __init__(self, rope: RopeConfig, dim: int, max_positions: int) -> None:
        super().__init__()
        self.rope = rope
        self.dim = dim
        self.inv_freq_cpu, self.attention_factor = rope_inv_freq(rope, dim)
        self._table_len = max(int(max_positions), 1)
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._last: tuple[torch.Tensor, int, torch.Tensor, torch.Tensor] | None = None

    def _table(self, device: torch.device, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._tables.get(device)
        if table is None or table[0].shape[0] < needed:
            length = max(self._table_len, needed)
            positions = torch.arange(length, dtype=torch.float32, device="cpu")
            freqs = positions[:, None] * self.inv_freq_cpu[None, :]
            table = (
                (freqs.cos() * self.attention_factor).to(device),
                (freqs.sin() * self.attention_factor).to(device),
            )
            self._tables[device] = table
            self._table_len = length
        return table

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [num_tokens, dim/2] in fp32 for the given absolute positions."""
        # Every layer of a forward pass asks for the same positions tensor: look it up once (this also
        # avoids one host sync per layer on GPUs). The version counter catches in-place refills of a reused
        # buffer.
        try:
            version: int | None = positions._version
        except RuntimeError:  # inference-mode tensors keep no version counter: no memo for them
            version = None
        last = self._last
        if version is not None and last is not None and last[0] is positions and last[1] == version:
            return last[2], last[3]
        needed = int(positions.max().item()) + 1 if positions.numel() else 1
        cos, sin = self._table(positions.device, needed)
        result = (cos[positions], sin[positions])
        self._last = None if version is None else (positions, version, *result)
        return result

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate interleaved pairs of ``x [tokens, ..., dim]``; ``cos``/``sin`` are [tokens, dim/2]."""
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
        cos = cos.view(shape).to(x.dtype)
        sin = sin.view(shape).to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
