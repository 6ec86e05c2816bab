"""Model runner + engine against a toy model that reads the attention context (no DeepSeek weights)."""

from __future__ import annotations

import random

import pytest
import torch
from sovereign_runtime.engine import SamplingParams
from sovereign_runtime.engine.engine import EngineConfig, LLMEngine
from sovereign_runtime.engine.scheduler import ScheduledBatch
from sovereign_runtime.engine.sequence import Sequence
from sovereign_runtime.model.context import attention_context
from toy_model import ToyPagedModel

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _engine(model: ToyPagedModel, **kw: object) -> LLMEngine:
    cfg = EngineConfig(**{"block_size": 4, "num_kv_blocks": 128, "max_num_batched_tokens": 32, **kw})
    return LLMEngine.from_model(model, cfg)


def _prompts(n: int, seed: int = 0, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randint(1, 63) for _ in range(shared)]
    return [prefix + [rng.randint(1, 63) for _ in range(rng.randint(1, 20))] for _ in range(n)]


def test_metadata_for_a_mixed_batch() -> None:
    model = ToyPagedModel()
    eng = _engine(model)
    runner = eng.runner
    a = Sequence("a", list(range(1, 11)), 10, GREEDY)
    a.num_computed_tokens, a.block_table = 9, [5, 2, 7]  # decode of token 9 (page 2, offset 1)
    b = Sequence("b", list(range(1, 8)), 7, GREEDY)
    b.num_computed_tokens, b.block_table = 2, [3, 4]  # chunk of prompt tokens 2..5, mid-prompt
    ids, meta, rows = runner.prepare(ScheduledBatch([a, b], [1, 4], [True, False]))
    assert ids.tolist() == [10, 3, 4, 5, 6]
    assert meta.positions.tolist() == [9, 2, 3, 4, 5]
    assert meta.slot_mapping.tolist() == [7 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3, 4 * 4 + 0, 4 * 4 + 1]
    assert meta.query_start_loc.tolist() == [0, 1, 5]
    assert meta.context_lens.tolist() == [10, 6]
    assert meta.block_tables.tolist() == [[5, 2, 7], [3, 4, -1]]
    assert (meta.max_query_len, meta.max_context_len, meta.block_size) == (4, 10, 4)
    assert rows == [0]  # no logits for the mid-prompt chunk


def test_prefill_logits_match_the_uncached_reference() -> None:
    model = ToyPagedModel()
    eng = _engine(model)
    prompt = _prompts(1)[0]
    seq = eng.make_sequence(prompt, GREEDY)
    eng.add_sequence(seq)
    batch = eng.scheduler.schedule()
    ids, meta, _ = eng.runner.prepare(batch)
    with attention_context(meta):
        hidden = model(ids, meta.positions)
    torch.testing.assert_close(model.compute_logits(hidden), model.reference_logits(prompt))


@pytest.mark.parametrize(
    "kw",
    [
        {},  # plenty of room, prompts in one chunk
        {"max_num_batched_tokens": 5},  # chunked prefill next to decodes
        {"num_kv_blocks": 14, "max_num_batched_tokens": 64},  # tight pool: admission control, preemption
        {"enable_prefix_caching": False, "max_num_seqs": 3},
    ],
)
def test_concurrent_greedy_equals_reference(kw: dict) -> None:
    torch.manual_seed(0)
    model = ToyPagedModel()
    eng = _engine(model, **kw)
    prompts = _prompts(6, shared=9)
    got = eng.generate(prompts, GREEDY)
    want = [model.reference_greedy(p, GREEDY.max_tokens, eos=None) for p in prompts]
    assert got == want
    eng.scheduler.check()
    if kw.get("num_kv_blocks") == 14:
        assert eng.stats().num_preemptions > 0
    st = eng.stats()
    assert st.num_requests_running == st.num_requests_waiting == 0 and st.kv_cache_usage == 0.0
    assert st.generation_tokens_total == 6 * GREEDY.max_tokens


def test_prefix_cache_hit_gives_identical_output() -> None:
    model = ToyPagedModel()
    eng = _engine(model)
    p1, p2 = _prompts(2, seed=3, shared=17)
    first = eng.generate([p1], GREEDY)[0]
    rid = eng.add_request(p2, GREEDY)
    out: list[int] = []
    cached = None
    while eng.has_unfinished():
        for o in eng.step():
            out += o.new_token_ids
            cached = o.cached_tokens
    assert cached == 16  # four full pages of the shared 17-token prefix
    assert out == model.reference_greedy(p2, GREEDY.max_tokens, eos=None)
    assert first == model.reference_greedy(p1, GREEDY.max_tokens, eos=None)
    st = eng.stats()
    assert st.prefix_cache_hits == 16 and st.prefix_cache_queries == len(p1) + len(p2)
    assert rid not in eng.scheduler.requests


def test_eos_seed_and_abort() -> None:
    model = ToyPagedModel()
    eng = _engine(model)
    prompt = _prompts(1, seed=5)[0]
    ref = model.reference_greedy(prompt, 40, eos=0)
    out = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=40))[0]
    assert out == ref
    sampled = SamplingParams(temperature=1.0, seed=42, max_tokens=10, ignore_eos=True)
    a, b = eng.generate([prompt, prompt], sampled)
    assert a == b  # same seed, same tokens, even in one batch
    rid = eng.add_request(prompt, SamplingParams(max_tokens=100))
    eng.step()
    assert eng.scheduler.pool.num_used > 0
    out_abort = eng.abort(rid)
    assert out_abort is not None and out_abort.finished and out_abort.finish_reason == "abort"
    st = eng.stats()
    assert st.kv_cache_usage == 0.0 and not eng.has_unfinished()


def test_logprobs_in_outputs_match_the_reference() -> None:
    model = ToyPagedModel()
    eng = _engine(model)
    prompt = _prompts(1, seed=9)[0]
    eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    tokens = list(prompt)
    for o in outs:
        ref = torch.log_softmax(model.reference_logits(tokens)[-1], -1)
        (lp,) = o.new_logprobs
        assert lp.token_id == o.new_token_ids[0] == int(ref.argmax())
        assert abs(lp.logprob - ref.max().item()) < 1e-4
        assert [t for t, _ in lp.top] == ref.topk(2).indices.tolist()
        tokens += o.new_token_ids


def test_logit_bias_per_sequence_in_one_batch_and_vocab_bound() -> None:
    model = ToyPagedModel()
    eng = _engine(model)
    a, b, c = _prompts(3, seed=11)
    ref_b = model.reference_greedy(b, 6, eos=None)
    ref_c = model.reference_greedy(c, 6, eos=None)
    greedy6 = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    forced = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={"5": 100})
    banned = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={t: -100 for t in ref_b})
    rids = [eng.add_request(a, forced), eng.add_request(b, banned), eng.add_request(c, greedy6)]
    got: dict[str, list[int]] = {rid: [] for rid in rids}
    while eng.has_unfinished():
        for out in eng.step():
            got[out.request_id] += out.new_token_ids
    assert got[rids[0]] == [5] * 6 != model.reference_greedy(a, 6, eos=None)
    assert len(got[rids[1]]) == 6 and not set(got[rids[1]]) & set(ref_b)
    assert got[rids[2]] == ref_c  # the unbiased neighbour is untouched
    with pytest.raises(ValueError, match=r"logit_bias token ids must be in \[0, "):
        eng.make_sequence(a, SamplingParams(logit_bias={eng.vocab_size: 1}))


def _penalized_reference(model: ToyPagedModel, prompt: list[int], n: int, sp: SamplingParams) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        logits = model.reference_logits(prompt + out)[-1].clone()
        for token in set(prompt + out):
            value = float(logits[token])
            r = sp.repetition_penalty
            logits[token] = value / r if value > 0 else value * r
        for token in set(out):
            logits[token] -= sp.presence_penalty + sp.frequency_penalty * out.count(token)
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize("kw", [{}, {"num_kv_blocks": 14, "max_num_batched_tokens": 5}])
def test_penalties_count_each_sequences_own_output_in_a_batch(kw: dict) -> None:
    """Beside unpenalized neighbours, through chunked prefill and preemption: each penalized
    sequence's tokens are the greedy choice after its own output so far is penalized."""
    model = ToyPagedModel()
    eng = _engine(model, **kw)
    prompts = _prompts(5, seed=5, shared=6)
    params = [
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, frequency_penalty=2.0),
        GREEDY,
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, presence_penalty=1.5),
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, presence_penalty=-2.0),
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.8),
    ]
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    got: dict[str, list[int]] = {rid: [] for rid in rids}
    while eng.has_unfinished():
        for out in eng.step():
            got[out.request_id] += out.new_token_ids
    eng.scheduler.check()
    for rid, prompt, sp in zip(rids, prompts, params, strict=True):
        want = _penalized_reference(model, prompt, sp.max_tokens, sp)
        assert got[rid] == want
    # The penalties changed something (else this test could not fail).
    assert got[rids[0]] != model.reference_greedy(prompts[0], 10, eos=None)
    assert got[rids[4]] != model.reference_greedy(prompts[4], 10, eos=None)


def test_scratch_buffers_are_reused_per_thread_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode KV gather's buffer: one storage per name and thread, reused while big enough, grown when
    not, new for another dtype; above SCRATCH_MAX_BYTES a fresh tensor every time (none is kept)."""
    import threading

    from sovereign_runtime.model import context

    cpu = torch.device("cpu")
    a = context.scratch("test_rows", (4, 8), torch.float32, cpu)
    b = context.scratch("test_rows", (2, 8), torch.float32, cpu)
    assert a.shape == (4, 8) and b.shape == (2, 8) and a.data_ptr() == b.data_ptr()
    c = context.scratch("test_rows", (16, 8), torch.float32, cpu)
    assert c.shape == (16, 8) and c.data_ptr() != a.data_ptr()
    assert context.scratch("test_rows", (16, 8), torch.float32, cpu).data_ptr() == c.data_ptr()
    assert context.scratch("test_rows", (16, 8), torch.float64, cpu).dtype == torch.float64
    other: list[int] = []
    thread = threading.Thread(
        target=lambda: other.append(context.scratch("test_rows", (4, 8), torch.float64, cpu).data_ptr())
    )
    thread.start()
    thread.join()
    assert other and other[0] != context.scratch("test_rows", (4, 8), torch.float64, cpu).data_ptr()
    monkeypatch.setattr(context, "SCRATCH_MAX_BYTES", 64)
    big = context.scratch("test_big", (4, 8), torch.float32, cpu)
    assert big.data_ptr() != context.scratch("test_big", (4, 8), torch.float32, cpu).data_ptr()
