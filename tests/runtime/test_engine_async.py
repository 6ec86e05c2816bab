"""AsyncEngine: concurrent streams, cancellation frees blocks, validation errors, stats, timestamps."""

from __future__ import annotations

import asyncio
import itertools
import random
import time

import pytest
from sovereign_runtime.engine import RequestOutput, SamplingParams
from sovereign_runtime.engine.async_engine import AsyncEngine
from sovereign_runtime.engine.engine import EngineConfig, LLMEngine
from toy_model import ToyPagedModel


def _async_engine(model: ToyPagedModel, **kw: object) -> AsyncEngine:
    cfg = EngineConfig(**{"block_size": 4, "num_kv_blocks": 64, "max_num_batched_tokens": 16, **kw})
    return AsyncEngine(LLMEngine.from_model(model, cfg))


async def _wait_for(cond, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def test_concurrent_streams_match_reference_and_report_times() -> None:
    model = ToyPagedModel()
    eng = _async_engine(model)
    rng = random.Random(0)
    prompts = [[rng.randint(1, 63) for _ in range(rng.randint(2, 15))] for _ in range(5)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    async def one(p: list[int]) -> list[RequestOutput]:
        return [o async for o in eng.generate(p, params)]

    async def main() -> list[list[RequestOutput]]:
        return await asyncio.gather(*(one(p) for p in prompts))

    try:
        results = asyncio.run(main())
    finally:
        eng.shutdown()
    for p, outs in zip(prompts, results, strict=True):
        tokens = [t for o in outs for t in o.new_token_ids]
        assert tokens == model.reference_greedy(p, 10, eos=None)
        last = outs[-1]
        assert last.finished and last.finish_reason == "length" and not any(o.finished for o in outs[:-1])
        assert (last.prompt_tokens, last.completion_tokens) == (len(p), 10)
        assert last.arrival_time <= last.first_token_time == outs[0].time <= last.time
        assert all(a.time <= b.time for a, b in itertools.pairwise(outs))


def test_cancelling_a_stream_frees_its_blocks() -> None:
    model = ToyPagedModel()
    eng = _async_engine(model, enable_prefix_caching=False)

    async def main() -> None:
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        seen = 0

        async def consume() -> None:
            nonlocal seen
            async for _ in eng.generate(list(range(1, 30)), params, request_id="long"):
                seen += 1

        task = asyncio.create_task(consume())
        await _wait_for(lambda: seen >= 3)
        assert eng.stats().kv_cache_usage > 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _wait_for(lambda: eng.stats().kv_cache_usage == 0.0 and eng.stats().num_requests_running == 0)
        # Breaking out of the loop (closing the iterator) aborts too.
        gen = eng.generate(list(range(1, 30)), params)
        async for _ in gen:
            break
        assert eng.stats().num_requests_running == 1
        await gen.aclose()
        pool = eng.engine.scheduler.pool
        await _wait_for(lambda: pool.num_free == pool.num_blocks)
        await _wait_for(lambda: eng.stats().kv_cache_usage == 0.0 and eng.stats().num_requests_running == 0)

    try:
        asyncio.run(main())
    finally:
        eng.shutdown()


def test_invalid_requests_raise_at_once_and_the_engine_keeps_serving() -> None:
    model = ToyPagedModel()
    eng = _async_engine(model)

    async def first(prompt: list[int], params: SamplingParams) -> RequestOutput:
        async for o in eng.generate(prompt, params):
            return o
        raise AssertionError("no output")

    try:
        with pytest.raises(ValueError, match="context"):
            asyncio.run(first(list(range(1, 60)) * 10, SamplingParams()))
        with pytest.raises(ValueError, match="token ids"):
            asyncio.run(first([1, 999], SamplingParams()))
        with pytest.raises(ValueError, match="at least one token"):
            asyncio.run(first([], SamplingParams()))
        out = asyncio.run(first([1, 2, 3], SamplingParams(temperature=0, max_tokens=1)))
        assert out.finished and len(out.new_token_ids) == 1
        st = eng.stats()
        assert st.prompt_tokens_total == 3 and st.generation_tokens_total == 1
    finally:
        eng.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        asyncio.run(first([1], SamplingParams()))


def test_stats_show_waiting_requests_under_admission_control() -> None:
    model = ToyPagedModel()
    eng = _async_engine(model, num_kv_blocks=12, max_num_seqs=2, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    max_waiting = 0

    async def main() -> None:
        nonlocal max_waiting

        async def run(i: int) -> int:
            n = 0
            async for o in eng.generate([i + 1] * 10, params):
                n += len(o.new_token_ids)
            return n

        tasks = [asyncio.create_task(run(i)) for i in range(5)]
        while not all(t.done() for t in tasks):
            s = eng.stats()
            assert s.num_requests_running <= 2
            max_waiting = max(max_waiting, s.num_requests_waiting)
            await asyncio.sleep(0.002)
        assert [t.result() for t in tasks] == [30] * 5

    try:
        asyncio.run(main())
    finally:
        eng.shutdown()
    assert max_waiting >= 1


def test_a_model_error_fails_the_requests_in_flight_and_the_engine_recovers() -> None:
    class Flaky(ToyPagedModel):
        fail = True

        def forward(self, input_ids, positions):  # type: ignore[no-untyped-def]
            if self.fail:
                raise RuntimeError("boom")
            return super().forward(input_ids, positions)

    model = Flaky()
    eng = _async_engine(model)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    async def run() -> list[int]:
        return [t async for o in eng.generate([1, 2, 3], params) for t in o.new_token_ids]

    try:
        with pytest.raises(RuntimeError, match="boom"):
            asyncio.run(run())
        st = eng.stats()
        assert st.num_requests_running == 0 and st.kv_cache_usage == 0.0
        model.fail = False
        assert asyncio.run(run()) == model.reference_greedy([1, 2, 3], 3, eos=None)
    finally:
        eng.shutdown()
