"""KV-cache bytes per token: MLA's latent cache vs an MHA cache of the same model, computed and measured.

    .venv/bin/python bench/kv_bytes_per_token.py

Computed: from the config (DeepSeek-V3 and the tiny test model). Measured on the tiny model: the bytes our
paged cache actually fills for a prompt, against the per-head K and V tensors that HF transformers'
DeepSeek-V3 attention materialises for the same prompt (what an MHA cache would have to keep).
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))
sys.path.insert(0, str(ROOT / "tests" / "runtime"))

from checkpoints import load_hf_reference, write_tiny_checkpoint  # noqa: E402
from sovereign_runtime.model import (  # noqa: E402
    ModelConfig,
    PagedRunner,
    kv_bytes_per_token,
    load_model,
    mha_kv_bytes_per_token,
)

V3 = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 61,
    "num_attention_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128,
}  # fmt: skip


def main() -> None:
    torch.set_num_threads(1)
    v3 = ModelConfig.from_dict(V3)
    mla, mha = kv_bytes_per_token(v3, 2), mha_kv_bytes_per_token(v3, 2)
    print("| model | MLA cache B/token | MHA cache B/token | MLA / MHA | how |")
    print("| --- | ---: | ---: | ---: | --- |")
    print(
        f"| DeepSeek-V3, bf16 | {mla:,} | {mha:,} | {mla / mha:.2%} ({mha / mla:.1f}× smaller) | computed |"
    )

    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_checkpoint(tmp, mtp=False)
        model, config = load_model(path)
        prompt = list(range(2, 2 + 100))
        runner = PagedRunner(model, num_blocks=16, block_size=16)
        sid = runner.new_sequence()
        runner.step([(sid, prompt)])
        filled = runner.cache[:, runner._blocks[sid]]  # every layer's blocks this sequence owns
        used = int((filled.abs().sum(-1) != 0).sum()) * config.kv_cache_dim * filled.element_size()
        ours = used / len(prompt)

        ref = load_hf_reference(path)
        expanded = 0

        def count(_module: torch.nn.Module, _args: object, out: tuple[torch.Tensor, torch.Tensor]) -> None:
            nonlocal expanded
            expanded += sum(t.numel() * t.element_size() for t in out)

        for layer in ref.model.layers:
            layer.self_attn.expand_kv = _hooked(layer.self_attn.expand_kv, count)
        with torch.no_grad():
            ref(torch.tensor([prompt]))
        theirs = expanded / len(prompt)
        print(
            f"| tiny test model, fp32 | {ours:,.0f} (computed {kv_bytes_per_token(config, 4):,}) | "
            f"{theirs:,.0f} (computed {mha_kv_bytes_per_token(config, 4):,}) | {ours / theirs:.2%} | measured |"
        )


def _hooked(
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]], hook: Callable[..., None]
) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    def wrapper(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        out = fn(*args, **kwargs)
        hook(None, args, out)
        return out

    return wrapper


if __name__ == "__main__":
    main()
