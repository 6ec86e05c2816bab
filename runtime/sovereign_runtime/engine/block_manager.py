"""Bookkeeping for the paged latent KV pool: which blocks are free and who references each one.

The pool is pure bookkeeping over block ids ``0..num_blocks-1``; the tensor itself lives in the model
runner. A block is referenced by every running sequence whose block table lists it and by the radix
cache when it holds a cached page; it returns to the free list when the last reference is dropped.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass

import torch


class OutOfBlocks(RuntimeError):
    """Raised by :meth:`BlockPool.allocate` when fewer blocks are free than asked for."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs: list[int] = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, each with one reference held by the caller."""
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} KV blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._refs[b] <= 0:
                raise RuntimeError(f"incref of free KV block {b}")
            self._refs[b] += 1

    def decref(self, blocks: list[int]) -> int:
        """Drop one reference to each block; returns how many went back to the free list."""
        freed = 0
        for b in blocks:
            if self._refs[b] <= 0:
                raise RuntimeError(f"double free of KV block {b}")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)
                freed += 1
        return freed

    def check(self) -> None:
        """Invariant: the free list holds exactly the blocks with no reference, once each."""
        free = set(self._free)
        assert len(free) == len(self._free), "block on the free list twice"
        for b, r in enumerate(self._refs):
            assert r >= 0, f"negative ref count on block {b}"
            assert (r == 0) == (b in free), f"block {b}: refs={r}, on free list={b in free}"


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    block_size: int
    kv_cache_dim: int  # kv_lora_rank + qk_rope_head_dim
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.kv_cache_dim * torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


def available_host_memory() -> int:
    """MemAvailable from /proc/meminfo (what the kernel can hand out without swapping)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def plan_num_blocks(
    layout: KVLayout,
    device: torch.device | str,
    *,
    num_kv_blocks: int | None = None,
    kv_cache_gib: float | None = None,
    memory_fraction: float | None = None,
    max_useful_blocks: int | None = None,
) -> int:
    """How many KV blocks to allocate.

    Precedence: an explicit ``num_kv_blocks``; an explicit ``kv_cache_gib``; otherwise a fraction of the
    free memory (``torch.cuda.mem_get_info`` on GPU, after weights are loaded, default 0.9 of what is
    free; MemAvailable on CPU, default 0.25 because the host also runs everything else), capped at
    ``max_useful_blocks`` so a tiny model does not pin a whole device's memory (or gigabytes of RAM).
    """
    if num_kv_blocks is not None:
        if num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {num_kv_blocks}")
        return num_kv_blocks
    if kv_cache_gib is not None:
        if kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be positive, got {kv_cache_gib}")
        budget = int(kv_cache_gib * (1 << 30))
    else:
        dev = torch.device(device)
        if dev.type == "cuda":
            free, _total = torch.cuda.mem_get_info(dev)
            budget = int(free * (memory_fraction if memory_fraction is not None else 0.9))
        else:
            budget = int(available_host_memory() * (memory_fraction if memory_fraction is not None else 0.25))
        if max_useful_blocks is not None:
            budget = min(budget, max_useful_blocks * layout.bytes_per_block)
    n = budget // layout.bytes_per_block
    if n < 1:
        raise ValueError(
            f"KV cache budget of {budget} bytes holds no block of {layout.bytes_per_block} bytes; "
            "raise kv_cache_gib or the memory fraction"
        )
    return n
