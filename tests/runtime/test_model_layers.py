"""Unit tests of the pieces: config parsing and softmax scale, RoPE/YaRN against HF, MoE routing, absorption."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from sovereign_runtime.model import (
    ModelConfig,
    PagedRunner,
    kv_bytes_per_token,
    load_model,
    mha_kv_bytes_per_token,
    prompt_logits,
)
from sovereign_runtime.model.layers import grouped_topk
from sovereign_runtime.model.rope import RotaryEmbedding, rope_inv_freq

# The published DeepSeek-V3 config.json, trimmed to what the runtime reads.
V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc",
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
}


def test_v3_config_derived_values() -> None:
    c = ModelConfig.from_dict(V3_CONFIG)
    assert c.kv_cache_dim == 576
    assert c.softmax_scale == pytest.approx(192**-0.5 * (0.1 * math.log(40) + 1) ** 2)
    assert c.softmax_scale == pytest.approx(0.13523, abs=5e-6)
    assert c.is_fp8 and c.fp8_block_size == (128, 128)
    assert [c.is_moe_layer(i) for i in (0, 2, 3, 60)] == [False, False, True, True]
    assert kv_bytes_per_token(c) == 576 * 2 * 61 == 70_272
    assert mha_kv_bytes_per_token(c) == 128 * (192 + 128) * 2 * 61
    assert kv_bytes_per_token(c) / mha_kv_bytes_per_token(c) == pytest.approx(0.01406, abs=1e-4)


def test_rope_config_spellings_are_equivalent() -> None:
    scaling = dict(V3_CONFIG["rope_scaling"])  # type: ignore[arg-type]
    new_style = {k: v for k, v in V3_CONFIG.items() if k not in ("rope_scaling", "rope_theta")}
    params = {k: v for k, v in scaling.items() if k != "type"}
    new_style["rope_parameters"] = {**params, "rope_type": "yarn", "rope_theta": 10000.0}
    old = ModelConfig.from_dict(V3_CONFIG)
    new = ModelConfig.from_dict(new_style)
    mixed = ModelConfig.from_dict({**V3_CONFIG, "rope_scaling": {**params, "rope_type": "yarn"}})
    assert old.rope == new.rope == mixed.rope
    assert old.rope.rope_type == "yarn" and old.rope.factor == 40
    plain = ModelConfig.from_dict({**V3_CONFIG, "rope_scaling": None})
    assert plain.rope.rope_type == "default"
    assert plain.softmax_scale == pytest.approx(192**-0.5)
    with pytest.raises(ValueError, match="rope type"):
        ModelConfig.from_dict({**V3_CONFIG, "rope_scaling": {"type": "dynamic", "factor": 2.0}})


@pytest.mark.parametrize("yarn", [False, True])
def test_rope_frequencies_and_rotation_match_hf(yarn: bool) -> None:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    cfg = {
        k: v for k, v in V3_CONFIG.items() if k not in ("quantization_config", "architectures", "model_type")
    }
    if not yarn:
        cfg["rope_scaling"] = None
    hf_config = DeepseekV3Config(**{k: v for k, v in cfg.items() if k not in ("rope_scaling", "rope_theta")})
    ours = ModelConfig.from_dict(cfg)
    rope = ours.rope
    hf_config.rope_parameters = (
        {"rope_type": "default", "rope_theta": 10000.0}
        if not yarn
        else {
            **{k: v for k, v in cfg["rope_scaling"].items() if k != "type"},
            "rope_type": "yarn",
            "rope_theta": 1e4,
        }
    )
    hf_rot = hf.DeepseekV3RotaryEmbedding(hf_config)
    inv_freq, factor = rope_inv_freq(rope, 64)
    assert torch.equal(inv_freq, hf_rot.inv_freq)
    assert factor == pytest.approx(hf_rot.attention_scaling)

    positions = torch.tensor([0, 1, 7, 4095, 4096, 100_000])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, 3, 64, generator=g)
    k = torch.randn(6, 1, 64, generator=g)
    cos, sin = hf_rot(q, positions[None])
    hf_q, hf_k = hf.apply_rotary_pos_emb_interleave(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin
    )
    ours_rot = RotaryEmbedding(rope, 64, 16)
    c, s = ours_rot.cos_sin(positions)
    assert torch.equal(RotaryEmbedding.apply(q, c, s), hf_q[0].transpose(0, 1))
    assert torch.equal(RotaryEmbedding.apply(k, c, s), hf_k[0].transpose(0, 1))


def test_grouped_topk_masks_groups_with_minus_inf() -> None:
    # 8 experts in 4 groups of 2, keep 2 groups, pick 2 experts. A strongly negative correction bias makes
    # every biased score negative: masking the dropped groups with 0 would let them win.
    scores = torch.tensor([[0.90, 0.80, 0.70, 0.60, 0.10, 0.05, 0.20, 0.15]])
    bias = torch.full((8,), -2.0)
    weights, ids = grouped_topk(scores, bias, top_k=2, n_group=4, topk_group=2, norm_topk_prob=True,
                                routed_scaling_factor=2.5)  # fmt: skip
    assert sorted(ids[0].tolist()) == [0, 1]  # the two best experts within the kept groups 0 and 1
    torch.testing.assert_close(weights[0].sum(), torch.tensor(2.5))  # renormalised unbiased scores × 2.5
    torch.testing.assert_close(weights[0][ids[0].argsort()], torch.tensor([0.9, 0.8]) / 1.7 * 2.5)
    _, wrong = grouped_topk(scores, bias, 2, 4, 2, True, 2.5, mask_value=0.0)
    assert set(wrong[0].tolist()) - {0, 1, 2, 3}, "masking with 0 picks experts from dropped groups"


def test_grouped_topk_matches_hf_router() -> None:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(
        hidden_size=32, n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4
    )
    router = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.3)
    x = torch.randn(50, 32, generator=g)
    _, hf_w, hf_ids = router(x)
    scores = (x @ router.weight.T).sigmoid()
    w, ids = grouped_topk(scores, router.e_score_correction_bias, 4, 4, 2, True, cfg.routed_scaling_factor)
    hf_order, our_order = hf_ids.argsort(-1), ids.argsort(-1)
    assert torch.equal(hf_ids.gather(1, hf_order), ids.gather(1, our_order))
    torch.testing.assert_close(hf_w.gather(1, hf_order), w.gather(1, our_order))


def _layer_inputs(model: torch.nn.Module, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(n, model.config.hidden_size, generator=g), torch.arange(n)


def test_absorbed_decode_equals_naive_attention(tiny_checkpoint: Path) -> None:
    """The last token through weight absorption (decode kernel) equals expanding K/V per head."""
    model, _ = load_model(tiny_checkpoint)
    attn = model.model.layers[1].self_attn
    x, pos = _layer_inputs(model, 40)
    runner = PagedRunner(model, num_blocks=8, block_size=16)
    sid = runner.new_sequence()
    # Run the whole sequence as a prefill (naive) ...
    from sovereign_runtime.model import attention_context

    _, meta = runner.metadata([(sid, list(range(40)))])
    with attention_context(meta):
        naive = attn(x, pos)
    # ... then the same sequence again with its last token as a decode step over the cached prefix.
    runner2 = PagedRunner(model, num_blocks=8, block_size=16)
    sid2 = runner2.new_sequence()
    _, meta_prefix = runner2.metadata([(sid2, list(range(39)))])
    with attention_context(meta_prefix):
        attn(x[:39], pos[:39])
    _, meta_decode = runner2.metadata([(sid2, [0])])
    assert meta_decode.is_decode
    with attention_context(meta_decode):
        absorbed = attn(x[39:], pos[39:])
    torch.testing.assert_close(absorbed, naive[39:], atol=1e-5, rtol=1e-5)


def test_absorbed_prefill_equals_naive_prefill(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, _ = load_model(tiny_checkpoint)
    attn = model.model.layers[0].self_attn
    x, pos = _layer_inputs(model, 30)
    from sovereign_runtime.model import attention_context

    outs = []
    for form in ("naive", "absorbed"):
        monkeypatch.setattr(type(attn), "prefill_form", form)
        runner = PagedRunner(model, num_blocks=4, block_size=16)
        sid = runner.new_sequence()
        _, meta = runner.metadata([(sid, list(range(30)))])
        with attention_context(meta):
            outs.append(attn(x, pos))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


def test_cache_holds_normalised_latent_then_rotated_k_pe(tiny_checkpoint: Path) -> None:
    model, config = load_model(tiny_checkpoint)
    runner = PagedRunner(model, num_blocks=4, block_size=16)
    sid = runner.new_sequence()
    runner.step([(sid, [5, 6, 7])])
    attn = model.model.layers[0].self_attn
    x = model.model.layers[0].input_layernorm(model.model.embed_tokens(torch.tensor([5, 6, 7])))
    cos, sin = attn.rotary.cos_sin(torch.arange(3))
    expected = attn._project(x, cos, sin)[2]
    slots = [runner._blocks[sid][0] * 16 + i for i in range(3)]
    got = runner.cache[0].view(-1, config.kv_cache_dim)[slots]
    torch.testing.assert_close(got, expected)
    r = config.kv_lora_rank
    # The latent part is RMS-normalised (times its norm weight).
    torch.testing.assert_close(
        got[:, :r] / attn.kv_a_layernorm.weight,
        torch.nn.functional.rms_norm(got[:, :r] / attn.kv_a_layernorm.weight, (r,)),
    )


def test_mtp_layer_is_loaded_and_runs(tiny_checkpoint: Path) -> None:
    from safetensors.torch import load_file

    model, config = load_model(tiny_checkpoint)
    assert config.num_nextn_predict_layers == 1 and len(model.mtp) == 1
    n = config.num_hidden_layers
    raw = load_file(str(tiny_checkpoint / "model.safetensors"))
    mtp_state = model.mtp[0].state_dict()
    prefix = f"model.layers.{n}."
    names = [k[len(prefix) :] for k in raw if k.startswith(prefix) and not k.endswith("embed_tokens.weight")]
    assert {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.head.weight"} <= set(names)
    assert len(names) == len(mtp_state)
    for name in names:
        assert torch.equal(mtp_state[name], raw[prefix + name]), name

    # MTP depth 1 runs over a cache that includes its own layer and yields fp32 logits.
    runner = PagedRunner(model, num_blocks=4, block_size=16, include_mtp=True)
    assert runner.cache.shape[0] == n + 1
    sid = runner.new_sequence()
    ids, meta = runner.metadata([(sid, [3, 4, 5, 6])])
    from sovereign_runtime.model import attention_context

    with attention_context(meta):
        hidden = model(ids, meta.positions)
        mtp_hidden = model.mtp_hidden(hidden, torch.tensor([4, 5, 6, 7]), meta.positions)
    logits = model.compute_mtp_logits(mtp_hidden)
    assert logits.shape == (4, config.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert runner.cache[n].abs().sum() > 0  # the MTP layer wrote its own latents


def test_config_json_dtype_is_used_on_cpu(tiny_checkpoint: Path, tmp_path: Path) -> None:
    cfg = json.loads((tiny_checkpoint / "config.json").read_text())
    assert ModelConfig.from_dict(cfg).torch_dtype == torch.float32
    model, _ = load_model(tiny_checkpoint, dtype=torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32  # the router stays fp32


def test_auto_prefill_form_absorbs_chunks_over_a_cached_prefix() -> None:
    from sovereign_runtime.model.layers import MLAAttention

    attn = MLAAttention.__new__(MLAAttention)  # only the decision rule is exercised
    attn.config = ModelConfig.from_dict(V3_CONFIG)
    attn.prefill_form = "auto"
    # CPU, V3 head dims (bench/mla_prefill_forms.py --grid): fresh prompts and short prefixes expand ...
    assert not attn._absorb_prefill(64, 64, on_cpu=True) and not attn._absorb_prefill(2048, 2048, on_cpu=True)
    assert not attn._absorb_prefill(64, 128, on_cpu=True) and not attn._absorb_prefill(128, 384, on_cpu=True)
    # ... chunks of up to 126 tokens over a context of 4x theirs absorb (absorbed/naive 0.16-0.90) ...
    for chunk, context in ((16, 80), (64, 320), (126, 1152), (32, 8192)):
        assert attn._absorb_prefill(chunk, context, on_cpu=True), (chunk, context)
    # ... and longer chunks expand at any context (absorbed 1.2x slower for 256 over 8448).
    assert not attn._absorb_prefill(256, 8448, on_cpu=True) and not attn._absorb_prefill(
        127, 4096, on_cpu=True
    )
    # Narrower heads make the expansion cheaper, so fewer new tokens pay for absorbing: 56 with the
    # bench's mid-size dims (nope, rope and v 64).
    attn.config = ModelConfig.from_dict(
        {**V3_CONFIG, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64, "v_head_dim": 64}
    )
    assert attn._absorb_prefill(56, 1024, on_cpu=True) and not attn._absorb_prefill(57, 1024, on_cpu=True)
    # Elsewhere the earlier ratio rule: context at least 16x the chunk.
    assert not attn._absorb_prefill(64, 320, on_cpu=False) and attn._absorb_prefill(64, 1088, on_cpu=False)
    assert attn._absorb_prefill(256, 4352, on_cpu=False)
    attn.prefill_form = "naive"
    assert not attn._absorb_prefill(64, 1088, on_cpu=True)


def test_rope_lookup_follows_in_place_updates_of_positions() -> None:
    rot = RotaryEmbedding(ModelConfig.from_dict(V3_CONFIG).rope, 64, 16)
    positions = torch.tensor([0, 1, 2])
    first = rot.cos_sin(positions)
    positions.copy_(torch.tensor([20, 21, 22]))  # an engine refilling a reused buffer
    second = rot.cos_sin(positions)
    assert not torch.equal(first[0], second[0])
    torch.testing.assert_close(second[0], rot.cos_sin(torch.tensor([20, 21, 22]))[0])


def test_mtp_forward_matches_hf_decoder_layer(tiny_checkpoint: Path) -> None:
    """MTP depth 1 = HF's V3 decoder layer applied to eh_proj(cat(enorm(embed(next)), hnorm(hidden)))."""
    from checkpoints import _to_hf_names
    from safetensors.torch import load_file
    from sovereign_runtime.model import attention_context
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    model, config = load_model(tiny_checkpoint)
    n = config.num_hidden_layers
    raw = load_file(str(tiny_checkpoint / "model.safetensors"))
    prefix = f"model.layers.{n}."
    w = {k[len(prefix) :]: v for k, v in raw.items() if k.startswith(prefix)}

    prompt, following = [7, 9, 11, 13, 15, 17], [9, 11, 13, 15, 17, 19]
    runner = PagedRunner(model, num_blocks=4, block_size=16, include_mtp=True)
    sid = runner.new_sequence()
    ids, meta = runner.metadata([(sid, prompt)])
    with attention_context(meta):
        hidden = model(ids, meta.positions)
        ours = model.mtp_hidden(hidden, torch.tensor(following), meta.positions)

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=config.rms_norm_eps)

    embeds = raw["model.embed_tokens.weight"][torch.tensor(following)]
    x = (
        torch.cat([rms(embeds, w["enorm.weight"]), rms(hidden, w["hnorm.weight"])], -1)
        @ w["eh_proj.weight"].T
    )
    hf_config = DeepseekV3Config.from_pretrained(str(tiny_checkpoint))
    hf_config._attn_implementation = "eager"
    layer = hf.DeepseekV3DecoderLayer(hf_config, layer_idx=n).eval()
    keep = ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.")
    layer.load_state_dict(_to_hf_names({k: v for k, v in w.items() if k.startswith(keep)}, hf_config))
    rotary = hf.DeepseekV3RotaryEmbedding(hf_config)
    positions = torch.arange(len(prompt))[None]
    mask = torch.full((len(prompt), len(prompt)), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        expected = layer(x[None], attention_mask=mask, position_embeddings=rotary(x[None], positions))[0]
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    head_logits = rms(expected, w["shared_head.norm.weight"]) @ w["shared_head.head.weight"].T
    torch.testing.assert_close(model.compute_mtp_logits(ours), head_logits, atol=1e-4, rtol=1e-5)


def test_model_runs_under_inference_mode(tiny_checkpoint: Path) -> None:
    model, _ = load_model(tiny_checkpoint)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    expected = prompt_logits(model, prompt)
    with torch.inference_mode():
        torch.testing.assert_close(prompt_logits(model, prompt), expected)
        torch.testing.assert_close(prompt_logits(model, prompt[:5]), expected[:5])


@pytest.mark.parametrize("dim", [64, 96, 128])
def test_fp32_rmsnorm_is_the_reference_arithmetic_bit_for_bit(dim: int) -> None:
    """The fp32 fast path (no casts, sum / n) gives exactly the reference's mean-based result."""
    from sovereign_runtime.model.layers import RMSNorm

    torch.manual_seed(dim)
    norm = RMSNorm(dim, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim))
        for tokens in (1, 7):
            x = torch.randn(tokens, dim) * 3
            reference = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
            assert torch.equal(norm(x), reference)


def test_one_token_moe_equals_the_grouped_path(tiny_checkpoint: Path) -> None:
    """Decode's one-token MoE (chosen experts run directly) sums exactly what the sort/scatter path does."""
    model, config = load_model(tiny_checkpoint)
    moe = next(layer.mlp for i, layer in enumerate(model.model.layers) if config.is_moe_layer(i))
    torch.manual_seed(0)
    with torch.no_grad():
        for _ in range(8):
            x = torch.randn(1, config.hidden_size)
            weights, ids = moe.gate(x)
            expected = moe._grouped(x, weights, ids) + moe.shared_experts(x)
            assert torch.equal(moe(x), expected)


def test_small_expert_sets_run_densely_and_match_the_sparse_paths(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Routed experts small enough to stay in cache run every expert on every token (two products, the
    unchosen weighted 0) for 2 to DENSE_MOE_MAX_TOKENS tokens: the same sums as running the chosen experts
    (to fp32 rounding: the products' shapes differ, and with them the kernels' accumulation order);
    larger sets, bigger batches and other dtypes keep the sparse paths; the stacked copy follows weight
    updates."""
    from sovereign_runtime.model import layers
    from sovereign_runtime.model.layers import forget_derived_weights

    model, config = load_model(tiny_checkpoint)
    moe = next(layer.mlp for i, layer in enumerate(model.model.layers) if config.is_moe_layer(i))
    torch.manual_seed(0)

    def sparse(x: torch.Tensor) -> torch.Tensor:
        weights, ids = moe.gate(x)
        rows = [moe._one_token(x[t : t + 1], weights[t : t + 1], ids[t : t + 1]) for t in range(x.shape[0])]
        return torch.cat(rows) + moe.shared_experts(x)

    with torch.no_grad():
        for tokens in (1, 2, 7, layers.DENSE_MOE_MAX_TOKENS):
            x = torch.randn(tokens, config.hidden_size)
            assert moe._dense_stack(x) is not None
            torch.testing.assert_close(moe(x), sparse(x), rtol=1e-5, atol=1e-6)
            weights, ids = moe.gate(x)
            dense = moe._dense(x, weights, ids, *moe._dense_stack(x))
            # To fp32 rounding: one token matched bit for bit on the Intel hosts this was written on,
            # not on an AMD EPYC, where MKL picks a different kernel for the stacked product's shape.
            torch.testing.assert_close(dense + moe.shared_experts(x), sparse(x), rtol=1e-5, atol=1e-6)

        def dense_out(x: torch.Tensor) -> torch.Tensor:
            weights, ids = moe.gate(x)
            stacked = moe._dense_stack(x)
            assert stacked is not None
            return moe._dense(x, weights, ids, *stacked) + moe.shared_experts(x)

        x = torch.randn(1, config.hidden_size)
        before = dense_out(x)
        for expert in moe.experts:
            expert.down_proj.weight.mul_(2)  # in place: a new version
        torch.testing.assert_close(dense_out(x), sparse(x), rtol=1e-5, atol=1e-6)
        assert not torch.equal(dense_out(x), before)
        for expert in moe.experts:  # replaced
            expert.gate_proj.weight = torch.nn.Parameter(expert.gate_proj.weight * 3)
        torch.testing.assert_close(dense_out(x), sparse(x), rtol=1e-5, atol=1e-6)
        before = dense_out(x)
        for expert in moe.experts:
            expert.up_proj.weight.data[:2] = 5.0  # through .data: needs forget_derived_weights
        forget_derived_weights(model)
        torch.testing.assert_close(dense_out(x), sparse(x), rtol=1e-5, atol=1e-6)
        assert not torch.equal(dense_out(x), before)
        assert moe._dense_stack(x.double()) is None  # another dtype than the experts'
        monkeypatch.setattr(layers, "DENSE_MOE_MAX_BYTES", 1024)
        forget_derived_weights(model)
        assert moe._dense_stack(x) is None
        for tokens in (1, 3):
            x = torch.randn(tokens, config.hidden_size)
            assert torch.equal(moe(x), sparse(x))


def test_cached_transposed_weight_follows_weight_updates() -> None:
    """The decode path's cached W^T view sees in-place updates and replaced weights (reloads)."""
    from sovereign_runtime.model.layers import _apply

    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 4, bias=False)
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(_apply(linear, x), linear(x))
        linear.weight.mul_(2)  # in place (load_state_dict without assign)
        assert torch.equal(_apply(linear, x), linear(x))
        linear.weight = torch.nn.Parameter(torch.randn(4, 8))  # replaced (assign=True)
        assert torch.equal(_apply(linear, x), linear(x))
        linear.weight.data = torch.randn(4, 8)  # new storage under the same parameter
        assert torch.equal(_apply(linear, x), linear(x))


def test_packed_cpu_linear_matches_and_follows_weight_updates() -> None:
    """From PACKED_MIN_ROWS rows an fp32 CPU linear runs on oneDNN's packed copy: the same product (to
    rounding), rebuilt after in-place updates, replaced weights and (with forget_derived_weights) writes
    through ``.data``; routed experts are never packed."""
    from sovereign_runtime.model import layers
    from sovereign_runtime.model.layers import MoE, _apply, forget_derived_weights

    if not layers._ONEDNN:
        pytest.skip("this torch build has no oneDNN linear ops (the plain mm path is the one in use)")
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(layers.PACKED_MIN_ROWS, 64)

    def close() -> bool:
        return torch.allclose(_apply(linear, x), x @ linear.weight.t(), rtol=1e-5, atol=1e-5)

    with torch.no_grad():
        assert close() and "_packed" in linear.__dict__
        linear.weight.mul_(2)
        assert close()
        linear.weight = torch.nn.Parameter(torch.randn(32, 64))
        assert close()
        linear.weight.data[:4] = 7.0  # invisible to identity and version checks
        forget_derived_weights(linear)
        assert close()
        one_row = x[:1]
        assert torch.equal(_apply(linear, one_row), torch.mm(one_row, linear.weight.t()))  # few rows: mm

    moe = MoE(
        ModelConfig.from_dict(
            json.loads(json.dumps(V3_CONFIG))
            | {
                "hidden_size": 64,
                "moe_intermediate_size": 16,
                "n_routed_experts": 8,
                "n_group": 4,
                "topk_group": 2,
            }
        )
    )
    assert all(not m.pack_on_cpu for m in moe.experts.modules() if isinstance(m, torch.nn.Linear))
    assert moe.shared_experts is not None and moe.shared_experts.gate_proj.__dict__.get("pack_on_cpu", True)


@pytest.mark.parametrize(("q_len", "ctx"), [(40, 40), (24, 70), (1, 9)])
def test_causal_attention_matches_masked_softmax_and_runs_the_fused_cpu_kernel(q_len: int, ctx: int) -> None:
    """MLA's V is narrower than Q and K; the chunk's attention pads it so CPU SDPA takes its fused kernel,
    and the result is the written-out masked softmax's (queries at the last q_len of ctx positions)."""
    from sovereign_runtime.model.layers import causal_attention

    g = torch.Generator().manual_seed(q_len + ctx)
    heads, qk_dim, v_dim, scale = 4, 24, 16, 0.2
    q = torch.randn(q_len, heads, qk_dim, generator=g)
    k = torch.randn(ctx, heads, qk_dim, generator=g)
    v = torch.randn(ctx, heads, v_dim, generator=g)
    positions = torch.arange(ctx - q_len, ctx)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = causal_attention(q, k, v, positions, scale)
    ran = {event.key for event in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ran, sorted(ran)
    assert "aten::_scaled_dot_product_attention_math" not in ran

    scores = torch.einsum("thd,lhd->htl", q, k) * scale
    allowed = torch.arange(ctx)[None, :] <= positions[:, None]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    expected = torch.einsum("htl,lhv->thv", probs, v)
    assert got.shape == (q_len, heads, v_dim)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)
