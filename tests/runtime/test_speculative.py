"""MTP speculative decoding in the engine: the output is the model's own, token for token (greedy and
seeded sampling), the distribution is the model's (unseeded sampling), and the KV pool stays exact.

The built-in model's MTP layer is trained (drafts are mostly accepted); the tiny random checkpoint's is
not (drafts are mostly rejected): between them both sides of every verification are exercised.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from sovereign_runtime.builtin import resolve_builtin, tasks
from sovereign_runtime.engine.engine import EngineConfig, LLMEngine
from sovereign_runtime.engine.sampling import SamplingParams
from sovereign_runtime.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from sovereign_runtime.engine.sequence import Sequence
from sovereign_runtime.engine.speculative import SpeculativeConfig, accepted_prefix
from sovereign_runtime.model import load_model
from sovereign_runtime.tokenizer import Tokenizer

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def builtin() -> tuple[torch.nn.Module, list[list[int]]]:
    path = resolve_builtin("sovereign-tiny")
    tok = Tokenizer.from_dir(path)
    model, _ = load_model(path)
    prompts = [tok.encode_chat(q.messages())[1] for q in tasks.make_questions(6, seed=7)]
    return model, prompts


def engine(model: torch.nn.Module, k: int | None, **cfg: object) -> LLMEngine:
    spec = None if k is None else SpeculativeConfig(num_draft_tokens=k, max_batch_size=0)
    return LLMEngine.from_model(model, EngineConfig(speculative=spec, **cfg))  # type: ignore[arg-type]


def run_checked(eng: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """Run to completion, checking the pool's invariants after every step."""
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    out: dict[str, list[int]] = {i: [] for i in ids}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
            assert o.completion_tokens == len(out[o.request_id])
        eng.scheduler.check()
    sched = eng.scheduler
    assert (
        sched.pool.num_free + (sched.cache.num_evictable_blocks if sched.cache else 0)
        == sched.pool.num_blocks
    )
    return [out[i] for i in ids]


# ---- pure pieces -------------------------------------------------------------------------------------


def test_accepted_prefix_counts_leading_matches() -> None:
    assert accepted_prefix([], [5]) == 0
    assert accepted_prefix([5], [5, 6]) == 1
    assert accepted_prefix([5, 7], [5, 6, 1]) == 1
    assert accepted_prefix([4, 6], [5, 6, 1]) == 0
    assert accepted_prefix([5, 6, 7], [5, 6, 7, 8]) == 3


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"num_draft_tokens": 0}, "num_draft_tokens"), ({"num_draft_tokens": 5}, "num_draft_tokens"),
     ({"algorithm": "eagle"}, "algorithm"), ({"max_batch_size": -1}, "max_batch_size")],
)  # fmt: skip
def test_config_names_the_bad_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig(**kwargs)  # type: ignore[arg-type]


def test_scheduler_keeps_kv_for_accepted_positions_and_frees_rejected_blocks() -> None:
    s = Scheduler(SchedulerConfig(block_size=4, max_num_batched_tokens=64, enable_prefix_caching=False), 16)
    seq = Sequence("a", [1, 2, 3], 3, SamplingParams(max_tokens=20))
    s.add(seq)
    batch = s.schedule()
    s.update(batch, [9])  # prompt done: tokens 1 2 3 9, KV for 3 positions
    assert s.grow_for_draft(seq, 4) == 4  # verify positions 3..7: blocks for 8 tokens
    seq.draft = [10, 11, 12, 13]
    assert len(seq.block_table) == 2
    s.check()
    batch = s.schedule()
    assert batch.num_new_tokens == [5] and batch.drafts == [[10, 11, 12, 13]] and batch.logit_rows(0) == 5
    s.update_tokens(batch, [[10, 7]])  # one accepted, then the model's own 7
    assert seq.token_ids == [1, 2, 3, 9, 10, 7] and seq.num_computed_tokens == 5 and seq.draft == []
    assert len(seq.block_table) == 2  # 6 tokens need both blocks
    s.check()
    assert s.grow_for_draft(seq, 3) == 3  # 6 + 3 tokens: a third block
    seq.draft = [1, 1, 1]
    s.update_tokens(s.schedule(), [[4]])  # nothing accepted: the third block held only rejected positions
    assert seq.token_ids[-1] == 4 and seq.num_computed_tokens == 6 and len(seq.block_table) == 2
    s.check()
    assert s.pool.num_free == 14


def test_a_stop_inside_the_accepted_tokens_drops_the_rest() -> None:
    s = Scheduler(SchedulerConfig(block_size=4, enable_prefix_caching=True), 16, eos_token_ids={0})
    seq = Sequence("a", [1, 2, 3], 3, SamplingParams(max_tokens=20))
    s.add(seq)
    s.update(s.schedule(), [9])
    s.grow_for_draft(seq, 3)
    seq.draft = [5, 0, 6]
    batch = s.schedule()
    finished = s.update_tokens(batch, [[5, 0, 6, 8]])
    assert finished == [seq] and seq.finish_reason == "stop" and seq.output_token_ids == [9, 5, 0]
    s.check()
    assert s.pool.num_free + s.cache.num_evictable_blocks == 16  # type: ignore[union-attr]


def test_a_budget_too_small_for_the_draft_shortens_it() -> None:
    s = Scheduler(SchedulerConfig(block_size=4, max_num_batched_tokens=3, enable_prefix_caching=False), 16)
    seq = Sequence("a", [1, 2], 2, SamplingParams(max_tokens=20))
    s.add(seq)
    s.update(s.schedule(), [9])
    s.grow_for_draft(seq, 4)
    seq.draft = [1, 2, 3, 4]
    batch = s.schedule()
    assert batch.num_new_tokens == [3] and batch.drafts == [[1, 2]]


# ---- the engine on the built-in model ----------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_output_is_identical_alone_and_batched(
    builtin: tuple[torch.nn.Module, list[list[int]]], k: int
) -> None:
    model, prompts = builtin
    greedy = [SamplingParams(temperature=0.0, max_tokens=48)] * len(prompts)
    reference = [run_checked(engine(model, None), [p], greedy[:1])[0] for p in prompts]
    spec = engine(model, k)
    assert [run_checked(spec, [p], greedy[:1])[0] for p in prompts] == reference
    assert run_checked(spec, prompts, greedy) == reference  # one batch: drafts side by side
    st = spec.stats()
    assert st.spec_decode_num_drafts_total > 0
    assert st.spec_decode_acceptance_rate > 0.4, st  # the trained MTP layer: mostly accepted
    assert st.spec_decode_mean_accept_length > 1.5
    # Prefix-cache hits: the same prompts again reuse their pages (the MTP layer's pages with them).
    assert run_checked(spec, prompts, greedy) == reference
    assert spec.stats().prefix_cache_hits > 0


def test_max_tokens_and_stop_tokens_cut_mid_draft(builtin: tuple[torch.nn.Module, list[list[int]]]) -> None:
    model, prompts = builtin
    plain, spec = engine(model, None), engine(model, 4)
    full = run_checked(plain, prompts[:1], [SamplingParams(temperature=0.0, max_tokens=40)])[0]
    for n in range(1, 8):
        params = [SamplingParams(temperature=0.0, max_tokens=n)]
        assert run_checked(spec, prompts[:1], params)[0] == full[:n]
    # A stop token the draft runs past: the output ends at it, the tokens after it are dropped.
    stop = full[5]
    params = [SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop])]
    assert run_checked(spec, prompts[:1], params) == run_checked(plain, prompts[:1], params)


def test_logprobs_of_accepted_tokens_are_the_models(builtin: tuple[torch.nn.Module, list[list[int]]]) -> None:
    model, prompts = builtin
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=3)

    def logprobs(eng: LLMEngine) -> list[tuple[int, float, list[int]]]:
        eng.add_request(prompts[1], params)
        got = []
        while eng.has_unfinished():
            for o in eng.step():
                assert o.new_logprobs is not None and len(o.new_logprobs) == len(o.new_token_ids)
                got += [(lp.token_id, lp.logprob, [t for t, _ in lp.top]) for lp in o.new_logprobs]
        return got

    ref, got = logprobs(engine(model, None)), logprobs(engine(model, 3))
    assert [(t, top) for t, _, top in got] == [(t, top) for t, _, top in ref]
    assert [lp for _, lp, _ in got] == pytest.approx([lp for _, lp, _ in ref], abs=1e-4)


def test_seeded_sampling_gives_the_same_tokens_with_and_without_speculation(
    builtin: tuple[torch.nn.Module, list[list[int]]],
) -> None:
    model, prompts = builtin
    params = [
        SamplingParams(temperature=t, top_p=p, top_k=k, seed=seed, max_tokens=32)
        for seed, (t, p, k) in enumerate([(0.7, 1.0, 0), (1.0, 0.9, 0), (1.3, 1.0, 8), (0.9, 0.8, 5)])
    ]
    ps = prompts[:4]
    reference = [run_checked(engine(model, None), [p], [sp])[0] for p, sp in zip(ps, params, strict=True)]
    assert run_checked(engine(model, 2), ps, params) == reference


def test_unseeded_sampling_keeps_the_models_distribution(
    builtin: tuple[torch.nn.Module, list[list[int]]],
) -> None:
    # Temperature 1.5 spreads the choices; position 2 and 3 tokens are drawn by verification (the draft
    # covers them), so their frequencies over many requests must match plain sampling's.
    model, prompts = builtin
    prompt, runs = prompts[2], 300

    def frequencies(k: int | None, first_seed: int) -> list[Counter[tuple[int, ...]]]:
        params = [SamplingParams(temperature=1.5, seed=first_seed + i, max_tokens=3) for i in range(runs)]
        outs = run_checked(engine(model, k, max_num_seqs=runs), [prompt] * runs, params)
        return [Counter(tuple(o[: j + 1]) for o in outs) for j in range(3)]

    plain, spec = frequencies(None, 0), frequencies(2, 100_000)
    for j in range(3):
        support = set(plain[j]) | set(spec[j])
        tv = 0.5 * sum(abs(plain[j][s] - spec[j][s]) / runs for s in support)
        # Two independent samples of 300 from one distribution: total variation well under 0.2.
        assert tv < 0.2, (j, tv, plain[j].most_common(5), spec[j].most_common(5))


def test_preemption_chunked_prefill_and_abort_keep_the_pool_exact(
    builtin: tuple[torch.nn.Module, list[list[int]]],
) -> None:
    model, prompts = builtin
    greedy = [SamplingParams(temperature=0.0, max_tokens=40)] * len(prompts)
    reference = run_checked(engine(model, None), prompts, greedy)
    # A pool too small for every sequence at once (preemption) and a small token budget (prompts
    # chunked beside drafting decodes).
    tight = dict(num_kv_blocks=18, block_size=4, max_num_batched_tokens=24, enable_prefix_caching=True)
    spec = engine(model, 3, **tight)
    assert run_checked(spec, prompts, greedy) == reference
    assert spec.scheduler.num_preemptions > 0
    # Abort mid-draft: blocks come back at once.
    rid = spec.add_request(prompts[0], greedy[0])
    for _ in range(4):
        spec.step()
    assert spec.scheduler.requests[rid].draft
    spec.abort(rid)
    spec.scheduler.check()
    sched = spec.scheduler
    assert sched.pool.num_free + sched.cache.num_evictable_blocks == sched.pool.num_blocks  # type: ignore[union-attr]


def test_adaptive_switch_drafts_only_at_small_batches(
    builtin: tuple[torch.nn.Module, list[list[int]]],
) -> None:
    model, prompts = builtin
    eng = LLMEngine.from_model(
        model, EngineConfig(speculative=SpeculativeConfig(num_draft_tokens=2, max_batch_size=2))
    )
    params = SamplingParams(temperature=0.0, max_tokens=30)
    for p in prompts[:4]:
        eng.add_request(p, params)
    eng.step()  # four prompts prefilled in one step: four running, above the switch
    assert not eng.stats().spec_decode_drafting and not any(s.draft for s in eng.scheduler.running)
    eng.step()
    assert eng.stats().spec_decode_num_drafts_total == 0
    while len(eng.scheduler.running) > 2:
        eng.step()
    eng.step()
    assert eng.stats().spec_decode_drafting
    while eng.has_unfinished():
        eng.step()
    assert eng.stats().spec_decode_num_drafts_total > 0


def test_grammar_requests_are_never_drafted(builtin: tuple[torch.nn.Module, list[list[int]]]) -> None:
    model, prompts = builtin
    eng = engine(model, 2)
    seq = eng.make_sequence(prompts[0], SamplingParams(temperature=0.0, max_tokens=8))
    seq.grammar = object()  # only its presence matters to the drafter
    assert eng.drafter is not None and eng.drafter.draft_budget(seq, 10_000) == 0


def test_penalized_requests_are_never_drafted_and_decode_as_without_speculation(
    tiny_checkpoint: Path,
) -> None:
    """Each verify position's penalties would depend on the drafts before it: such a request decodes
    one token a step, and its output is the plain engine's. (The tiny random model: the built-in
    one is too sure of its arithmetic for a penalty of 2 to change a token.)"""
    model, _ = load_model(tiny_checkpoint)
    prompts = [[5, 9, 2, 7, 7, 3], [11, 4, 4, 8], [2, 3]]
    penalized = SamplingParams(
        temperature=0.0, max_tokens=24, presence_penalty=2.0, frequency_penalty=2.0, ignore_eos=True
    )
    eng = engine(model, 2)
    assert (
        eng.drafter is not None
        and eng.drafter.draft_budget(eng.make_sequence(prompts[0], penalized), 10_000) == 0
    )
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    batch = [penalized, plain, penalized]
    with_drafts = run_checked(engine(model, 2), prompts, batch)
    assert with_drafts == run_checked(engine(model, None), prompts, batch)
    assert with_drafts[0] != run_checked(engine(model, None), prompts[:1], [plain])[0]  # the penalty acts


# ---- checkpoints with and without MTP tensors --------------------------------------------------------


def _without(src: Path, dst: Path, drop: Callable[[str], bool]) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if not drop(k)}, str(dst / "model.safetensors"))
    return dst


def test_declared_mtp_layer_without_tensors_loads_and_serves_without_speculation(
    tiny_checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    prefix = f"model.layers.{config['num_hidden_layers']}."
    bare = _without(tiny_checkpoint, tmp_path / "bare", lambda k: k.startswith(prefix))
    with caplog.at_level("WARNING"):
        model, _ = load_model(bare)
    assert len(model.mtp) == 0 and "ships no MTP tensors" in (model.mtp_unavailable or "")
    assert sum("ships no MTP tensors" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(ValueError, match="needs the checkpoint's MTP layer"):
        LLMEngine.from_model(model, EngineConfig(speculative=SpeculativeConfig()))
    assert LLMEngine.from_model(model).generate([[1, 2, 3]], SamplingParams(max_tokens=4))[0]


def test_a_partial_mtp_layer_is_an_error_naming_the_missing_tensors(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    name = f"model.layers.{config['num_hidden_layers']}.eh_proj.weight"
    partial = _without(tiny_checkpoint, tmp_path / "partial", lambda k: k == name)
    with pytest.raises(ValueError, match="partial MTP layer") as err:
        load_model(partial)
    assert name in str(err.value)


def test_transformers_save_pretrained_checkpoint_serves(tmp_path: Path) -> None:
    # What a new user gets from transformers: config.json keeps num_nextn_predict_layers, no MTP tensors.
    from checkpoints import _hf_config, tiny_config_kwargs
    from transformers import DeepseekV3ForCausalLM

    hf_config = _hf_config(tiny_config_kwargs())
    hf_config.num_nextn_predict_layers = 1
    DeepseekV3ForCausalLM(hf_config).save_pretrained(tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    model, _ = load_model(tmp_path / "hf")
    assert model.mtp_unavailable and LLMEngine.from_model(model).generate(
        [[1, 2]], SamplingParams(max_tokens=2)
    )


def test_random_mtp_layer_drafts_are_verified_away(tiny_checkpoint: Path) -> None:
    # A random draft layer: most drafts are rejected, and the output is still the model's own.
    model, _ = load_model(tiny_checkpoint)
    prompts = [[5, 6, 7, 8, 9] * (i + 1) for i in range(4)]
    greedy = [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)] * 4
    reference = run_checked(engine(model, None), prompts, greedy)
    spec = engine(model, 3)
    assert run_checked(spec, prompts, greedy) == reference
    assert (
        spec.stats().spec_decode_num_draft_tokens_total > spec.stats().spec_decode_num_accepted_tokens_total
    )


def test_an_mtp_step_is_a_decode_batch_row_for_row(builtin: tuple[torch.nn.Module, list[list[int]]]) -> None:
    # The verify forward presents a draft's positions as decode rows: same path as one step each.
    model, prompts = builtin
    eng = engine(model, 2)
    eng.add_request(prompts[0], SamplingParams(temperature=0.0, max_tokens=16))
    eng.step()
    batch = eng.scheduler.schedule()
    assert isinstance(batch, ScheduledBatch) and batch.drafts and len(batch.drafts[0]) == 2
    _, meta, rows = eng.runner.prepare(batch)
    assert meta.max_query_len == 1 and meta.batch_size == 3 and rows == [0, 1, 2]
    assert meta.context_lens.tolist() == [len(prompts[0]) + j for j in (1, 2, 3)]
