"""The engine serving the real DeepSeek-V3 model equals HF transformers' greedy generate, token for token.

Prompts are served concurrently (continuous batching, chunked prefill across steps, small pages), so the
comparison covers the scheduler, block tables and prefix cache, not only the model.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path

import pytest
from checkpoints import hf_greedy
from sovereign_runtime.engine import SamplingParams
from sovereign_runtime.engine.async_engine import AsyncEngine
from sovereign_runtime.engine.engine import EngineConfig, LLMEngine

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _prompts(n: int, seed: int, vocab: int = 256, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(2, vocab) for _ in range(shared)]
    return [prefix + [rng.randrange(2, vocab) for _ in range(rng.randint(3, 24))] for _ in range(n)]


def _hf_greedy(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy(path, prompts, NEW_TOKENS)


def _engine(path: Path, **kw: object) -> LLMEngine:
    cfg = EngineConfig(**{"block_size": 4, "num_kv_blocks": 256, "max_num_batched_tokens": 24, **kw})
    return LLMEngine.from_pretrained(path, cfg)


@pytest.mark.parametrize(
    "options",
    [
        {},  # q_lora_rank set, nonzero router bias
        {"q_lora_rank": None},
        {"yarn": True},
        {"yarn": True, "rope_key": "rope_scaling", "router_bias": False},
        {"fp8": True},  # block-quantised weights vs HF on the dequantised weights
    ],
    ids=["q_lora+bias", "no_q_lora", "yarn", "yarn_rope_scaling_nobias", "fp8"],
)
def test_concurrent_greedy_equals_hf(tiny_checkpoint_factory: Callable[..., Path], options: dict) -> None:
    path = tiny_checkpoint_factory(**options)
    prompts = _prompts(4, seed=len(options), shared=9)
    want = _hf_greedy(path, prompts)
    eng = _engine(path)
    got = eng.generate(prompts, GREEDY)
    assert got == want
    st = eng.stats()
    assert st.kv_cache_usage == 0.0 and st.generation_tokens_total == 4 * NEW_TOKENS


def test_async_engine_prefix_cache_and_cancel(tiny_checkpoint: Path) -> None:
    prompts = _prompts(3, seed=7, shared=13)
    want = _hf_greedy(tiny_checkpoint, prompts)
    eng = AsyncEngine(_engine(tiny_checkpoint, max_num_batched_tokens=64))

    async def run(p: list[int]) -> tuple[list[int], int]:
        tokens, cached = [], 0
        async for o in eng.generate(p, GREEDY):
            tokens += o.new_token_ids
            cached = o.cached_tokens
        return tokens, cached

    async def main() -> None:
        # First one alone (fills the cache), then the other two concurrently: they hit the shared pages.
        first, cached0 = await run(prompts[0])
        assert first == want[0] and cached0 == 0
        rest = await asyncio.gather(run(prompts[1]), run(prompts[2]))
        assert [t for t, _ in rest] == want[1:]
        assert all(c == 12 for _, c in rest)  # three full 4-token pages of the 13-token shared prefix
        st = eng.stats()
        assert st.prefix_cache_hits == 24 and st.prefix_cache_hit_rate > 0
        # Cancel a long request mid-stream: its blocks return at once.
        gen = eng.generate(
            prompts[0] + [5, 6], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        )
        n = 0
        async for _ in gen:
            n += 1
            if n == 5:
                break
        assert eng.stats().kv_cache_usage > 0
        await gen.aclose()
        for _ in range(2000):  # the engine thread frees the blocks before its next step
            st = eng.stats()
            if st.num_requests_running == 0 and st.kv_cache_usage == 0.0:
                break
            await asyncio.sleep(0.005)
        assert st.num_requests_running == 0 and st.kv_cache_usage == 0.0
        pool = eng.engine.scheduler.pool
        assert pool.num_free + eng.engine.scheduler.cache.num_evictable_blocks == pool.num_blocks

    try:
        asyncio.run(main())
    finally:
        eng.shutdown()
