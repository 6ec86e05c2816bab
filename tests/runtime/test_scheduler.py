"""Scheduler: continuous batching, chunked prefill, admission control, preemption, prefix reuse."""

from __future__ import annotations

import random

import pytest
from sovereign_runtime.engine.sampling import SamplingParams
from sovereign_runtime.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from sovereign_runtime.engine.sequence import Sequence, SequenceStatus

EOS = 0


def _seq(rid: str, prompt: list[int], max_tokens: int = 4, **kw: object) -> Sequence:
    return Sequence(rid, list(prompt), len(prompt), SamplingParams(max_tokens=max_tokens, **kw))


def _sched(num_blocks: int = 64, **kw: object) -> Scheduler:
    cfg = SchedulerConfig(**{"block_size": 4, "max_num_batched_tokens": 16, "max_model_len": 256, **kw})
    return Scheduler(cfg, num_blocks, eos_token_ids={EOS})


def _step(s: Scheduler, token: int | None = None, rng: random.Random | None = None) -> ScheduledBatch:
    batch = s.schedule()
    sampled = [token if token is not None else (rng.randint(1, 9) if rng else 7) for x in batch.sample if x]
    s.update(batch, sampled)
    s.check()
    return batch


def test_decodes_keep_running_while_a_long_prompt_is_chunked() -> None:
    s = _sched(max_num_batched_tokens=8)
    s.add(_seq("a", [1, 2, 3], max_tokens=50))
    b = _step(s)
    assert b.num_new_tokens == [3] and b.sample == [True]
    s.add(_seq("long", list(range(1, 40)), max_tokens=2))
    for i in range(5):  # 39 prompt tokens in chunks of 7 next to the decode
        b = _step(s)
        assert b.seqs[0].request_id == "a" and b.num_new_tokens[0] == 1
        assert b.num_tokens <= 8
        assert b.sample == [True, False], i
    b = _step(s)
    assert b.num_new_tokens == [1, 4] and b.sample == [True, True]
    assert s.requests["long"].num_output_tokens == 1


def test_finish_reasons_and_eos_handling() -> None:
    s = _sched()
    s.add(_seq("len", [1, 2], max_tokens=3))
    s.add(_seq("eos", [1, 3], max_tokens=10))
    s.add(_seq("ign", [1, 4], max_tokens=2, ignore_eos=True))
    s.add(_seq("stop", [1, 5], max_tokens=10, stop_token_ids=[9]))
    s.add(_seq("min", [1, 6], max_tokens=10, min_tokens=2))
    seqs = dict(s.requests)
    batch = s.schedule()
    tokens = {"len": 5, "eos": EOS, "ign": EOS, "stop": 9, "min": EOS}
    s.update(batch, [tokens[q.request_id] for q in batch.seqs])
    assert seqs["eos"].finish_reason == "stop" and seqs["stop"].finish_reason == "stop"
    assert not seqs["ign"].is_finished and not seqs["min"].is_finished and not seqs["len"].is_finished
    while s.has_work:
        _step(s)
    assert seqs["len"].finish_reason == "length" and seqs["len"].output_token_ids == [5, 7, 7]
    assert seqs["ign"].output_token_ids == [EOS, 7]
    assert s.pool.num_free + s.cache.num_evictable_blocks == s.pool.num_blocks


def test_context_limit_and_oversized_requests() -> None:
    s = _sched(num_blocks=4, max_model_len=12)
    with pytest.raises(ValueError, match="context"):
        s.add(_seq("x", list(range(1, 13))))
    with pytest.raises(ValueError, match="KV cache"):
        _sched(num_blocks=2).add(_seq("y", list(range(1, 8)), max_tokens=5))
    s.add(_seq("z", list(range(1, 10)), max_tokens=100))
    while s.has_work:
        _step(s)
    assert s.num_preemptions == 0
    with pytest.raises(ValueError, match="already in use"):
        s.add(_seq("a", [1]))
        s.add(_seq("a", [1]))


def test_admission_control_queues_instead_of_overcommitting() -> None:
    s = _sched(num_blocks=6, enable_prefix_caching=False, max_num_batched_tokens=64)
    for i in range(4):
        s.add(_seq(f"r{i}", [i + 1] * 8, max_tokens=4))  # 2 blocks each for the prompt
    b = s.schedule()
    assert [q.request_id for q in b.seqs] == ["r0", "r1", "r2"] and len(s.waiting) == 1
    s.update(b, [7] * 3)
    s.check()
    assert s.stats().num_requests_waiting == 1 and s.stats().prompt_tokens_waiting == 8


def test_preemption_when_decodes_run_out_and_everything_finishes() -> None:
    s = _sched(num_blocks=6, enable_prefix_caching=False, max_num_batched_tokens=64)
    for i in range(3):
        s.add(_seq(f"r{i}", [i + 1] * 7, max_tokens=6))
    finished: list[Sequence] = []
    seqs = dict(s.requests)
    for _ in range(100):
        if not s.has_work:
            break
        b = s.schedule()
        finished += s.update(b, [7] * sum(b.sample))
        s.check()
    assert s.num_preemptions > 0
    assert {q.request_id for q in finished} == {"r0", "r1", "r2"}
    assert all(q.output_token_ids == [7] * 6 for q in seqs.values())
    assert s.pool.num_free == 6


def test_prefix_reuse_at_admission_and_counters() -> None:
    s = _sched()
    shared = list(range(1, 14))  # 13 tokens: 3 full pages
    s.add(_seq("a", [*shared, 50], max_tokens=2))
    while s.has_work:
        _step(s)
    s.add(_seq("b", [*shared, 60, 61], max_tokens=2))
    b = s.schedule()
    seq = b.seqs[0]
    assert seq.num_cached_tokens == 12 and b.num_new_tokens == [3]
    assert s.cache.root.lock_ref > 1  # the reused prefix is locked while b runs
    s.update(b, [7])
    s.check()
    st = s.stats()
    assert st.prefix_cache_queries == 14 + 15 and st.prefix_cache_hits == 12
    # A prompt that is entirely cached still computes its last token.
    s2 = _sched()
    s2.add(_seq("a", list(range(1, 9)), max_tokens=1))
    _step(s2)
    s2.add(_seq("b", list(range(1, 9)), max_tokens=1))
    b = s2.schedule()
    assert b.seqs[0].num_cached_tokens == 4 and b.num_new_tokens == [4]


def test_abort_frees_blocks_at_once() -> None:
    s = _sched(num_blocks=16)
    s.add(_seq("a", list(range(1, 20)), max_tokens=30))
    s.add(_seq("w", list(range(1, 20)), max_tokens=30))
    _step(s)
    assert s.pool.num_used > 0
    aborted = s.abort("a")
    assert (
        aborted is not None and aborted.finish_reason == "abort" and aborted.status is SequenceStatus.FINISHED
    )
    s.abort("w")
    s.check()
    assert s.pool.num_free + s.cache.num_evictable_blocks == 16 and not s.has_work
    assert s.abort("a") is None and s.abort("nope") is None


@pytest.mark.parametrize("seed", range(6))
def test_random_request_cancel_finish_sequences(seed: int) -> None:
    rng = random.Random(seed)
    caching = seed % 2 == 0
    s = _sched(num_blocks=rng.randint(12, 30), enable_prefix_caching=caching, max_num_seqs=rng.randint(2, 8))
    prefixes = [[rng.randint(1, 9) for _ in range(rng.randint(0, 12))] for _ in range(3)]
    n = 0
    live: list[str] = []
    for _ in range(300):
        op = rng.random()
        if op < 0.3:
            prompt = rng.choice(prefixes) + [rng.randint(1, 9) for _ in range(rng.randint(1, 10))]
            rid = f"r{n}"
            n += 1
            try:
                s.add(_seq(rid, prompt, max_tokens=rng.randint(1, 12)))
                live.append(rid)
            except ValueError:
                pass
        elif op < 0.4 and live:
            s.abort(live.pop(rng.randrange(len(live))))
        else:
            _step(s, rng=rng)
            live = [r for r in live if r in s.requests]
        stats = s.stats()
        assert stats.num_requests_running <= s.config.max_num_seqs
        assert 0.0 <= stats.kv_cache_usage <= 1.0
    while s.has_work:
        _step(s, rng=rng)
    evictable = s.cache.num_evictable_blocks if caching else 0
    assert s.pool.num_free + evictable == s.pool.num_blocks
    if caching:
        s.cache.reset()
        assert s.pool.num_free == s.pool.num_blocks


def test_prompt_pages_are_shared_while_the_first_request_still_runs() -> None:
    s = _sched(max_num_batched_tokens=8)
    shared = list(range(1, 17))  # 16 tokens = 4 full pages
    s.add(_seq("a", [*shared, 50], max_tokens=20))
    s.add(_seq("b", [*shared, 60], max_tokens=20))
    b1 = _step(s)
    assert [q.request_id for q in b1.seqs] == ["a"]  # the budget went to a's first chunk
    _step(s)  # a's second chunk: its 4 prompt pages are now in the cache, locked by a
    assert s.cache.num_cached_blocks == 4 and s.cache.num_evictable_blocks == 0
    b3 = _step(s)
    seqs = {q.request_id: q for q in b3.seqs}
    assert seqs["b"].num_cached_tokens == 16  # reused while a is still running
    assert b3.num_new_tokens == [1, 1]
    while s.has_work:
        _step(s)
    assert s.cache.num_evictable_blocks == s.cache.num_cached_blocks
