"""Scheduler side of remote prefill: reserve blocks, commit as a decode, fall back, abort; no leaks."""

from __future__ import annotations

from sovereign_runtime.engine.sampling import SamplingParams
from sovereign_runtime.engine.scheduler import Scheduler, SchedulerConfig
from sovereign_runtime.engine.sequence import Sequence, SequenceStatus


def _seq(rid: str, prompt: list[int], max_tokens: int = 4) -> Sequence:
    return Sequence(rid, list(prompt), len(prompt), SamplingParams(max_tokens=max_tokens))


def _sched(num_blocks: int = 16) -> Scheduler:
    cfg = SchedulerConfig(block_size=4, max_num_batched_tokens=16, max_model_len=64)
    return Scheduler(cfg, num_blocks, eos_token_ids={0})


def _run_to_end(s: Scheduler) -> None:
    for _ in range(100):
        if not s.has_work:
            return
        batch = s.schedule()
        s.update(batch, [7 for x in batch.sample if x])
        s.check()
    raise AssertionError("scheduler did not drain")


def test_reserved_prompt_becomes_a_decode_and_its_pages_are_cached_after() -> None:
    s = _sched()
    seq = _seq("r", list(range(1, 11)), max_tokens=3)  # 10 tokens -> 3 blocks of 4
    assert s.reserve(seq)
    s.check()
    assert len(seq.block_table) == 3 and seq.num_cached_tokens == 0
    assert not s.has_work  # a reserved request is not scheduled while its KV is in transfer
    assert s.commit("r", 5) is seq
    s.check()
    assert seq.status is SequenceStatus.RUNNING and seq.output_token_ids == [5]
    batch = s.schedule()
    assert batch.seqs == [seq] and batch.num_new_tokens == [1] and batch.sample == [True]
    s.update(batch, [6])
    _run_to_end(s)
    assert seq.output_token_ids == [5, 6, 7] and seq.finish_reason == "length"
    # The received pages entered the prefix cache: the same prompt now reuses two full pages.
    again = _seq("again", list(range(1, 11)))
    assert s.reserve(again)
    assert again.num_cached_tokens == 8 and len(again.block_table) == 3
    s.abort("again")
    s.check()
    assert s.pool.num_free + s.cache.num_evictable_blocks == s.pool.num_blocks


def test_commit_of_a_one_token_request_finishes_at_once() -> None:
    s = _sched()
    seq = _seq("one", [1, 2, 3], max_tokens=1)
    assert s.reserve(seq)
    s.commit("one", 9)
    s.check()
    assert seq.finish_reason == "length" and "one" not in s.requests and not s.running


def test_fallback_queues_a_local_prefill_and_abort_frees_a_reservation() -> None:
    s = _sched()
    seq = _seq("f", list(range(1, 8)), max_tokens=2)
    assert s.reserve(seq)
    assert s.prefill_locally("f")
    s.check()
    assert not seq.block_table and list(s.waiting) == [seq]
    _run_to_end(s)
    assert seq.output_token_ids == [7, 7]
    gone = _seq("gone", [1, 2, 3, 4, 5])
    assert s.reserve(gone)
    assert s.abort("gone") is gone and gone.finish_reason == "abort"
    assert s.commit("gone", 1) is None and not s.prefill_locally("gone")
    s.check()
    assert s.pool.num_free + s.cache.num_evictable_blocks == s.pool.num_blocks


def test_reserve_refuses_when_the_pool_cannot_hold_the_prompt() -> None:
    s = _sched(num_blocks=4)
    big = _seq("big", list(range(1, 14)), max_tokens=1)  # 4 blocks
    assert s.reserve(big)
    other = _seq("other", [1, 2, 3, 4, 5], max_tokens=1)
    assert not s.reserve(other)
    s.check()
    assert not other.block_table and "other" not in s.requests
