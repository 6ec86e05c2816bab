"""The step token budget (``serve --max-num-batched-tokens``): what it gives a long prompt, what it costs the
streams beside it, and how much of a served decode is the server. The engine in process, one thread, the
mid-size checkpoint of bench/vllm_peer.py; no assertions (docs/BENCHMARKS.md "Fifth run").

1. TTFT of a lone prompt (1000 and 4000 tokens) per budget, thread CPU time, min over the prompts after
   the first, the engines' prompts alternating;
2. 16 sequences decoding when one long prompt arrives: the prompt's TTFT, the steps it takes and the
   longest of them (the gap the decoding streams see), per budget;
3. ``--served``: 16 streams x 128 tokens through ``LLMEngine.generate`` in this process against the same
   prompts sent to ``sovereign_runtime serve`` over HTTP, alternating.

Usage: .venv/bin/python bench/step_budget.py [--budgets 512,1024,2048] [--served]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))
sys.path.insert(0, str(ROOT / "bench"))

from sovereign_runtime.allocator import tune_malloc  # noqa: E402
from sovereign_runtime.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from sovereign_runtime.engine.sampling import SamplingParams  # noqa: E402
from vllm_peer import OursServer, _concurrent, _random_prompts, mid_checkpoint  # noqa: E402

VOCAB_DRAWN = 4000  # token ids drawn below this (the mid-size vocabulary is 4096)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return _random_prompts(rng, 1, n, VOCAB_DRAWN)[0]


def _engine(path: Path, budget: int) -> LLMEngine:
    config = EngineConfig(num_kv_blocks=4096, max_num_batched_tokens=budget, enable_prefix_caching=False)
    return LLMEngine.from_pretrained(path, config)


def _first_token(engine: LLMEngine, prompt: list[int]) -> list[float]:
    """Run ``prompt`` to its first token beside whatever the engine holds; the wall time of each step."""
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    steps = []
    while rid in engine.scheduler.requests:
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    return steps


def lone_prompt_ttft(engines: dict[int, LLMEngine], rng: random.Random) -> None:
    for length, rounds in ((1000, 4), (4000, 3)):
        times: dict[int, list[float]] = {b: [] for b in engines}
        for _ in range(rounds):
            for budget, engine in engines.items():
                t0 = time.thread_time()
                _first_token(engine, _prompt(rng, length))
                times[budget].append(time.thread_time() - t0)
        cells = ", ".join(f"budget {b}: {min(v[1:]) * 1000:.0f} ms" for b, v in times.items())
        print(f"lone prompt of {length} tokens, TTFT (thread CPU): {cells}", flush=True)


def beside_decoding_streams(engines: dict[int, LLMEngine], rng: random.Random, streams: int = 16) -> None:
    print("| prompt | budget | its TTFT | steps | longest step |\n| --- | --- | --- | --- | --- |")
    for length in (1000, 2000, 4000):
        for warm in (True, False):  # the first round warms each engine at this prompt length
            for budget, engine in engines.items():
                for _ in range(streams):
                    engine.add_request(
                        _prompt(rng, 32), SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
                    )
                for _ in range(5):  # the streams' own prefill done, decoding
                    engine.step()
                steps = _first_token(engine, _prompt(rng, length))
                engine.abort_all()
                if not warm:
                    print(
                        f"| {length} tokens | {budget} | {sum(steps) * 1000:.0f} ms | {len(steps)} |"
                        f" {max(steps) * 1000:.0f} ms |",
                        flush=True,
                    )


def served_against_in_process(path: Path, rng: random.Random, rounds: int = 3, streams: int = 16) -> None:
    engine = LLMEngine.from_pretrained(path, EngineConfig(kv_cache_gib=2))
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    engine.generate([_prompt(rng, 16)], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    with OursServer(path, 18123, 8192) as server:
        asyncio.run(_concurrent(server.url, [_prompt(rng, 16)], 4))
        for r in range(rounds):
            prompts = [_prompt(rng, 16) for _ in range(streams)]
            t0 = time.perf_counter()
            engine.generate(prompts, params)
            in_process = streams * 128 / (time.perf_counter() - t0)
            wall, _ = asyncio.run(_concurrent(server.url, prompts, 128))
            served = streams * 128 / wall
            print(
                f"round {r + 1}: in process {in_process:.0f} tokens/s, served {served:.0f} tokens/s,"
                f" served / in process {served / in_process:.2f}",
                flush=True,
            )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", default="512,1024,2048", help="comma-separated step token budgets")
    ap.add_argument("--served", action="store_true", help="also served against in process (part 3)")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # the served engine's too
    torch.set_num_threads(1)
    print(tune_malloc(os.environ))  # what serve does
    path, rng = mid_checkpoint(), random.Random(0)
    engines = {int(b): _engine(path, int(b)) for b in args.budgets.split(",")}
    lone_prompt_ttft(engines, rng)
    beside_decoding_streams(engines, rng)
    if args.served:
        served_against_in_process(path, rng)
    return 0


if __name__ == "__main__":
    sys.exit(main())
