"""KV block pool bookkeeping and capacity planning."""

from __future__ import annotations

import random

import pytest
import torch
from sovereign_runtime.engine.block_manager import BlockPool, KVLayout, OutOfBlocks, plan_num_blocks


def test_allocate_free_and_refcounts() -> None:
    pool = BlockPool(8)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free == 5
    pool.incref(a[:1])
    assert pool.decref(a) == 2 and pool.num_free == 7  # a[0] still referenced once
    assert pool.decref(a[:1]) == 1 and pool.num_free == 8
    pool.check()


def test_double_free_and_overallocation_are_errors() -> None:
    pool = BlockPool(2)
    a = pool.allocate(2)
    with pytest.raises(OutOfBlocks):
        pool.allocate(1)
    pool.decref(a)
    with pytest.raises(RuntimeError, match="double free"):
        pool.decref(a[:1])
    with pytest.raises(RuntimeError, match="incref of free"):
        pool.incref(a[:1])


def test_random_ops_keep_invariants() -> None:
    rng = random.Random(0)
    pool = BlockPool(32)
    held: list[int] = []  # one entry per reference we hold
    for _ in range(2000):
        op = rng.random()
        if op < 0.4 and pool.num_free:
            held += pool.allocate(rng.randint(1, pool.num_free))
        elif op < 0.6 and held:
            b = rng.choice(held)
            pool.incref([b])
            held.append(b)
        elif held:
            b = held.pop(rng.randrange(len(held)))
            pool.decref([b])
        pool.check()
        assert pool.num_used == len(set(held))
    pool.decref(held)
    assert pool.num_free == 32


def test_layout_bytes_match_deepseek_v3() -> None:
    # REFERENCE.md: 576 values per token per layer, 61 layers, bf16 -> 70,272 bytes per token.
    layout = KVLayout(num_layers=61, block_size=64, kv_cache_dim=576, dtype=torch.bfloat16)
    assert layout.bytes_per_token == 70_272
    assert layout.bytes_per_block == 70_272 * 64


def test_plan_num_blocks_precedence_and_errors() -> None:
    layout = KVLayout(num_layers=2, block_size=16, kv_cache_dim=64, dtype=torch.float32)
    assert layout.bytes_per_block == 2 * 16 * 64 * 4
    assert plan_num_blocks(layout, "cpu", num_kv_blocks=7) == 7
    assert plan_num_blocks(layout, "cpu", kv_cache_gib=1 / 1024) == (1 << 20) // layout.bytes_per_block
    # From free RAM, capped by what the engine can use.
    assert plan_num_blocks(layout, "cpu", max_useful_blocks=100) == 100
    assert plan_num_blocks(layout, "cpu", memory_fraction=1e-6) > 0
    with pytest.raises(ValueError, match="num_kv_blocks"):
        plan_num_blocks(layout, "cpu", num_kv_blocks=0)
    with pytest.raises(ValueError, match="kv_cache_gib"):
        plan_num_blocks(layout, "cpu", kv_cache_gib=-1)
    with pytest.raises(ValueError, match="kv_cache_gib"):
        plan_num_blocks(layout, "cpu", kv_cache_gib=1e-12)
