"""Tensor parallelism for the model: which weights are split across ranks, and the all-reduce after them.

Megatron-style, as nano-vllm / vLLM / SGLang shard DeepSeek under TP:

- MLA: ``q_proj`` / ``q_b_proj`` and ``kv_b_proj`` are column-parallel by heads (each rank owns
  ``num_attention_heads / N`` heads, whose rows are contiguous in the checkpoint), ``o_proj`` is row-parallel.
  ``q_a_proj``, ``kv_a_proj_with_mqa`` and the norms are replicated: the latent KV row (c_kv ‖ k_pe) is the
  same for every head, so each rank computes and caches the full latent for its heads.
- Dense MLP and shared experts: ``gate_proj`` / ``up_proj`` column-parallel, ``down_proj`` row-parallel.
- Routed experts: TP-MoE, every expert's intermediate dim is split (not expert parallelism). Every rank then
  routes identically with the replicated router and runs the same experts on the same tokens, so there is no
  token dispatch/combine and no load imbalance between ranks; V3's 2048-wide experts split into 256-wide
  slices at TP 8, still whole 128-row FP8 blocks.
- Embedding, lm_head, the MTP ``eh_proj`` and shared head: replicated (simplest; costs vocab × hidden × 2
  copies' worth of memory per rank, about 1.9 GB in bf16 for V3).

A decoder layer ends each of its two halves (attention, MLP/MoE) with one all-reduce of the partial sums;
the MoE adds its shared and routed partial sums before that one reduction.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .config import ModelConfig


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group (``torch.distributed``'s default group)."""

    rank: int = 0
    size: int = 1


# Checkpoint-relative suffixes of the split weights and the dimension they are split along.
_COLUMN_PARALLEL = re.compile(r"\.(q_proj|q_b_proj|kv_b_proj|gate_proj|up_proj)\.(weight|weight_scale_inv)$")
_ROW_PARALLEL = re.compile(r"\.(o_proj|down_proj)\.(weight|weight_scale_inv)$")


def shard_dim(name: str) -> int | None:
    """The dimension along which parameter ``name`` is split across ranks (0 or 1), or None if replicated.

    The router (``mlp.gate.weight``) does not match ``gate_proj`` and stays replicated.
    """
    if _COLUMN_PARALLEL.search(name):
        return 0
    if _ROW_PARALLEL.search(name):
        return 1
    return None


def shard(tensor: torch.Tensor, dim: int, tp: TensorParallel) -> torch.Tensor:
    """This rank's contiguous 1/N slice of ``tensor`` along ``dim`` (a copy, so the full tensor can go)."""
    size = tensor.shape[dim] // tp.size
    return tensor.narrow(dim, tp.rank * size, size).contiguous()


def fp8_shard_is_block_aligned(full_dim: int, tp_size: int, block: int) -> bool:
    """Whether an FP8 weight split into ``tp_size`` slices of ``full_dim`` keeps whole 128-wide scale blocks.

    Aligned slices keep their e4m3 values and their rows/columns of ``weight_scale_inv`` unchanged; otherwise
    the weight is dequantised on the CPU first and the dense copy is split (the loader's fallback).
    """
    return full_dim % tp_size == 0 and (full_dim // tp_size) % block == 0


def tensor_parallel_problem(config: ModelConfig, size: int) -> str | None:
    """Why ``size`` ranks cannot split this model (the dims that must divide, and the valid sizes), or None."""
    dims: dict[str, int] = {"num_attention_heads": config.num_attention_heads}
    num_layers = config.num_hidden_layers + config.num_nextn_predict_layers
    if any(not config.is_moe_layer(i) for i in range(num_layers)):
        dims["intermediate_size"] = config.intermediate_size
    if any(config.is_moe_layer(i) for i in range(num_layers)):
        dims["moe_intermediate_size"] = config.moe_intermediate_size
    if all(value % size == 0 for value in dims.values()):
        return None
    limit = min(dims.values())
    valid = [n for n in range(1, limit + 1) if all(value % n == 0 for value in dims.values())]
    named = ", ".join(f"{key} ({value})" for key, value in dims.items())
    return (
        f"--tensor-parallel-size {size}: must divide {named}; "
        f"valid sizes for this model: {', '.join(map(str, valid))}"
    )


def reduce_partial_sums(x: torch.Tensor, tp_size: int, group: Any = None) -> torch.Tensor:
    """Sum a row-parallel layer's partial outputs over the ranks of ``group`` (in place; None: the default
    group); a no-op without TP."""
    if tp_size > 1:
        dist.all_reduce(x, group=group)
    return x


def set_tensor_parallel_group(model: nn.Module, group: Any) -> None:
    """Reduce every decoder layer's partial sums (MTP layers included) over ``group``: under pipeline
    parallelism each stage's ranks form their own tensor-parallel group."""
    for module in model.modules():
        if hasattr(module, "tp_group") and hasattr(module, "self_attn"):
            module.tp_group = group
