"""MTP speculative decoding at DeepSeek-V3's shapes on one GPU (issue 13's prepared script).

Builds a random model with V3's layer shapes (hidden 7168, 128 heads, MLA ranks 1536/512, 256 routed
experts of 2048, top-8, vocab 129280) but ``--layers`` decoder layers plus its MTP layer (all 61 do not fit
one GPU in bf16), straight on the device (no checkpoint is written), and measures end-to-end decode
tokens/s with K = 1, 2, 3 against no speculation, at 1 and 16 streams, interleaved over ``--rounds``, with
the acceptance rate and whether the outputs are identical.

Random MTP weights are rarely accepted, so this shows what a draft costs at V3's shapes (the verify step's
extra positions and the MTP passes) more than what a trained one gains; a trained MTP layer's gain is the
accept length over that cost. Prints a Markdown table; nothing is asserted.

Usage (on the GPU machine): python bench/speculative_gpu.py [--layers 3] [--rounds 3] [--shape v3|tiny]
``--shape tiny`` runs the same on CPU with toy dims (a smoke test of the script itself).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))

from sovereign_runtime.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from sovereign_runtime.engine.sampling import SamplingParams  # noqa: E402
from sovereign_runtime.engine.speculative import SpeculativeConfig  # noqa: E402
from sovereign_runtime.model.config import ModelConfig  # noqa: E402
from sovereign_runtime.model.deepseek_v3 import DeepseekV3ForCausalLM  # noqa: E402

V3 = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
          num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
          qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8, n_group=8,
          topk_group=4, n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1)  # fmt: skip
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
            v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
            n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1)  # fmt: skip


def build(shape: dict[str, object], layers: int, device: str, dtype: torch.dtype) -> DeepseekV3ForCausalLM:
    raw = dict(shape, num_hidden_layers=layers, num_nextn_predict_layers=1, max_position_embeddings=4096,
               rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=0, norm_topk_prob=True,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # fmt: skip
    config = ModelConfig.from_dict(raw)
    # Drawn on the device: ~70 GB of bf16 weights at V3's shapes would take minutes on the host.
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
            else:
                p.zero_()
    return model.eval().requires_grad_(False)


def timed(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, sync: bool
) -> tuple[float, list[list[int]]]:
    if sync:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = engine.generate(prompts, params)
    if sync:
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shape", choices=("v3", "tiny"), default="v3")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    gpu = args.shape == "v3"
    device = "cuda" if gpu else "cpu"
    dtype = torch.bfloat16 if gpu else torch.float32
    model = build(V3 if gpu else TINY, args.layers, device, dtype)
    vocab = int(model.config.vocab_size)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (256,), generator=gen).tolist() for _ in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    names = ["off", "K=1", "K=2", "K=3"]
    engines = {
        name: LLMEngine.from_model(
            model,
            EngineConfig(
                device=device,
                num_kv_blocks=2048,
                enable_prefix_caching=False,
                speculative=None
                if name == "off"
                else SpeculativeConfig(num_draft_tokens=int(name[2:]), max_batch_size=0),
            ),
        )
        for name in names
    }
    for e in engines.values():
        timed(e, prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), gpu)  # warm-up
    rates: dict[tuple[int, str], list[float]] = {}
    outputs: dict[tuple[int, str], list[list[int]]] = {}
    for r in range(args.rounds):
        for batch in (1, 16):
            order = names[r % 4 :] + names[: r % 4]
            for name in order:
                seconds, out = timed(engines[name], prompts[:batch], params, gpu)
                rates.setdefault((batch, name), []).append(sum(len(o) for o in out) / seconds)
                outputs[(batch, name)] = out
    shape = "DeepSeek-V3 layer shapes" if gpu else "toy shapes (--shape tiny)"
    print(f"\n{shape}, {args.layers} layers + MTP, {dtype}, {device}, {args.rounds} rounds\n")
    print("| streams | config | tokens/s (median) | vs off | acceptance | identical |")
    print("|---|---|---|---|---|---|")
    for batch in (1, 16):
        base = statistics.median(rates[(batch, "off")])
        for name in names:
            med = statistics.median(rates[(batch, name)])
            st = engines[name].stats()
            same = (
                "-"
                if name == "off"
                else ("yes" if outputs[(batch, name)] == outputs[(batch, "off")] else "NO")
            )
            acc = "-" if name == "off" else f"{st.spec_decode_acceptance_rate:.2f}"
            print(f"| {batch} | {name} | {med:.1f} | {med / base:.2f}x | {acc} | {same} |")


if __name__ == "__main__":
    main()
