"""The output guard's figures: its decode cost, false positives on clean traffic, the self-test's duration.

    nice -n 10 .venv/bin/python bench/output_guard.py cost [--repeats 10] [--tokens 128]
    nice -n 10 .venv/bin/python bench/output_guard.py false-positives [--requests 10000]
    nice -n 10 .venv/bin/python bench/output_guard.py self-test [--repeats 5]

``cost``: decode tokens/s of one engine with the guard on (finite check on the sampler's sync, per-sequence
isolation in the step) and off (``LLMEngine.set_output_guard(False)``: the same build without them),
single stream and 16 streams, interleaved run by run (alternating which goes first) so load on a shared
host hits both alike; best and median of ``--repeats``.

``false-positives``: clean requests through the engine at batch sizes 1..64 (``max_num_seqs`` cycling
through them, each wave filling the batch) with mixed sampling (greedy, temperature, top-k, top-p, seeds,
logprobs), on the built-in fp32 model, a random FP8 block-quantised checkpoint and the built-in model in
bf16; counts requests that ended with ``finish_reason == "error"`` (each one would be a false positive),
plus self-test runs between waves that did not pass.

``self-test``: the startup self-test's wall time on ``builtin:sovereign-tiny`` (after warm-up).

Prints Markdown rows; asserts nothing. One torch thread (see bench/runtime_throughput.py for why).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))

from sovereign_runtime.builtin import resolve_builtin  # noqa: E402
from sovereign_runtime.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from sovereign_runtime.engine.sampling import SamplingParams  # noqa: E402
from sovereign_runtime.engine.selftest import SelfTest, SelfTestConfig, SelfTestReport, tiny_known_answers  # noqa: E402

TINY = resolve_builtin("sovereign-tiny")


def _decode_rate(engine: LLMEngine, streams: int, tokens: int, seed: int) -> float:
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompts = [[rng.randrange(2, 100) for _ in range(8)] for _ in range(streams)]
    for p in prompts:
        engine.add_request(p, params)
    # Prefill first (not timed): the figure is decode tokens/s.
    while any(s.num_output_tokens == 0 for s in engine.scheduler.requests.values()):
        engine.step()
    t0 = time.perf_counter()
    produced = 0
    while engine.has_unfinished():
        produced += len(engine.step())
    return produced / (time.perf_counter() - t0)


def cost(args: argparse.Namespace) -> None:
    engine = LLMEngine.from_pretrained(TINY, EngineConfig(max_num_seqs=16))
    _decode_rate(engine, 4, 16, 0)  # warm
    print(
        "| streams | guard on, tokens/s (best / median) | guard off (best / median) | on / off (best, median) |"
    )
    print("| --- | --- | --- | --- |")
    for streams in (1, 16):
        rates: dict[bool, list[float]] = {True: [], False: []}
        for r in range(args.repeats):
            order = (True, False) if r % 2 == 0 else (False, True)
            for on in order:
                engine.set_output_guard(on)
                rates[on].append(_decode_rate(engine, streams, args.tokens, r))
        engine.set_output_guard(True)
        best = {k: max(v) for k, v in rates.items()}
        med = {k: statistics.median(v) for k, v in rates.items()}
        print(
            f"| {streams} | {best[True]:.1f} / {med[True]:.1f} | {best[False]:.1f} / {med[False]:.1f} |"
            f" {best[True] / best[False]:.4f} / {med[True] / med[False]:.4f} |"
        )


def _mixed_params(rng: random.Random) -> SamplingParams:
    kind = rng.randrange(5)
    tokens = rng.randint(1, 6)
    if kind == 0:
        return SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    if kind == 1:
        return SamplingParams(temperature=0.9, max_tokens=tokens, seed=rng.randrange(1 << 30))
    if kind == 2:
        return SamplingParams(temperature=0.7, top_k=rng.randint(1, 40), max_tokens=tokens)
    if kind == 3:
        return SamplingParams(temperature=1.0, top_p=rng.uniform(0.3, 1.0), max_tokens=tokens, logprobs=2)
    return SamplingParams(temperature=0.0, max_tokens=tokens, logprobs=0, min_tokens=1)


def _paths() -> list[tuple[str, Path, torch.dtype | None]]:
    sys.path.insert(0, str(ROOT / "tests" / "runtime"))
    from checkpoints import write_tiny_checkpoint

    fp8 = write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "fp8", fp8=True)
    return [
        ("unified fp32 (builtin)", TINY, None),
        ("unified FP8 (random)", fp8, None),
        ("unified bf16 (builtin)", TINY, torch.bfloat16),
    ]


def false_positives(args: argparse.Namespace) -> None:
    from sovereign_runtime.engine.async_engine import AsyncEngine

    print("| path | requests | batch sizes | errors (false positives) | self-tests run / failed |")
    print("| --- | --- | --- | --- | --- |")
    per_path = args.requests // len(_paths())
    for label, path, dtype in _paths():
        rng = random.Random(14)
        errors = done = 0
        tests = failed = 0
        sizes = list(range(1, 65))
        wave = 0
        while done < per_path:
            size = sizes[wave % len(sizes)]
            wave += 1
            engine = _engine_for(path, dtype, size)
            vocab = engine.vocab_size
            n = min(size, per_path - done)
            for _ in range(n):
                prompt = [rng.randrange(2, vocab) for _ in range(rng.randint(1, 24))]
                engine.add_request(prompt, _mixed_params(rng))
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        done += 1
                        errors += out.finish_reason == "error"
            if wave % 16 == 0:  # the self-test on the same engine, as the periodic one runs
                async_engine = AsyncEngine(engine)
                try:
                    report = asyncio.run(_self_test(SelfTest(async_engine)))
                finally:
                    async_engine.shutdown()
                tests += 1
                failed += not report.ok
        print(f"| {label} | {done} | 1..64 | {errors} | {tests} / {failed} |")


_ENGINES: dict[tuple[str, str, int], LLMEngine] = {}


def _engine_for(path: Path, dtype: torch.dtype | None, size: int) -> LLMEngine:
    # One model per path; the batch size is the scheduler's max_num_seqs, so each wave fills it.
    key = (str(path), str(dtype), 0)
    if key not in _ENGINES:
        _ENGINES[key] = LLMEngine.from_pretrained(path, EngineConfig(max_num_seqs=64, dtype=dtype))
    engine = _ENGINES[key]
    engine.scheduler.config.max_num_seqs = size
    return engine


async def _self_test(test: SelfTest) -> SelfTestReport:
    return await test.run()


def self_test(args: argparse.Namespace) -> None:
    from sovereign_runtime.engine.async_engine import AsyncEngine
    from sovereign_runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(TINY)
    durations = []
    for _ in range(args.repeats):
        engine = AsyncEngine(LLMEngine.from_pretrained(TINY, EngineConfig()))
        try:
            test = SelfTest(engine, SelfTestConfig(known_answers=tiny_known_answers(tokenizer)))
            test.take_fingerprint()
            report = asyncio.run(_self_test(test))
            assert report.ok, report.to_json()
            durations.append(report.duration_s)
        finally:
            engine.shutdown()
    print("| figure | median | min | max |")
    print("| --- | --- | --- | --- |")
    print(
        f"| startup self-test, s (builtin:sovereign-tiny, {args.repeats} runs) | {statistics.median(durations):.3f}"
        f" | {min(durations):.3f} | {max(durations):.3f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="figure", required=True)
    c = sub.add_parser("cost")
    c.add_argument("--repeats", type=int, default=10)
    c.add_argument("--tokens", type=int, default=128)
    f = sub.add_parser("false-positives")
    f.add_argument("--requests", type=int, default=10_000)
    s = sub.add_parser("self-test")
    s.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    {"cost": cost, "false-positives": false_positives, "self-test": self_test}[args.figure](args)


if __name__ == "__main__":
    main()
