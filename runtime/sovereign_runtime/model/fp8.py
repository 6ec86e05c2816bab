"""FP8 block-quantised linear weights (DeepSeek-V3 layout: e4m3 + one fp32 scale per 128×128 block).

``dequantize_fp8_block`` turns a stored weight into a dense one (edge blocks padded, as in DeepSeek's own
``weight_dequant``). ``Fp8Linear`` keeps the e4m3 weight resident, halving weight memory against bf16, and
dequantises it on each call; a fused block-FP8 GEMM would replace that step on GPUs that have one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn


def dequantize_fp8_block(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """e4m3 weight [out, in] × one scale per block (edge blocks padded) → ``dtype``."""
    out_f, in_f = weight.shape
    rows, cols = scale_inv.shape
    if out_f == rows * block[0] and in_f == cols * block[1]:
        # Whole blocks (V3's big matrices): broadcast each scale over its block instead of materialising a
        # weight-sized scale tensor.
        w = weight.float().view(rows, block[0], cols, block[1]) * scale_inv.float()[:, None, :, None]
        return w.view(out_f, in_f).to(dtype)
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:out_f].repeat_interleave(block[1], 1)[:, :in_f]
    return (weight.float() * scale).to(dtype)


class Fp8Linear(nn.Module):
    """A bias-free linear layer whose weight stays FP8 (``weight`` e4m3, ``weight_scale_inv`` fp32)."""

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int] = (128, 128)) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        rows, cols = -(-out_features // block[0]), -(-in_features // block[1])
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn), requires_grad=False
        )
        self.weight_scale_inv = nn.Parameter(
            torch.empty(rows, cols, dtype=torch.float32), requires_grad=False
        )
        # None: compute in the activations' dtype (serving). The output guard sets float32 for one
        # recompute of a sequence whose logits were not finite (``reference_precision``).
        self.compute_dtype: torch.dtype | None = None

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8_block(self.weight, self.weight_scale_inv, self.block, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.compute_dtype
        if dtype is None or dtype == x.dtype:
            return F.linear(x, self.dense_weight(x.dtype))
        return F.linear(x.to(dtype), self.dense_weight(dtype)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 block={self.block}"


def dense_weight(linear: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The weight of an ``nn.Linear`` or ``Fp8Linear`` as a dense ``dtype`` tensor."""
    if isinstance(linear, Fp8Linear):
        return linear.dense_weight(dtype)
    return linear.weight.to(dtype)


def swap_in_fp8_linears(model: nn.Module, names: set[str], block: tuple[int, int]) -> int:
    """Replace the ``nn.Linear`` modules named in ``names`` (module paths) by ``Fp8Linear``; returns the count."""
    swapped = 0
    for path in names:
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        old = getattr(parent, attr)
        if isinstance(old, nn.Linear):
            setattr(parent, attr, Fp8Linear(old.in_features, old.out_features, block))
            swapped += 1
    return swapped


def fp8_linears(model: nn.Module) -> list[Fp8Linear]:
    return [m for m in model.modules() if isinstance(m, Fp8Linear)]


@contextlib.contextmanager
def reference_precision(linears: list[Fp8Linear]) -> Iterator[None]:
    """Within the block the FP8 linears dequantise to float32 and compute in float32 (the slow path)."""
    for m in linears:
        m.compute_dtype = torch.float32
    try:
        yield
    finally:
        for m in linears:
            m.compute_dtype = None
