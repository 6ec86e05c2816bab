"""DeepSeek-V2 checkpoints (V2-Lite's plain softmax router, V2's group-limited one, no router bias)
against transformers' DeepseekV2ForCausalLM on tiny random models (fp32)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from sovereign_runtime.model import greedy_generate, load_model, prompt_logits
from sovereign_runtime.model.config import ModelConfig
from sovereign_runtime.model.layers import grouped_topk

YARN = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}
# V2-Lite's shape of router and attention (no query compression), and V2's (grouped experts).
VARIANTS: dict[str, dict[str, Any]] = {
    "v2_lite": {"q_lora_rank": None, "topk_method": "greedy", "routed_scaling_factor": 1.0},
    "v2": {
        "q_lora_rank": 24,
        "topk_method": "group_limited_greedy",
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.0,
    },
}
ATOL = 5e-5


def _write(path: Path, variant: dict[str, Any]) -> Any:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=2,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        norm_topk_prob=False,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=1,
        rope_scaling=YARN,
        **variant,
    )
    model = DeepseekV2ForCausalLM(config).float().eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:  # larger than the default init: distinct logits, no argmax ties
                parameter.normal_(0.0, 0.1)
    model.config._attn_implementation = "eager"
    model.save_pretrained(path)
    return model


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 256, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_deepseek_v2_checkpoint_matches_transformers(tmp_path: Path, name: str) -> None:
    reference = _write(tmp_path, VARIANTS[name])
    model, config = load_model(tmp_path)
    assert config.scoring_func == "softmax" and config.topk_method == VARIANTS[name]["topk_method"]
    # No correction bias in the checkpoint: ours stays zero.
    assert all(not layer.mlp.gate.e_score_correction_bias.any() for layer in model.model.layers[1:])

    (prompt,) = _prompts([70], seed=1)  # past YaRN's original 32 positions
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0].float()
    got = prompt_logits(model, prompt)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(prompt_logits(model, prompt, chunk_size=4), expected, atol=ATOL, rtol=0)

    prompts = _prompts([5, 17, 33], seed=2)
    ours = greedy_generate(model, prompts, max_new_tokens=24)  # batched decode steps
    reference.generation_config.eos_token_id = None
    reference.generation_config.pad_token_id = 0
    for prompt, tokens in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
        assert tokens == out[0, len(prompt) :].tolist()


def test_group_limited_greedy_ranks_groups_by_their_best_expert() -> None:
    # Group 0 holds the best single expert; group 1 the best pair. V2 keeps group 0, V3 group 1.
    scores = torch.tensor([[0.50, 0.00, 0.30, 0.30]])
    _, ids = grouped_topk(scores, None, 1, 2, 1, False, 1.0, method="group_limited_greedy")
    assert ids.tolist() == [[0]]
    _, ids = grouped_topk(scores, None, 2, 2, 1, False, 1.0, method="noaux_tc")
    assert sorted(ids[0].tolist()) == [2, 3]
    weights, ids = grouped_topk(scores, None, 2, 2, 1, False, 3.0, method="greedy")  # groups ignored
    assert ids[0].tolist()[0] == 0 and weights[0, 0].item() == pytest.approx(1.5)


def _raw(**overrides: Any) -> dict[str, Any]:
    raw = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
    }
    return {**raw, **overrides}


def test_router_defaults_follow_the_model_type_and_unknown_ones_are_refused() -> None:
    v3 = ModelConfig.from_dict(_raw(model_type="deepseek_v3"))
    assert (v3.scoring_func, v3.topk_method) == ("sigmoid", "noaux_tc")
    v2 = ModelConfig.from_dict(_raw(model_type="deepseek_v2"))
    assert (v2.scoring_func, v2.topk_method) == ("softmax", "greedy")
    with pytest.raises(
        ValueError, match=r"scoring_func 'sqrtsoftplus' is not supported \(valid: sigmoid, softmax\)"
    ):
        ModelConfig.from_dict(_raw(scoring_func="sqrtsoftplus"))
    with pytest.raises(
        ValueError,
        match=r"topk_method 'aux' is not supported \(valid: noaux_tc, greedy, group_limited_greedy\)",
    ):
        ModelConfig.from_dict(_raw(topk_method="aux"))


def test_a_config_of_another_architecture_is_refused_saying_what_it_lacks() -> None:
    llama = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **_raw()}
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        del llama[key]
    with pytest.raises(
        ValueError,
        match=r"model_type 'llama', .*LlamaForCausalLM.* is not a DeepSeek-V3 or DeepSeek-V2"
        r" architecture checkpoint \(Multi-head Latent Attention\): it lacks kv_lora_rank,"
        r" qk_nope_head_dim, qk_rope_head_dim, v_head_dim",
    ):
        ModelConfig.from_dict(llama)
    with pytest.raises(ValueError, match=r"DeepSeek-V3\.2's sparse attention"):
        ModelConfig.from_dict(_raw(model_type="deepseek_v32", index_topk=2048))
