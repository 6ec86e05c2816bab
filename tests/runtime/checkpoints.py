"""Tiny random DeepSeek-V3 checkpoints in the real HF layout, written on the fly for tests.

HF transformers' ``DeepseekV3ForCausalLM`` writes the config and the real tensor names; on top of that this
module adds what HF does not produce: the MTP layer (``model.layers.{num_hidden_layers}.*``), a nonzero router
correction bias, and an FP8 block-quantised variant laid out like the published V3 checkpoint
(e4m3 weights + one fp32 ``weight_scale_inv`` per 128×128 block, edge blocks padded).

Weights are re-initialised with fan-in scaling instead of HF's std=0.02 so that tiny random models produce
well-separated logits and router scores; otherwise greedy ties would make token-exact comparisons flaky.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

FP8_BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn value

# Linear weights the published V3 FP8 checkpoint stores in e4m3 (embeddings, lm_head, norms, router stay).
_FP8_SUFFIXES = (
    "q_proj.weight",
    "q_a_proj.weight",
    "q_b_proj.weight",
    "kv_a_proj_with_mqa.weight",
    "kv_b_proj.weight",
    "o_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
    "eh_proj.weight",
)


def tiny_config_kwargs(
    *,
    q_lora_rank: int | None = 48,
    yarn: bool = False,
    rope_key: str = "rope_parameters",
    num_hidden_layers: int = 3,
    **overrides: Any,
) -> dict[str, Any]:
    """Keyword arguments for ``DeepseekV3Config`` of a tiny V3-shaped model (first layer dense, 8 experts)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0}
    if yarn:
        # Same shape as the V3 config (factor 40 over 4096) scaled down: factor 4 over 32 original positions.
        rope = {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        }
    kwargs: dict[str, Any] = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_shared_experts": 1,
        "n_routed_experts": 8,
        "n_group": 4,
        "topk_group": 2,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "kv_lora_rank": 32,
        "q_lora_rank": q_lora_rank,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "rope_key": rope_key,
        "rope": rope,
    }
    kwargs.update(overrides)
    return kwargs


def _hf_config(kwargs: dict[str, Any]) -> Any:
    from transformers import DeepseekV3Config

    kw = dict(kwargs)
    rope = kw.pop("rope")
    kw.pop("rope_key")
    return DeepseekV3Config(rope_parameters=dict(rope), **kw)


def _reinit(model: torch.nn.Module, generator: torch.Generator, router_bias: bool) -> None:
    """Fan-in scaled random weights, norms near 1, a router bias that changes which experts win."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=generator))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=generator))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=generator) / math.sqrt(fan_in))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.5 * (torch.rand(b.shape, generator=generator) - 0.5) if router_bias else 0.0 * b)


def quantize_fp8_block(weight: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantise a 2-D weight to e4m3 with one fp32 scale per block (``w ≈ q * scale_inv``)."""
    out_f, in_f = weight.shape
    rows, cols = -(-out_f // block), -(-in_f // block)
    padded = torch.zeros(rows * block, cols * block, dtype=torch.float32)
    padded[:out_f, :in_f] = weight.float()
    blocks = padded.view(rows, block, cols, block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / FP8_MAX
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(rows * block, cols * block)[:out_f, :in_f].contiguous(), scale_inv.contiguous()


def reference_dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """Test-side dequantisation (independent of the runtime loader): every element times its block's scale."""
    out_f, in_f = q.shape
    s = scale_inv.repeat_interleave(block, 0).repeat_interleave(block, 1)[:out_f, :in_f]
    return q.float() * s


def write_tiny_checkpoint(
    path: str | Path,
    *,
    q_lora_rank: int | None = 48,
    yarn: bool = False,
    router_bias: bool = True,
    mtp: bool = True,
    fp8: bool = False,
    seed: int = 0,
    rope_key: str = "rope_parameters",
    **overrides: Any,
) -> Path:
    """Write a tiny random DeepSeek-V3 HF checkpoint (config.json + model.safetensors) into ``path``.

    ``rope_key`` chooses how config.json names the RoPE dict: ``"rope_parameters"`` (HF 5.x, ``rope_type``)
    or ``"rope_scaling"`` (older configs and the published V3 one, key ``type``). ``fp8`` stores the linear
    weights block-quantised; use ``load_dequantized_state_dict`` for the matching fp32 reference weights.
    """
    from transformers import DeepseekV3ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    kwargs = tiny_config_kwargs(q_lora_rank=q_lora_rank, yarn=yarn, rope_key=rope_key, **overrides)
    n_layers = kwargs["num_hidden_layers"]
    generator = torch.Generator().manual_seed(seed)

    # Build one extra layer when an MTP module is wanted: its decoder block is an ordinary V3 layer.
    build_kwargs = dict(kwargs, num_hidden_layers=n_layers + (1 if mtp else 0))
    model = DeepseekV3ForCausalLM(_hf_config(build_kwargs)).float().eval()
    _reinit(model, generator, router_bias)

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tensors = load_file(str(Path(tmp) / "model.safetensors"))
        config = json.loads((Path(tmp) / "config.json").read_text())

    hidden, vocab = kwargs["hidden_size"], kwargs["vocab_size"]
    if mtp:
        mtp_prefix = f"model.layers.{n_layers}."

        def rand(*shape: int, fan_in: int | None = None) -> torch.Tensor:
            t = torch.randn(*shape, generator=generator)
            return t / math.sqrt(fan_in) if fan_in else t

        tensors[mtp_prefix + "enorm.weight"] = 1.0 + 0.1 * rand(hidden)
        tensors[mtp_prefix + "hnorm.weight"] = 1.0 + 0.1 * rand(hidden)
        tensors[mtp_prefix + "eh_proj.weight"] = rand(hidden, 2 * hidden, fan_in=2 * hidden)
        tensors[mtp_prefix + "shared_head.norm.weight"] = 1.0 + 0.1 * rand(hidden)
        tensors[mtp_prefix + "shared_head.head.weight"] = rand(vocab, hidden, fan_in=hidden)
        # The published V3 checkpoint repeats the embedding inside the MTP layer.
        tensors[mtp_prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()

    if fp8:
        for name in list(tensors):
            if name.endswith(_FP8_SUFFIXES) and tensors[name].dim() == 2:
                q, s = quantize_fp8_block(tensors[name])
                tensors[name] = q
                tensors[name[: -len("weight")] + "weight_scale_inv"] = s
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        }

    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"), {"format": "pt"}
    )

    config["num_hidden_layers"] = n_layers
    config["num_nextn_predict_layers"] = 1 if mtp else 0
    config.pop("num_mtp_layers", None)
    rope = config.pop("rope_parameters", None) or kwargs["rope"]
    if rope_key == "rope_scaling":
        # Old-style config: `rope_theta` at the top level, `type` inside the scaling dict (or none at all).
        rope = dict(rope)
        config["rope_theta"] = rope.pop("rope_theta", 10000.0)
        kind = rope.pop("rope_type", "default")
        config["rope_scaling"] = None if kind == "default" else {"type": kind, **rope}
    else:
        config["rope_parameters"] = rope
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return path


def load_dequantized_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with FP8 weights dequantised to fp32 and the scales dropped."""
    tensors = load_file(str(Path(path) / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith("weight_scale_inv"):
            continue
        scale_name = name[: -len("weight")] + "weight_scale_inv"
        out[name] = reference_dequantize(t, tensors[scale_name]) if scale_name in tensors else t
    return out


def load_hf_reference(path: str | Path) -> Any:
    """HF ``DeepseekV3ForCausalLM`` (fp32, eager attention) holding the checkpoint's weights, FP8 dequantised.

    Loads through a plain ``state_dict`` so that FP8 checkpoints and the MTP layer (which HF ignores) work.
    """
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    path = Path(path)
    config = DeepseekV3Config.from_pretrained(str(path))
    config.quantization_config = None
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config)
    model.config._attn_implementation = "eager"
    state = load_dequantized_state_dict(path)
    n_layers = config.num_hidden_layers
    hf_state = _to_hf_names(
        {k: v for k, v in state.items() if not k.startswith(f"model.layers.{n_layers}.")}, config
    )
    model.load_state_dict(hf_state, strict=True, assign=True)
    # Non-persistent buffers (rotary inv_freq) were created on meta: rebuild them on CPU.
    model.model.rotary_emb = type(model.model.rotary_emb)(config)
    return model.float().eval()


def hf_greedy(path: str | Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Transformers' greedy ``generate`` of ``new_tokens`` per prompt (EOS ignored, like ``ignore_eos``)."""
    hf = load_hf_reference(path)
    hf.generation_config.eos_token_id = None
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False
            )
            out.append(gen[0, len(p) :].tolist())
    return out


def _to_hf_names(state: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """Real checkpoint names → HF 5.x module names (experts fused into 3-D gate_up_proj / down_proj)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in state.items():
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            prefix = ".".join(parts[: i + 1])
            experts.setdefault(prefix, {}).setdefault(int(parts[i + 1]), {})[parts[i + 2]] = t
        else:
            out[name] = t.float()
    for prefix, by_expert in experts.items():
        ids = sorted(by_expert)
        out[prefix + ".gate_up_proj"] = torch.stack(
            [torch.cat([by_expert[e]["gate_proj"], by_expert[e]["up_proj"]], 0) for e in ids]
        ).float()
        out[prefix + ".down_proj"] = torch.stack([by_expert[e]["down_proj"] for e in ids]).float()
    return out
