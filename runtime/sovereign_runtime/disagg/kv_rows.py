"""Reading and writing a sequence's latent KV rows in the paged cache (pure tensor indexing).

The cache is `[layers, blocks, block_size, kv_dim]`; token position `p` of a sequence lives at block
`block_table[p // block_size]`, offset `p % block_size`. Flattening blocks and offsets gives one slot
index per position, the same slot mapping the attention layers write through.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

# Writes ``rows`` at flat slots ``slot_index`` of one layer: ``writer(layer, slot_index, rows)``. A
# tensor-parallel leader's ``write_kv_rows`` is one (it replicates the write to every rank's cache).
KVRowWriter = Callable[[int, torch.Tensor, torch.Tensor], None]


class StagedCache(Protocol):
    """A cache whose layers live on several pipeline stages (``engine.tensor_parallel.StagedKVCache``):
    the shape and dtype of the whole, rows moved through ``read_rows``/``write_rows``."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def read_rows(self, layer: int, slot_index: torch.Tensor) -> torch.Tensor: ...

    def write_rows(self, layer: int, slot_index: torch.Tensor, rows: torch.Tensor) -> None: ...


KVCache = torch.Tensor | StagedCache


def slots(block_table: list[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """Flat slot indices of positions `[start, end)`."""
    pos = torch.arange(start, end, dtype=torch.int64)
    table = torch.tensor(block_table, dtype=torch.int64)
    return table[pos // block_size] * block_size + pos % block_size


def read_rows(kv_cache: torch.Tensor, block_table: list[int], start: int, end: int) -> torch.Tensor:
    """A copy of positions `[start, end)` for every layer: `[layers, end - start, kv_dim]`."""
    layers, blocks, block_size, dim = kv_cache.shape
    index = slots(block_table, block_size, start, end).to(kv_cache.device)
    return kv_cache.view(layers, blocks * block_size, dim).index_select(1, index)


def read_layer_rows(
    kv_cache: KVCache, block_table: list[int], layer: int, start: int, end: int
) -> torch.Tensor:
    """A copy of layer `layer`'s positions `[start, end)`: `[end - start, kv_dim]` (safe to send while
    later steps overwrite the cache)."""
    layers, blocks, block_size, dim = kv_cache.shape
    if not 0 <= layer < layers:
        raise ValueError(f"layer {layer} is outside [0, {layers})")
    index = slots(block_table, block_size, start, end).to(kv_cache.device)
    if not isinstance(kv_cache, torch.Tensor):
        return kv_cache.read_rows(layer, index)
    return kv_cache[layer].view(blocks * block_size, dim).index_select(0, index)


def write_rows(
    kv_cache: KVCache,
    block_table: list[int],
    layer: int,
    start: int,
    rows: torch.Tensor,
    writer: KVRowWriter | None = None,
) -> None:
    """Store `rows` (`[n, kv_dim]`) as layer `layer`'s KV for positions `[start, start + n)`; through
    `writer` when given (it then owns the write into `kv_cache`)."""
    layers, blocks, block_size, dim = kv_cache.shape
    if rows.ndim != 2 or rows.shape[1] != dim:
        raise ValueError(f"KV rows must be [tokens, {dim}], got {list(rows.shape)}")
    if not 0 <= layer < layers:
        raise ValueError(f"layer {layer} is outside [0, {layers})")
    index = slots(block_table, block_size, start, start + rows.shape[0]).to(kv_cache.device)
    if writer is not None:
        writer(layer, index, rows)
        return
    if not isinstance(kv_cache, torch.Tensor):
        kv_cache.write_rows(layer, index, rows)
        return
    kv_cache[layer].view(blocks * block_size, dim).index_copy_(
        0, index, rows.to(device=kv_cache.device, dtype=kv_cache.dtype)
    )
