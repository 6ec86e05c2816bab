"""DeepSeek-V3 in torch over the paged latent KV cache (see docs/CONTRACTS.md, "Model ↔ engine")."""

from .config import ModelConfig, RopeConfig, kv_bytes_per_token, mha_kv_bytes_per_token
from .context import AttentionMetadata, attention_context, get_attention_metadata
from .deepseek_v3 import DeepseekV3ForCausalLM
from .fp8 import Fp8Linear, dequantize_fp8_block
from .loader import load_model
from .standalone import PagedRunner, greedy_generate, prompt_logits

__all__ = [
    "AttentionMetadata",
    "DeepseekV3ForCausalLM",
    "Fp8Linear",
    "ModelConfig",
    "PagedRunner",
    "RopeConfig",
    "attention_context",
    "dequantize_fp8_block",
    "get_attention_metadata",
    "greedy_generate",
    "kv_bytes_per_token",
    "load_model",
    "mha_kv_bytes_per_token",
    "prompt_logits",
]
