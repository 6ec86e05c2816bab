"""The model configuration the runtime needs, read from an HF DeepSeek-V3 ``config.json``."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN magnitude correction 0.1·mscale·ln(factor)+1 (1 when the context is not stretched)."""
    if factor <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class RopeConfig:
    """RoPE parameters, normalised across ``rope_scaling``/``rope_parameters`` and ``type``/``rope_type``."""

    rope_type: str = "default"  # "default" or "yarn"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


ROUTER_SCORING_FUNCS = ("sigmoid", "softmax")
ROUTER_TOPK_METHODS = ("noaux_tc", "greedy", "group_limited_greedy")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int | None
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    first_k_dense_replace: int
    moe_layer_freq: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    scoring_func: str
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    num_nextn_predict_layers: int = 0
    # How the router picks experts (ROUTER_TOPK_METHODS): V3's "noaux_tc", V2's "greedy" and
    # "group_limited_greedy".
    topk_method: str = "noaux_tc"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    torch_dtype: torch.dtype = torch.float32
    quantization: dict[str, Any] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    # Derived sizes -------------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Values cached per token and layer: the normalised latent then the rotated k_pe (576 for V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times the YaRN mscale² when ``mscale_all_dim`` is set (0.13523 for V3)."""
        scale = self.qk_head_dim**-0.5
        if self.rope.rope_type != "default" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    @property
    def is_fp8(self) -> bool:
        return bool(self.quantization) and self.quantization.get("quant_method") == "fp8"

    @property
    def fp8_block_size(self) -> tuple[int, int]:
        block = (self.quantization or {}).get("weight_block_size") or [128, 128]
        return int(block[0]), int(block[1])

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            self.n_routed_experts is not None
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )

    # Construction ------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        _check_architecture(cfg)
        heads = int(cfg["num_attention_heads"])
        # DeepSeek-V2's config.json (and transformers' DeepseekV2Config) may leave out the softmax
        # router V2 always has; V3's defaults are the sigmoid, bias-corrected one.
        v2 = cfg.get("model_type") == "deepseek_v2"
        scoring_func = str(cfg.get("scoring_func") or ("softmax" if v2 else "sigmoid"))
        if scoring_func not in ROUTER_SCORING_FUNCS:
            raise ValueError(
                f"config.json scoring_func {scoring_func!r} is not supported (valid: {', '.join(ROUTER_SCORING_FUNCS)})"
            )
        topk_method = str(cfg.get("topk_method") or ("greedy" if v2 else "noaux_tc"))
        if topk_method not in ROUTER_TOPK_METHODS:
            raise ValueError(
                f"config.json topk_method {topk_method!r} is not supported (valid: {', '.join(ROUTER_TOPK_METHODS)})"
            )
        dtype_name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        eos = cfg.get("eos_token_id")
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=int(cfg["kv_lora_rank"]),
            qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
            qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
            v_head_dim=int(cfg["v_head_dim"]),
            n_routed_experts=cfg.get("n_routed_experts"),
            n_shared_experts=int(cfg.get("n_shared_experts") or 0),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 1),
            n_group=int(cfg.get("n_group") or 1),
            topk_group=int(cfg.get("topk_group") or 1),
            first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(cfg.get("moe_layer_freq") or 1),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            scoring_func=scoring_func,
            topk_method=topk_method,
            rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
            rope=_rope_from_dict(cfg),
            num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers") or 0),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            hidden_act=str(cfg.get("hidden_act") or "silu"),
            torch_dtype=_DTYPES.get(str(dtype_name).replace("torch.", ""), torch.float32),
            quantization=cfg.get("quantization_config"),
            raw=dict(cfg),
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        return cls.from_dict(json.loads((Path(path) / "config.json").read_text()))


# What every DeepSeek-V2/V3 config.json names: MLA's latent and head dims among them.
REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)


def _check_architecture(cfg: dict[str, Any]) -> None:
    """Refuse, saying why, a config.json this runtime would not run as its model was trained."""
    kind = f"model_type {cfg.get('model_type')!r}, architectures {cfg.get('architectures')}"
    missing = [key for key in REQUIRED_KEYS if cfg.get(key) is None]
    if missing:
        raise ValueError(
            f"config.json ({kind}) is not a DeepSeek-V3 or DeepSeek-V2 architecture checkpoint (Multi-head"
            f" Latent Attention): it lacks {', '.join(missing)}"
        )
    if cfg.get("model_type") == "deepseek_v32" or cfg.get("index_topk") is not None:
        raise ValueError(
            f"config.json ({kind}) uses DeepSeek-V3.2's sparse attention (its lightning indexer,"
            " index_topk), which this runtime does not implement; dense attention would not be the"
            " model it was trained as"
        )


def _rope_from_dict(cfg: dict[str, Any]) -> RopeConfig:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    # Newer configs nest per attention type ({"full_attention": {...}}); DeepSeek has one kind.
    if params and all(isinstance(v, dict) for v in params.values()):
        params = next(iter(params.values()))
    kind = str(params.get("rope_type") or params.get("type") or "default")
    theta = float(params.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind != "yarn":
        raise ValueError(f"rope type {kind!r} is not supported (valid: 'default', 'yarn')")
    original = params.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None:
        factor = float(cfg["max_position_embeddings"]) / float(original)
    return RopeConfig(
        rope_type="yarn",
        theta=theta,
        factor=float(factor),
        original_max_position_embeddings=int(original or cfg.get("max_position_embeddings") or 4096),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


def kv_bytes_per_token(config: ModelConfig, bytes_per_value: int = 2) -> int:
    """Bytes the latent cache holds per token over all layers (70,272 for V3 in bf16)."""
    return config.kv_cache_dim * bytes_per_value * config.num_hidden_layers


def mha_kv_bytes_per_token(config: ModelConfig, bytes_per_value: int = 2) -> int:
    """Bytes an MHA cache of the same model would hold per token: full K (qk_head_dim) and V per head."""
    per_layer = config.num_attention_heads * (config.qk_head_dim + config.v_head_dim)
    return per_layer * bytes_per_value * config.num_hidden_layers
