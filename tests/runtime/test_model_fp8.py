"""FP8 block-quantised checkpoints (e4m3 + 128×128 weight_scale_inv) load and match the dequantised reference."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from checkpoints import load_hf_reference, quantize_fp8_block, reference_dequantize
from safetensors.torch import load_file
from sovereign_runtime.model import (
    Fp8Linear,
    dequantize_fp8_block,
    greedy_generate,
    load_model,
    prompt_logits,
)

# intermediate 200 > 128: the dense MLP's weights span two blocks with a padded edge block.
FP8_OPTIONS = {"fp8": True, "intermediate_size": 200}


def test_checkpoint_layout_is_v3_fp8(tiny_checkpoint_factory: Callable[..., Path]) -> None:
    raw = load_file(str(tiny_checkpoint_factory(**FP8_OPTIONS) / "model.safetensors"))
    gate = raw["model.layers.0.mlp.gate_proj.weight"]
    assert gate.dtype == torch.float8_e4m3fn and gate.shape == (200, 64)
    assert raw["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (2, 1)
    assert raw["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (1, 2)
    assert raw["model.embed_tokens.weight"].dtype == torch.float32  # stays high precision
    assert raw["model.layers.1.mlp.gate.weight"].dtype == torch.float32  # the router too


def test_dequantize_matches_blockwise_reference() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 130, generator=g) * torch.linspace(0.01, 3.0, 130)  # blocks with different ranges
    q, s = quantize_fp8_block(w)
    assert s.shape == (3, 2)
    ours = dequantize_fp8_block(q, s, (128, 128), torch.float32)
    assert torch.equal(ours, reference_dequantize(q, s))
    # Whole blocks take the broadcasting path.
    q2, s2 = quantize_fp8_block(w[:256, :128])
    assert torch.equal(dequantize_fp8_block(q2, s2, (128, 128), torch.float32), reference_dequantize(q2, s2))
    assert dequantize_fp8_block(q2, s2, (128, 128), torch.bfloat16).dtype == torch.bfloat16
    # e4m3 keeps ~3 mantissa bits: within 1/16 relative of each block's scale.
    assert (
        (ours - w).abs() <= s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :130] * 448 / 16
    ).all()


def test_fp8_model_matches_hf_dequantized(tiny_fp8_checkpoint: Path) -> None:
    """HF's own FP8 loader (dequantize=True) as the oracle.

    HF derives the block size from the scale grid (rows // scale_rows), which is only right when every weight
    dim is a multiple of 128 or fits one block; this checkpoint's weights each fit one block.
    """
    from transformers import DeepseekV3ForCausalLM, FineGrainedFP8Config

    path = tiny_fp8_checkpoint
    model, config = load_model(path)
    assert config.is_fp8
    hf = DeepseekV3ForCausalLM.from_pretrained(
        str(path), quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.float32
    ).eval()
    prompt = torch.randint(2, config.vocab_size, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(prompt_logits(model, prompt), expected, atol=5e-5, rtol=0)

    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        hf_tokens = hf.generate(torch.tensor([prompt[:8]]), max_new_tokens=32, do_sample=False)[
            0, 8:
        ].tolist()
    assert greedy_generate(model, [prompt[:8]], 32)[0] == hf_tokens


def test_fp8_padded_edge_blocks_match_blockwise_reference(
    tiny_checkpoint_factory: Callable[..., Path],
) -> None:
    """Weights spanning a padded edge block (DeepSeek's convention) against an independently dequantised HF model."""
    path = tiny_checkpoint_factory(**FP8_OPTIONS)
    model, config = load_model(path)
    ref = load_hf_reference(path)
    prompt = torch.randint(2, config.vocab_size, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(prompt_logits(model, prompt), expected, atol=5e-5, rtol=0)


def test_keep_fp8_weights_resident(tiny_checkpoint_factory: Callable[..., Path]) -> None:
    """``keep_fp8`` (the GPU default) keeps e4m3 weights in Fp8Linear modules and computes the same logits."""
    path = tiny_checkpoint_factory(**FP8_OPTIONS)
    dense, config = load_model(path, keep_fp8=False)
    kept, _ = load_model(path, keep_fp8=True)
    attn = kept.model.layers[1].self_attn
    assert isinstance(attn.kv_b_proj, Fp8Linear) and attn.kv_b_proj.weight.dtype == torch.float8_e4m3fn
    assert isinstance(kept.model.layers[1].mlp.experts[0].down_proj, Fp8Linear)
    assert isinstance(kept.mtp[0].eh_proj, Fp8Linear)
    assert kept.lm_head.weight.dtype == torch.float32  # never quantised
    assert kept.model.layers[0].mlp.gate_proj.weight_scale_inv.shape == (2, 1)
    prompt = torch.randint(2, config.vocab_size, (24,), generator=torch.Generator().manual_seed(6)).tolist()
    # Both a prefill and absorbed decode steps (which read W_UK/W_UV out of the FP8 kv_b_proj).
    torch.testing.assert_close(prompt_logits(kept, prompt), prompt_logits(dense, prompt), atol=1e-5, rtol=0)
    assert greedy_generate(kept, [prompt[:6]], 8) == greedy_generate(dense, [prompt[:6]], 8)
