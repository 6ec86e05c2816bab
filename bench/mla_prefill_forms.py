"""Naive (expand per-head K/V) vs absorbed (attend in latent space) MLA prefill on CPU.

    .venv/bin/python bench/mla_prefill_forms.py [--threads 1] [--heads 16]

One attention layer with DeepSeek-V3 head dims (kv_lora_rank 512, nope 128, rope 64, v 128) and fewer heads,
fp32, through the real paged-cache path. Reports the time of each form and the ratio, for full prompts and
for a 64-token chunk on top of a long cached prefix. Measures the rule behind ``MLAAttention.prefill_form = "auto"``.

``--grid``: new tokens 16..256 over cached prefixes 0..2048. ``--engine``: a chat's next turn (new tokens
over a cached prefix) through the engine on the mid-size checkpoint of bench/vllm_peer.py, TTFT in thread
CPU time, the CPU rule (``absorbed_prefill_pays`` and 4x) against the earlier one (16x), alternating.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from sovereign_runtime.model import ModelConfig, attention_context
from sovereign_runtime.model.layers import MLAAttention
from sovereign_runtime.model.rope import RotaryEmbedding
from sovereign_runtime.model.standalone import PagedRunner


class _OneLayer(torch.nn.Module):
    """Just enough of a model for PagedRunner: one attention layer and an lm_head for device/dtype."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.attn = MLAAttention(config, RotaryEmbedding(config.rope, config.qk_rope_head_dim, 8192))
        self.lm_head = torch.nn.Linear(1, 1)

    def attention_layers(self) -> list[torch.nn.Module]:
        return [self.attn]

    def bind_kv_cache(self, cache: torch.Tensor) -> None:
        self.attn.kv_cache = cache[0]


def run(layer: _OneLayer, prefix: int, chunk: int, absorb: bool, x: torch.Tensor) -> float:
    MLAAttention.prefill_form = "absorbed" if absorb else "naive"
    runner = PagedRunner(layer, num_blocks=(prefix + chunk) // 16 + 2, block_size=16)  # type: ignore[arg-type]
    sid = runner.new_sequence()
    if prefix:
        _, meta = runner.metadata([(sid, [0] * prefix)])
        with attention_context(meta), torch.no_grad():
            layer.attn(x[:prefix], meta.positions)
    _, meta = runner.metadata([(sid, [0] * chunk)])
    start = time.perf_counter()
    with attention_context(meta), torch.no_grad():
        layer.attn(x[prefix : prefix + chunk], meta.positions)
    return time.perf_counter() - start


def next_turn_ttft(repeats: int) -> None:
    """TTFT of ``new`` tokens over a cached ``prefix`` on the mid-size checkpoint, per CPU prefill rule."""
    import random

    import sovereign_runtime.model.layers as layers
    from sovereign_runtime.allocator import tune_malloc
    from sovereign_runtime.engine.engine import EngineConfig, LLMEngine
    from sovereign_runtime.engine.sampling import SamplingParams

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from vllm_peer import _random_prompts, mid_checkpoint

    tune_malloc(os.environ)  # what serve does
    engine = LLMEngine.from_pretrained(mid_checkpoint(), EngineConfig(num_kv_blocks=4096, max_model_len=8192))
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rng = random.Random(0)
    rules = {
        "earlier (16x)": (lambda _config, _query: True, 16),
        "now (cost model, 4x)": (layers.absorbed_prefill_pays, 4),
    }
    print(
        "| cached prefix | new tokens | " + " | ".join(rules) + " |\n| ---: | ---: |" + " ---: |" * len(rules)
    )
    for prefix, new in ((128, 32), (256, 48), (256, 64), (1024, 128), (2048, 128), (4096, 256)):
        best = {name: float("inf") for name in rules}
        for _ in range(repeats):
            for name, (pays, ratio) in rules.items():
                layers.absorbed_prefill_pays, MLAAttention.cpu_absorb_context_ratio = pays, ratio
                cached = _random_prompts(rng, 1, prefix, 4000)[0]
                engine.generate([[*cached, 3]], one)  # the prefix's pages go into the radix cache
                turn = cached + _random_prompts(rng, 1, new, 4000)[0]
                start = time.thread_time()
                engine.generate([turn], one)
                best[name] = min(best[name], time.thread_time() - start)
        cells = " | ".join(f"{t * 1e3:.1f} ms" for t in best.values())
        print(f"| {prefix} | {new} | {cells} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--grid", action="store_true", help="new tokens 16..256 over prefixes 0..2048: where the forms cross"
    )
    parser.add_argument(
        "--engine", action="store_true", help="a chat's next turn through the engine, per rule"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.engine:
        next_turn_ttft(args.repeats)
        return
    config = ModelConfig.from_dict(
        {
            "vocab_size": 16, "hidden_size": 1024, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": args.heads, "q_lora_rank": 384, "kv_lora_rank": 512,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 8192,
        }
    )  # fmt: skip
    layer = _OneLayer(config)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    x = torch.randn(4096, config.hidden_size)
    print(f"heads {args.heads}, threads {args.threads}, fp32, V3 head dims")
    print("| prefix | new tokens | naive (ms) | absorbed (ms) | absorbed / naive |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    cases = [(0, 64), (0, 256), (0, 1024), (256, 64), (1024, 64), (1024, 256), (2048, 64)]
    if args.grid:
        cases = [(p, c) for c in (16, 32, 64, 128, 256) for p in (0, 64, 256, 1024, 2048)]
    for prefix, chunk in cases:
        # Alternate the two forms and keep each one's best time: the machine is shared and noisy.
        naive, absorbed = float("inf"), float("inf")
        for _ in range(args.repeats):
            naive = min(naive, run(layer, prefix, chunk, False, x))
            absorbed = min(absorbed, run(layer, prefix, chunk, True, x))
        print(f"| {prefix} | {chunk} | {naive * 1e3:.1f} | {absorbed * 1e3:.1f} | {absorbed / naive:.2f} |")


if __name__ == "__main__":
    main()
