"""Where a CPU decode step's time goes (docs/engine.md): the engine in process, one thread, no assertions.

1. ``builtin:sovereign-tiny`` single stream, plain and with MTP speculation (K = 1): median wall time of a
   decode step and of its parts (the main forward, the LM head, the sampler, the MTP pass and its head),
   16 held-out questions up to 64 tokens each;
2. the mid-size checkpoint (bench/vllm_peer.py) at 1, 16 and 64 sequences: a decode step and the share of
   its attention, routed + shared experts (MoE), dense MLP, as module wall time;
3. the decode KV gather into a reused buffer against a fresh tensor per layer (the buffer's size limit set
   to 0), steps alternating in one engine, median thread CPU time per step.

Usage: .venv/bin/python bench/decode_profile.py [--steps 40] [--batches 1,16,64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))
sys.path.insert(0, str(ROOT / "bench"))

from sovereign_runtime.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from sovereign_runtime.engine.sampling import SamplingParams  # noqa: E402
from sovereign_runtime.engine.speculative import SpeculativeConfig  # noqa: E402
from sovereign_runtime.model import context, load_model  # noqa: E402
from sovereign_runtime.model.layers import MLP, MLAAttention, MoE  # noqa: E402


def _timed(times: dict[str, list[float]], label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        times[label].append(time.perf_counter() - t)
        return out

    return wrapper


def builtin_parts() -> None:
    from speculative import builtin_prompts

    path, prompts = builtin_prompts(16)
    model, _ = load_model(path)
    params = SamplingParams(temperature=0.0, max_tokens=64)
    print("builtin:sovereign-tiny, single stream, median ms per decode step")
    print("| config | step | main forward | LM head | sampler | MTP pass | MTP head | tokens/step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    counts: list[tuple[int, dict[str, float]]] = []
    for k in (0, 1):
        spec = SpeculativeConfig(num_draft_tokens=k) if k else None
        engine = LLMEngine.from_model(model, EngineConfig(enable_prefix_caching=False, speculative=spec))
        engine.generate(prompts[:2], params)  # warm-up
        times: dict[str, list[float]] = defaultdict(list)
        engine.step = _timed(times, "step", engine.step)  # type: ignore[method-assign]
        runner = engine.runner
        for name in ("forward", "compute_logits", "mtp_hidden", "mtp_head"):
            if hasattr(model, name):
                setattr(model, name, _timed(times, name, getattr(model, name)))
        runner.sampler = _timed(times, "sampler", runner.sampler)  # type: ignore[assignment]
        tokens = steps = 0
        for prompt in prompts:
            engine.add_request(prompt, params)
            engine.step()  # the prefill
            times.clear()
            while engine.has_unfinished():
                tokens += sum(len(o.new_token_ids) for o in engine.step())
                steps += 1
        for name in ("forward", "compute_logits", "mtp_hidden", "mtp_head"):
            model.__dict__.pop(name, None)

        def ms(label: str, times: dict[str, list[float]] = times) -> str:
            return f"{statistics.median(times[label]) * 1e3:.3f}" if times.get(label) else "-"

        print(
            f"| {'K=1' if k else 'off'} | {ms('step')} | {ms('forward')} | {ms('compute_logits')} "
            f"| {ms('sampler')} | {ms('mtp_hidden')} | {ms('mtp_head')} | {tokens / steps:.2f} |"
        )
        counts.append((k, _op_counts(engine, model, prompts[0], params)))
    print("\ntop-level aten ops per decode step (torch.profiler; each costs microseconds at these sizes)")
    for k, ops in counts:
        total = sum(ops.values())
        parts = ", ".join(f"{name} {n:.0f}" for name, n in sorted(ops.items(), key=lambda kv: -kv[1]))
        print(f"- {'K=1' if k else 'off'}: {total:.0f} ({parts})")


def _op_counts(engine: LLMEngine, model: Any, prompt: list[int], params: SamplingParams) -> dict[str, float]:
    """Top-level aten ops per decode step, by the engine part that issued them."""
    from torch.profiler import ProfilerActivity, profile, record_function

    def labelled(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with record_function("part:" + label):
                return fn(*args, **kwargs)

        return wrapper

    parts = {"forward": model, "compute_logits": model, "mtp_hidden": model, "mtp_head": model}
    for name, owner in parts.items():
        if hasattr(owner, name):
            setattr(owner, name, labelled(name, getattr(owner, name)))
    for name, owner in (
        ("sampler", engine.runner),
        ("prepare", engine.runner),
        ("schedule", engine.scheduler),
    ):
        setattr(owner, name, labelled(name, getattr(owner, name)))
    if engine.drafter is not None:
        engine.drafter.propose = labelled("propose", engine.drafter.propose)  # type: ignore[method-assign]
    engine.add_request(prompt, params)
    engine.step()
    engine.step()
    steps = 10
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    for name in parts:
        model.__dict__.pop(name, None)
    counts: dict[str, float] = defaultdict(float)
    for event in prof.events():
        parent = event.cpu_parent
        if not event.name.startswith("aten::") or (parent is not None and parent.name.startswith("aten::")):
            continue
        label = "engine"
        while parent is not None:  # the innermost labelled part (propose holds mtp_hidden and mtp_head)
            if parent.name.startswith("part:"):
                label = parent.name[len("part:") :]
                break
            parent = parent.cpu_parent
        counts[label] += 1 / steps
    return dict(counts)


def _mid_engine(model: Any, batch: int, seed: int) -> LLMEngine:
    engine = LLMEngine.from_model(
        model, EngineConfig(enable_prefix_caching=False, max_model_len=8192, kv_cache_gib=2)
    )
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(3, 4096, (16,), generator=gen).tolist(), params)
    for _ in range(8):  # the prefill and a few decode steps
        engine.step()
    return engine


def mid_shares(batches: list[int], steps: int) -> None:
    from vllm_peer import mid_checkpoint

    model, _ = load_model(mid_checkpoint())
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    inside_moe = {id(e) for moe in moes for e in moe.modules()}
    groups: dict[str, list[torch.nn.Module]] = {
        "attention": [m for m in model.modules() if isinstance(m, MLAAttention)],
        "MoE (routed + shared)": list(moes),
        "dense MLP": [m for m in model.modules() if isinstance(m, MLP) and id(m) not in inside_moe],
    }
    spent: dict[str, float] = defaultdict(float)
    started: dict[int, float] = {}
    for label, modules in groups.items():
        for m in modules:
            m.register_forward_pre_hook(lambda mod, args: started.__setitem__(id(mod), time.perf_counter()))
            m.register_forward_hook(
                lambda mod, args, out, label=label: spent.__setitem__(
                    label, spent[label] + time.perf_counter() - started[id(mod)]
                )
            )
    print("\nmid-size checkpoint, decode step (median ms) and module shares of the step's wall time")
    print(
        "| sequences | step | " + " | ".join(groups) + " | rest (embedding, norm, LM head, sampler, engine) |"
    )
    print("| --- | --- | " + " | ".join("---" for _ in groups) + " | --- |")
    for batch in batches:
        engine = _mid_engine(model, batch, seed=batch)
        spent.clear()
        walls = []
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t)
        total = sum(walls)
        shares = [spent[label] / total for label in groups]
        print(
            f"| {batch} | {statistics.median(walls) * 1e3:.2f} | "
            + " | ".join(f"{s:.0%}" for s in shares)
            + f" | {1 - sum(shares):.0%} |"
        )
    for moe_or_attn in groups.values():
        for m in moe_or_attn:
            m._forward_hooks.clear()
            m._forward_pre_hooks.clear()
    scratch_ab(model, batches, steps)


def scratch_ab(model: Any, batches: list[int], steps: int) -> None:
    print(
        "\nmid-size checkpoint, decode KV gather: reused buffer vs a fresh tensor per layer (CPU ms per step)"
    )
    print("| sequences | reused | fresh | fresh / reused |")
    print("| --- | --- | --- | --- |")
    limit = context.SCRATCH_MAX_BYTES
    try:
        for batch in batches:
            engine = _mid_engine(model, batch, seed=100 + batch)
            reused, fresh = [], []
            for i in range(2 * steps):
                context.SCRATCH_MAX_BYTES = limit if i % 2 == 0 else 0
                t = time.thread_time()
                engine.step()
                (reused if i % 2 == 0 else fresh).append(time.thread_time() - t)
            a, b = statistics.median(reused), statistics.median(fresh)
            print(f"| {batch} | {a * 1e3:.2f} | {b * 1e3:.2f} | {b / a:.2f} |")
    finally:
        context.SCRATCH_MAX_BYTES = limit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batches", default="1,16,64")
    args = ap.parse_args()
    torch.set_num_threads(1)
    builtin_parts()
    mid_shares([int(b) for b in args.batches.split(",")], args.steps)


if __name__ == "__main__":
    main()
