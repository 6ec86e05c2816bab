"""MTP speculative decoding against the same engine without speculation (issue 13), interleaved rounds.

Figures (a Markdown table, no assertions): single-stream decode tokens/s with K = 1, 2, 3 draft tokens and
without speculation (each against the same round's run without speculation: median and range of the
per-round ratios), and 16 concurrent streams (where the adaptive switch holds drafting off above
``--max-batch-size``); the acceptance rate, the mean accept length (tokens per verify step), and whether
every output equals the non-speculative one token for token.

Models: ``builtin:sovereign-tiny`` (its MTP layer is trained; prompts are held-out questions, answers as the
model ends them) and, with ``--mid``, a random DeepSeek-V3 checkpoint of the vLLM bench's mid size
(bench/vllm_peer.py; random MTP weights, so drafts are rarely accepted: the figure shows what a useless
draft costs). Each round runs every configuration once, in a rotating order, on one thread.

Usage: nice -n 10 .venv/bin/python bench/speculative.py [--rounds 5] [--mid] [--max-tokens 64]
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

from sovereign_runtime.builtin import resolve_builtin, tasks  # noqa: E402
from sovereign_runtime.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from sovereign_runtime.engine.sampling import SamplingParams  # noqa: E402
from sovereign_runtime.engine.speculative import SpeculativeConfig  # noqa: E402
from sovereign_runtime.model import load_model  # noqa: E402
from sovereign_runtime.tokenizer import Tokenizer  # noqa: E402


def builtin_prompts(n: int) -> tuple[Path, list[list[int]]]:
    path = resolve_builtin("sovereign-tiny")
    tok = Tokenizer.from_dir(path)
    return path, [tok.encode_chat(q.messages())[1] for q in tasks.make_questions(n, seed=11)]


def mid_prompts(n: int) -> tuple[Path, list[list[int]]]:
    sys.path.insert(0, str(ROOT / "bench"))
    from vllm_peer import mid_checkpoint

    path = mid_checkpoint(mtp=True)
    gen = torch.Generator().manual_seed(0)
    return path, [torch.randint(3, 1000, (48,), generator=gen).tolist() for _ in range(n)]


def run(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, streams: int
) -> tuple[float, float, list[list[int]]]:
    """Wall seconds and this thread's CPU seconds to finish ``prompts``, ``streams`` at a time, and the
    outputs. CPU time does not count waiting for a core, so it holds steadier on a loaded host."""
    outputs: list[list[int]] = []
    started, cpu = time.perf_counter(), time.thread_time()
    for i in range(0, len(prompts), streams):
        outputs += engine.generate(prompts[i : i + streams], params)
    return time.perf_counter() - started, time.thread_time() - cpu, outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--mid", action="store_true", help="the random mid-size checkpoint instead of the built-in"
    )
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--single-prompts", type=int, default=8)
    ap.add_argument("--batch-prompts", type=int, default=32)
    ap.add_argument(
        "--max-batch-size", type=int, default=None, help="the adaptive switch (default: the engine's)"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    path, prompts = (mid_prompts if args.mid else builtin_prompts)(
        max(args.single_prompts, args.batch_prompts)
    )
    model, _ = load_model(path)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    configs: dict[str, SpeculativeConfig | None] = {"off": None}
    for k in (1, 2, 3):
        extra = {} if args.max_batch_size is None else {"max_batch_size": args.max_batch_size}
        configs[f"K={k}"] = SpeculativeConfig(num_draft_tokens=k, **extra)
    # No prefix cache: every run computes its prompts afresh, so runs compare like for like.
    engines = {
        name: LLMEngine.from_model(model, EngineConfig(speculative=c, enable_prefix_caching=False))
        for name, c in configs.items()
    }
    workloads = {
        "single stream": (prompts[: args.single_prompts], 1),
        "16 streams": (prompts[: args.batch_prompts], 16),
    }
    for engine in engines.values():  # warm-up
        run(engine, prompts[:2], params, 2)
    rates: dict[tuple[str, str], list[float]] = {}
    cpu_rates: dict[tuple[str, str], list[float]] = {}
    reference: dict[str, list[list[int]]] = {}
    identical: dict[tuple[str, str], bool] = {}
    names = list(engines)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for work, (ps, streams) in workloads.items():
            for name in order:
                seconds, cpu, outs = run(engines[name], ps, params, streams)
                rates.setdefault((work, name), []).append(sum(len(o) for o in outs) / seconds)
                cpu_rates.setdefault((work, name), []).append(sum(len(o) for o in outs) / cpu)
                if name == "off":
                    reference.setdefault(work, outs)
                else:
                    identical[(work, name)] = identical.get((work, name), True)
                    identical[(work, name)] &= outs == reference.get(work, outs)
    for (work, name), same in identical.items():  # the first rounds ran before "off" in some orders
        _, _, outs = run(engines[name], workloads[work][0], params, workloads[work][1])
        identical[(work, name)] = same and outs == reference[work]
    model_name = "random mid-size DeepSeek-V3 (bench/vllm_peer.py)" if args.mid else "builtin:sovereign-tiny"
    print(f"\n{model_name}, {args.rounds} rounds, greedy, max_tokens {args.max_tokens}, 1 thread\n")
    print(
        "| workload | config | tokens/s (median) | vs off (median of per-round ratios, range) "
        "| tokens per CPU second, vs off | acceptance | accept length | outputs identical |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for work in workloads:
        for name in names:
            med = statistics.median(rates[(work, name)])
            # Each round's figure against the same round's "off": the host's load drifts between rounds.
            ratios = [a / b for a, b in zip(rates[(work, name)], rates[(work, "off")], strict=True)]
            vs = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
            cpu_ratios = [
                a / b for a, b in zip(cpu_rates[(work, name)], cpu_rates[(work, "off")], strict=True)
            ]
            vs_cpu = f"{statistics.median(cpu_ratios):.2f}x ({min(cpu_ratios):.2f}-{max(cpu_ratios):.2f})"
            st = engines[name].stats()
            acc = f"{st.spec_decode_acceptance_rate:.2f}" if name != "off" else "-"
            length = f"{st.spec_decode_mean_accept_length:.2f}" if name != "off" else "-"
            same = "-" if name == "off" else ("yes" if identical[(work, name)] else "NO")
            vs, vs_cpu = (vs, vs_cpu) if name != "off" else ("1.00x", "1.00x")
            print(f"| {work} | {name} | {med:.1f} | {vs} | {vs_cpu} | {acc} | {length} | {same} |")
    print("\n(acceptance and accept length: the engine's totals over every workload and round)")


if __name__ == "__main__":
    main()
