"""The known-answer self-test behind ``/health/ready``: does this process still compute the right thing?

Checks, each reported by name (``CheckResult``):

- ``batch_invariance``: fixed prompts decoded greedily alone and again inside batches of other sequences
  (batch sizes 1, 3, 8 by default, capped at the engine's ``max_num_seqs``) give the same tokens, and the
  chosen tokens' log-probabilities agree within a tolerance for the model's dtype. A divergence at a near-tie
  (the alone run's two best tokens within that tolerance) ends the comparison for that prompt without a
  failure: at a tie either token is correct.
- ``numerics``: for a sample of decoder layers, each linear on the serving path (FP8 weights dequantised to
  the activation dtype, the runtime's own matmul) against a float64 product with the dequantised weight on
  the same inputs; relative error under a threshold per dtype.
- ``weights``: the parameters still hold the bytes they held after loading (an exact integer fingerprint
  over every parameter's raw bits, taken once at start): catches memory corruption and stray writes.
- ``known_answers`` (``builtin:sovereign-tiny``): held-out questions whose answers are exact.

Requests go through the ``AsyncEngine`` like any client's, so the serving path (scheduler, batching, paged
KV, sampler) is what is tested. Pure parts (comparison, fingerprint) are plain functions.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..model.fp8 import Fp8Linear, dense_weight
from .sampling import SamplingParams

BATCH_INVARIANCE = "batch_invariance"
NUMERICS = "numerics"
WEIGHTS = "weights"
KNOWN_ANSWERS = "known_answers"

# Log-probability agreement between the alone and the batched run, per activation dtype.
LOGPROB_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.15, torch.float16: 0.05}
# Relative error of a serving-path linear against its float64 reference, per activation dtype.
NUMERICS_THRESHOLD = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}
_FINGERPRINT_CHUNK = 1 << 26
log = logging.getLogger("sovereign_runtime.engine")


@dataclass(frozen=True)
class CheckResult:
    name: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class SelfTestReport:
    checks: list[CheckResult]
    started_at: float  # wall-clock seconds (time.time())
    duration_s: float

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failing(self) -> CheckResult | None:
        return next((c for c in self.checks if not c.ok), None)

    def to_json(self) -> dict[str, Any]:
        failing = self.failing
        return {
            "passed": self.ok,
            "failing_check": failing.name if failing else None,
            "reason": f"{failing.name}: {failing.detail}" if failing else None,
            "checks": [{"name": c.name, "passed": c.ok, "detail": c.detail} for c in self.checks],
            "started_at": round(self.started_at, 3),
            "duration_s": round(self.duration_s, 3),
        }


@dataclass(frozen=True)
class KnownAnswer:
    label: str
    prompt_ids: list[int]
    max_tokens: int
    check: Callable[[list[int]], bool]  # the generated ids are the right answer


@dataclass
class SelfTestConfig:
    batch_sizes: tuple[int, ...] = (1, 3, 8)
    max_tokens: int = 8
    prompts: list[list[int]] | None = None  # default: fixed pseudo-random ids over the vocabulary
    known_answers: list[KnownAnswer] = field(default_factory=list)
    numerics_layers: int = 3
    numerics_linears_per_layer: int = 6


# ---- pure parts ------------------------------------------------------------------------------------


def default_prompts(vocab_size: int, count: int, seed: int = 14) -> list[list[int]]:
    """``count`` fixed prompts of 5..12 ids drawn from ``[2, vocab)`` (clear of the usual special ids)."""
    g = torch.Generator().manual_seed(seed)
    low = min(2, vocab_size - 1)
    return [torch.randint(low, vocab_size, (5 + (i * 3) % 8,), generator=g).tolist() for i in range(count)]


@dataclass(frozen=True)
class Decoded:
    token_ids: list[int]
    top: list[list[tuple[int, float]]]  # per position, the two most likely (token, logprob), best first


def compare_runs(alone: Decoded, batched: Decoded, tolerance: float) -> str | None:
    """None when ``batched`` matches ``alone``; else what differs (position, tokens, log-probabilities)."""
    for pos, (a, b) in enumerate(zip(alone.token_ids, batched.token_ids, strict=False)):
        top_a = alone.top[pos]
        if a != b:
            if len(top_a) > 1 and top_a[0][1] - top_a[1][1] <= tolerance:
                return None  # a near-tie: either token is right, and the continuations may differ
            return f"position {pos}: token {b} batched vs {a} alone (alone logprob margin {_margin(top_a)})"
        lp_a, lp_b = top_a[0][1], batched.top[pos][0][1]
        if abs(lp_a - lp_b) > tolerance:
            return f"position {pos}: logprob {lp_b:.6f} batched vs {lp_a:.6f} alone (tolerance {tolerance})"
    if len(alone.token_ids) != len(batched.token_ids):
        return f"{len(batched.token_ids)} tokens batched vs {len(alone.token_ids)} alone"
    return None


def _margin(top: list[tuple[int, float]]) -> str:
    return f"{top[0][1] - top[1][1]:.4f}" if len(top) > 1 else "n/a"


def weights_fingerprint(model: nn.Module) -> dict[str, int]:
    """Per parameter, the exact sum of its raw bits read as integers (order-independent, so deterministic
    on any device); any changed byte changes it unless changes cancel exactly."""
    sums: list[torch.Tensor] = []
    names: list[str] = []
    for name, p in model.named_parameters():
        flat = p.detach().reshape(-1)
        if flat.numel() == 0:
            continue
        bits = flat.view(
            {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
        )
        total = sum(chunk.sum(dtype=torch.int64) for chunk in bits.split(_FINGERPRINT_CHUNK))
        sums.append(torch.as_tensor(total, device=p.device).to("cpu", torch.int64))
        names.append(name)
    return dict(zip(names, torch.stack(sums).tolist(), strict=True)) if sums else {}


def relative_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    ref = reference.double()
    return float((actual.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def _sampled_layers(layers: nn.ModuleList, count: int) -> list[int]:
    n = len(layers)
    picks = {0, n // 2, n - 1} if count >= 3 else {0, n - 1}
    return sorted(picks)[: max(1, count)]


def _linears(layer: nn.Module, limit: int) -> list[tuple[str, nn.Module]]:
    """Attention projections first, then the dense MLP or the shared and first routed experts."""
    found = [(n, m) for n, m in layer.named_modules() if isinstance(m, nn.Linear | Fp8Linear)]
    preferred = [x for x in found if ".experts." not in x[0] or ".experts.0." in x[0]]
    return preferred[:limit]


def check_numerics(model: nn.Module, dtype: torch.dtype, config: SelfTestConfig) -> CheckResult:
    """Serving-path linears of sampled layers against a float64 reference on the same inputs."""
    from ..model.layers import _apply  # the decode hot path's linear

    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        return CheckResult(NUMERICS, True, "skipped: the model has no decoder layers to sample")
    threshold = NUMERICS_THRESHOLD.get(dtype, 3e-2)
    g = torch.Generator().manual_seed(7)
    worst, worst_name, checked = 0.0, "", 0
    with torch.no_grad():
        for idx in _sampled_layers(layers, config.numerics_layers):
            for name, linear in _linears(layers[idx], config.numerics_linears_per_layer):
                in_f = linear.in_features
                device = linear.weight.device
                x = torch.randn(4, in_f, generator=g).to(device, dtype)
                y = _apply(linear, x)
                ref = x.double() @ dense_weight(linear, torch.float64).T
                err = relative_error(y, ref)
                checked += 1
                if not err <= threshold:  # NaN fails too
                    return CheckResult(
                        NUMERICS,
                        False,
                        f"layer {idx} {name}: relative error {err:.3g} over {threshold:g} ({dtype})",
                    )
                if err > worst:
                    worst, worst_name = err, f"layer {idx} {name}"
        attn_err = attention_kernel_error(layers[0].self_attn, dtype)
    if attn_err is not None:
        if not attn_err <= threshold:
            return CheckResult(
                NUMERICS,
                False,
                f"decode attention kernel: relative error {attn_err:.3g} over {threshold:g} ({dtype})",
            )
        if attn_err > worst:
            worst, worst_name = attn_err, "decode attention kernel"
    what = f"{checked} linears" + (" and the decode attention kernel" if attn_err is not None else "")
    return CheckResult(NUMERICS, True, f"{what}, worst {worst:.3g} ({worst_name}) <= {threshold:g}")


def attention_kernel_error(attn: nn.Module, dtype: torch.dtype) -> float | None:
    """The serving decode-attention dispatch (Triton on CUDA) against the float64 reference, on synthetic
    queries and a paged cache of the layer's shapes (three sequences, contexts 1, 37 and 130 tokens)."""
    # The module, not its functions (the kernels package re-exports a function of the same name).
    kernels = importlib.import_module("sovereign_runtime.kernels.mla_decode")

    config = getattr(attn, "config", None)
    heads = getattr(attn, "num_heads", None)
    if config is None or heads is None:
        return None
    rank, width = config.kv_lora_rank, config.kv_lora_rank + config.qk_rope_head_dim
    device = next(attn.parameters()).device
    g = torch.Generator().manual_seed(11)
    block_size, lens = 16, [1, 37, 130]
    per_seq = [-(-n // block_size) for n in lens]
    blocks = sum(per_seq)
    order = torch.randperm(blocks, generator=g).tolist()  # scattered physical blocks, as a pool hands out
    tables = torch.full((len(lens), max(per_seq)), -1, dtype=torch.int32)
    start = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = torch.tensor(order[start : start + n], dtype=torch.int32)
        start += n
    q = torch.randn(len(lens), heads, width, generator=g)
    cache = torch.randn(blocks, block_size, width, generator=g)
    context = torch.tensor(lens, dtype=torch.int32)
    served = kernels.mla_decode(
        q.to(device, dtype), cache.to(device, dtype), tables.to(device), context.to(device), attn.scale, rank
    )
    ref = kernels.mla_decode_reference(q.double(), cache.double(), tables, context, attn.scale, rank)
    return relative_error(served.cpu(), ref)


def check_weights(model: nn.Module, expected: dict[str, int] | None) -> CheckResult:
    if expected is None:
        return CheckResult(WEIGHTS, True, "skipped: no fingerprint taken at load")
    now = weights_fingerprint(model)
    changed = [n for n, v in expected.items() if now.get(n) != v]
    if changed:
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        return CheckResult(WEIGHTS, False, f"changed since load: {', '.join(changed[:3])}{more}")
    return CheckResult(WEIGHTS, True, f"{len(expected)} parameters unchanged since load")


# ---- through the engine ----------------------------------------------------------------------------


class SelfTest:
    """Runs every check against an ``AsyncEngine`` (call ``run`` on the event loop serving it)."""

    def __init__(self, engine: Any, config: SelfTestConfig | None = None) -> None:
        self.engine = engine
        self.config = config or SelfTestConfig()
        inner = engine.engine
        self.model: nn.Module = inner.runner.model
        self.dtype: torch.dtype = inner.runner.kv_cache.dtype
        self.max_num_seqs: int = inner.config.max_num_seqs
        vocab = int(getattr(getattr(self.model, "config", None), "vocab_size", 0) or 0)
        count = max(self.batch_sizes)
        self.prompts = self.config.prompts or default_prompts(vocab, count)
        self.fingerprint: dict[str, int] | None = None
        self._runs = 0

    @property
    def batch_sizes(self) -> list[int]:
        return sorted({min(b, self.max_num_seqs) for b in self.config.batch_sizes})

    def take_fingerprint(self) -> None:
        """Record the weights as loaded (call before anything may change them, fault injection included)."""
        self.fingerprint = weights_fingerprint(self.model)

    async def run(self) -> SelfTestReport:
        started, t0 = time.time(), time.monotonic()
        checks = [await self._batch_invariance()]
        checks.append(await asyncio.to_thread(check_numerics, self.model, self.dtype, self.config))
        checks.append(await asyncio.to_thread(check_weights, self.model, self.fingerprint))
        if self.config.known_answers:
            checks.append(await self._known_answers())
        return SelfTestReport(checks, started, time.monotonic() - t0)

    async def _decode(self, prompt: list[int], max_tokens: int, tag: str, ignore_eos: bool = True) -> Decoded:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos, logprobs=2)
        ids: list[int] = []
        top: list[list[tuple[int, float]]] = []
        self._runs += 1
        rid = f"selftest-{tag}-{self._runs}"
        async for out in self.engine.generate(prompt, params, request_id=rid):
            ids += out.new_token_ids
            for lp in out.new_logprobs or []:
                top.append(list(lp.top))
        return Decoded(ids, top)

    async def _batch_invariance(self) -> CheckResult:
        n = self.config.max_tokens
        tol = LOGPROB_TOLERANCE.get(self.dtype, 0.15)
        count = max(self.batch_sizes)
        try:
            alone = [await self._decode(p, n, "alone") for p in self.prompts[:count]]
            for size in self.batch_sizes:
                if size == 1:
                    continue
                batched = await asyncio.gather(*(self._decode(p, n, f"b{size}") for p in self.prompts[:size]))
                for i, (a, b) in enumerate(zip(alone, batched, strict=False)):
                    diff = compare_runs(a, b, tol)
                    if diff is not None:
                        return CheckResult(
                            BATCH_INVARIANCE, False, f"prompt {i} in a batch of {size}: {diff}"
                        )
        except Exception as exc:  # a non-finite step or an engine error fails the check, not the caller
            return CheckResult(BATCH_INVARIANCE, False, f"{type(exc).__name__}: {exc}")
        return CheckResult(
            BATCH_INVARIANCE, True, f"{count} prompts alone and in batches of {self.batch_sizes}: same tokens"
        )

    async def _known_answers(self) -> CheckResult:
        answers = self.config.known_answers
        try:
            outs = await asyncio.gather(
                *(self._decode(k.prompt_ids, k.max_tokens, "answer", False) for k in answers)
            )
        except Exception as exc:
            return CheckResult(KNOWN_ANSWERS, False, f"{type(exc).__name__}: {exc}")
        wrong = [k.label for k, o in zip(answers, outs, strict=True) if not k.check(o.token_ids)]
        if wrong:
            return CheckResult(
                KNOWN_ANSWERS, False, f"{len(wrong)}/{len(answers)} wrong: {', '.join(wrong[:3])}"
            )
        return CheckResult(KNOWN_ANSWERS, True, f"{len(answers)}/{len(answers)} exact")


def tiny_known_answers(tokenizer: Any, count: int = 8, seed: int = 2026) -> list[KnownAnswer]:
    """Held-out addition questions for ``builtin:sovereign-tiny`` (never seen in training)."""
    from ..builtin import tasks

    answers = []
    for q in tasks.make_questions(count, seed=seed):
        _, ids = tokenizer.encode_chat(q.messages(), True)

        def check(out: list[int], q: Any = q) -> bool:
            return tasks.check_answer(q, tokenizer.decode(out))

        answers.append(KnownAnswer(q.prompt, list(ids), 48, check))
    return answers


def is_saturated(stats: Any, max_num_seqs: int, need: int) -> bool:
    """True while real requests queue or the batch lacks room for the self-test's ``need`` sequences."""
    waiting = int(getattr(stats, "num_requests_waiting", 0) or 0)
    running = int(getattr(stats, "num_requests_running", 0) or 0)
    return waiting > 0 or running + need > max_num_seqs


def check_names() -> Sequence[str]:
    return (BATCH_INVARIANCE, NUMERICS, WEIGHTS, KNOWN_ANSWERS)


def prepare_output_guard(
    engine: Any,
    tokenizer: Any,
    *,
    self_test: bool,
    known_answers: bool,
    fault: Any = None,
) -> tuple[Callable[[], Any] | None, Callable[[], bool] | None]:
    """Set up the self-test and fault injection on a freshly built ``AsyncEngine`` (the loader's part).

    The weights fingerprint is taken first, then a test-only fault (a ``FaultSpec``) is installed, so a
    corrupted weight block is one the fingerprint sees. Returns the self-test coroutine function (report
    JSON) and the saturation probe for ``LoadedRuntime``; both None when the self-test is off.
    """
    test = None
    if self_test:
        answers = tiny_known_answers(tokenizer) if known_answers else []
        test = SelfTest(engine, SelfTestConfig(known_answers=answers))
        test.take_fingerprint()
    if fault is not None:
        from ..model.faults import FaultInjector

        log.warning("fault injection is ON (tests and drills only): %s", fault)
        engine.engine.runner.faults = FaultInjector(engine.engine.runner.model, fault)
    if test is None:
        return None, None
    need = max(test.batch_sizes)

    async def run() -> dict[str, Any]:
        return (await test.run()).to_json()

    def saturated() -> bool:
        return is_saturated(engine.stats(), test.max_num_seqs, need)

    return run, saturated
