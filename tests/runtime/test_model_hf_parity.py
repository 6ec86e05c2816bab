"""Our DeepSeek-V3 against HF transformers' DeepseekV3ForCausalLM on tiny random checkpoints (fp32)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoints import load_hf_reference
from sovereign_runtime.model import PagedRunner, greedy_generate, load_model, prompt_logits

CONFIGS: dict[str, dict[str, Any]] = {
    "q_lora": {"q_lora_rank": 48},
    "no_q_lora": {"q_lora_rank": None},
    "yarn_rope_parameters": {"yarn": True},
    "yarn_rope_scaling_no_q_lora": {"yarn": True, "rope_key": "rope_scaling", "q_lora_rank": None, "seed": 3},
    "no_router_bias": {"router_bias": False, "seed": 5},
}
ATOL = 5e-5


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def _hf_greedy(ref: Any, prompt: list[int], new_tokens: int) -> list[int]:
    ref.generation_config.eos_token_id = None  # compare full-length continuations
    ref.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prompt_logits_match_hf(tiny_checkpoint_factory: Callable[..., Path], name: str) -> None:
    path = tiny_checkpoint_factory(**CONFIGS[name])
    model, config = load_model(path)
    ref = load_hf_reference(path)
    # Long enough to pass YaRN's original 32 positions and several 16-token cache blocks.
    prompt = _prompts(config.vocab_size, [70])[0]
    with torch.no_grad():
        expected = ref(torch.tensor([prompt])).logits[0].float()
    got = prompt_logits(model, prompt)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    # Chunked prefill (chunks reading earlier chunks back from the paged cache) gives the same logits; with
    # 4-token chunks the later ones (context ≥ 16 × 4) take the absorbed prefill form.
    for chunk in (9, 4):
        torch.testing.assert_close(
            prompt_logits(model, prompt, chunk_size=chunk), expected, atol=ATOL, rtol=0
        )


@pytest.mark.parametrize("name", ["q_lora", "yarn_rope_scaling_no_q_lora"])
def test_greedy_batch_matches_hf_generate(tiny_checkpoint_factory: Callable[..., Path], name: str) -> None:
    path = tiny_checkpoint_factory(**CONFIGS[name])
    model, config = load_model(path)
    ref = load_hf_reference(path)
    prompts = _prompts(config.vocab_size, [5, 17, 33, 12], seed=1)
    ours = greedy_generate(model, prompts, max_new_tokens=32)  # served together: batched decode steps
    for prompt, got in zip(prompts, ours, strict=True):
        assert got == _hf_greedy(ref, prompt, 32)


def test_mixed_batch_prefill_and_decode_equal_separate_runs(tiny_checkpoint: Path) -> None:
    """One step holding a decode token of one sequence and prefill chunks of others gives their own logits."""
    model, config = load_model(tiny_checkpoint)
    a, b, c = _prompts(config.vocab_size, [20, 30, 9], seed=2)
    full_a, full_b, full_c = (prompt_logits(model, p) for p in (a, b, c))

    runner = PagedRunner(model, num_blocks=32, block_size=8)
    sa, sb, sc = runner.new_sequence(), runner.new_sequence(), runner.new_sequence()
    runner.step([(sa, a[:-1]), (sb, b[:12])])
    # a decodes its last token while b prefills its next chunk and c its whole prompt.
    logits = runner.step([(sa, a[-1:]), (sb, b[12:]), (sc, c)], all_logits=True)
    torch.testing.assert_close(logits[0], full_a[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1 : 1 + len(b) - 12], full_b[12:], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1 + len(b) - 12 :], full_c, atol=ATOL, rtol=0)


def test_forward_without_bound_cache_or_context_fails_clearly(tiny_checkpoint: Path) -> None:
    model, _ = load_model(tiny_checkpoint)
    ids = torch.tensor([3, 4])
    with pytest.raises(RuntimeError, match="bind_kv_cache"):
        model(ids, torch.arange(2))
    model.bind_kv_cache(torch.zeros(model.config.num_hidden_layers, 2, 16, model.config.kv_cache_dim))
    with pytest.raises(RuntimeError, match="attention_context"):
        model(ids, torch.arange(2))
    with pytest.raises(ValueError, match="KV cache"):
        model.bind_kv_cache(torch.zeros(1, 2, 16, model.config.kv_cache_dim))
