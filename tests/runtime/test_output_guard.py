"""The output guard's parts: the sampler's finite check, step isolation, fault specs, self-test comparisons."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from sovereign_runtime.engine.engine import EngineConfig, LLMEngine
from sovereign_runtime.engine.guard import NONFINITE_LOGITS, STEP_EXCEPTION, StepGuard
from sovereign_runtime.engine.repetition import RepetitionDetector, check_window
from sovereign_runtime.engine.sampler import NONFINITE, Sampler
from sovereign_runtime.engine.sampling import SamplingParams
from sovereign_runtime.engine.scheduler import ScheduledBatch
from sovereign_runtime.engine.selftest import Decoded, compare_runs, weights_fingerprint
from sovereign_runtime.model import load_model
from sovereign_runtime.model.faults import FaultInjector, FaultSpec
from toy_model import ToyPagedModel

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _logits(rows: int = 4, vocab: int = 50) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_non_finite_row_is_reported_and_never_sampled(bad: float, temperature: float) -> None:
    logits = _logits()
    clean = Sampler()(logits.clone(), [SamplingParams(temperature=0)] * 4, [None] * 4)
    logits[2, 7] = bad
    params = [SamplingParams(temperature=temperature, seed=i, logprobs=1) for i in range(4)]
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    out = Sampler()(logits, params, gens)
    assert out.token_ids[2] == NONFINITE and out.nonfinite_rows() == [2]
    if temperature == 0.0:
        assert [t for i, t in enumerate(out.token_ids) if i != 2] == [
            t for i, t in enumerate(clean.token_ids) if i != 2
        ]


def test_the_check_can_be_switched_off_for_the_cost_benchmark() -> None:
    logits = _logits()
    logits[1] = float("nan")
    out = Sampler(check_finite=False)(logits, [SamplingParams(temperature=0)] * 4, [None] * 4)
    assert NONFINITE not in out.token_ids


def _engine(**kw: object) -> LLMEngine:
    cfg = EngineConfig(**{"block_size": 4, "num_kv_blocks": 128, "max_num_batched_tokens": 64, **kw})
    return LLMEngine.from_model(ToyPagedModel(), cfg)


def _guarded_run(eng: LLMEngine, guard: StepGuard, run) -> dict[str, list[int] | str]:
    """Drive the scheduler with ``guard.execute`` until done; request id -> tokens, or the failure kind."""
    result: dict[str, list[int] | str] = {rid: [] for rid in eng.scheduler.requests}
    while eng.has_unfinished():
        batch = eng.scheduler.schedule()
        step = guard.execute(batch, run)
        for seq, failure in step.failures.items():
            eng.scheduler.abort(seq.request_id)
            result[seq.request_id] = failure.kind
        eng.scheduler.update(batch, step.out.token_ids)
        for seq, tok in zip(
            [s for s, x in zip(batch.seqs, batch.sample, strict=True) if x], step.out.token_ids, strict=True
        ):
            if seq not in step.failures:
                assert tok != NONFINITE
                result[seq.request_id].append(tok)  # type: ignore[union-attr]
    eng.scheduler.check()
    return result


PROMPTS = [[3, 4, 5], [9, 8, 7, 6, 5], [11, 12], [20, 21, 22, 23], [30], [40, 41, 42]]


def test_an_exception_fails_only_the_sequences_whose_inputs_raise() -> None:
    clean_eng = _engine()
    clean = clean_eng.generate(PROMPTS, GREEDY)
    eng = _engine()
    for i, p in enumerate(PROMPTS):
        eng.add_request(p, GREEDY, request_id=f"r{i}")
    calls = []

    def run(batch: ScheduledBatch):
        calls.append(len(batch))
        # r3 poisons any batch it is in from its third step on (say, an input the kernel cannot take).
        if any(s.request_id == "r3" and s.num_output_tokens >= 2 for s in batch.seqs):
            raise OverflowError("value cannot be converted to type int64 without overflow")
        return eng.runner.execute(batch)

    guard = StepGuard(eng.runner.model)
    result = _guarded_run(eng, guard, run)
    assert result["r3"] == STEP_EXCEPTION
    for i in (0, 1, 2, 4, 5):
        assert result[f"r{i}"] == clean[i]
    assert guard.stats.isolated_exceptions_total == 1
    assert max(calls) == len(PROMPTS)  # the batch ran whole until r3 broke it


def test_non_finite_logits_fail_that_sequence_and_the_rest_continue() -> None:
    clean = _engine().generate(PROMPTS, GREEDY)
    eng = _engine()
    for i, p in enumerate(PROMPTS):
        eng.add_request(p, GREEDY, request_id=f"r{i}")
    model = eng.runner.model
    real = model.compute_logits

    def poisoned_logits(hidden: torch.Tensor) -> torch.Tensor:
        logits = real(hidden)
        batch = current[0]
        sampled = [s for s, x in zip(batch.seqs, batch.sample, strict=True) if x]
        for row, seq in enumerate(sampled):
            if seq.request_id == "r1" and seq.num_output_tokens == 3:
                logits[row, 5] = float("nan")
        return logits

    model.compute_logits = poisoned_logits  # type: ignore[method-assign]
    current: list[ScheduledBatch] = []

    def run(batch: ScheduledBatch):
        current[:] = [batch]
        return eng.runner.execute(batch)

    guard = StepGuard(model)
    result = _guarded_run(eng, guard, run)
    assert result["r1"] == NONFINITE_LOGITS
    assert guard.stats.nonfinite_logits_total == 1 and guard.stats.precision_fallbacks_total == 0
    for i in (0, 2, 3, 4, 5):
        assert result[f"r{i}"] == clean[i]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nan_layer=1", "go together"),
        ("nan_p=0.5", "go together"),
        ("nan_layer=1,nan_p=2", "nan_p must be in"),
        ("batch_min_seqs=0", "at least 1"),
        ("bogus=1", "unknown fault spec key 'bogus'"),
        ("nan_layer", "key=value"),
        ("nan_layer=x,nan_p=0.1", "not a valid value"),
        ("", "injects nothing"),
        ("on_host=tiny-unified-1", "injects nothing"),
        ("nan_layer=1,nan_p=1,on_host=-pod", "on_host must be a host name"),
        ("nan_layer=1,nan_p=1,on_host=pod_1", "on_host must be a host name"),
        ("nan_layer=1,nan_p=1,on_host=a..b", "on_host must be a host name"),
        (f"nan_layer=1,nan_p=1,on_host={'a' * 64}", "on_host must be a host name"),
    ],
)
def test_fault_specs_are_validated(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FaultSpec.parse(text)


def test_fault_spec_parses() -> None:
    spec = FaultSpec.parse("nan_layer=1, nan_p=0.25, nan_fp8_only=1, batch_min_seqs=3, seed=4")
    assert (spec.nan_layer, spec.nan_p, spec.nan_fp8_only, spec.batch_min_seqs, spec.seed) == (
        1,
        0.25,
        True,
        3,
        4,
    )


def test_a_fault_limited_to_one_host_engages_only_there() -> None:
    spec = FaultSpec.parse("nan_layer=1,nan_p=1,onset_s=20,on_host=tiny-unified-1")
    assert spec.on_host == "tiny-unified-1" and spec.onset_s == 20.0
    assert spec.engages_on("tiny-unified-1") and spec.engages_on("Tiny-Unified-1")
    assert not spec.engages_on("tiny-unified-0") and not spec.engages_on("tiny-unified-10")
    assert FaultSpec.parse("nan_layer=1,nan_p=1").engages_on("any-host")


@pytest.mark.parametrize(("hostname", "installed"), [("tiny-unified-1", True), ("tiny-unified-0", False)])
def test_serve_installs_an_on_host_fault_only_on_that_host(
    hostname: str, installed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    from sovereign_runtime import cli

    monkeypatch.setattr(cli.socket, "gethostname", lambda: hostname)
    args = argparse.Namespace(
        inject_fault="nan_layer=1,nan_p=1,on_host=tiny-unified-1",
        enable_fault_injection=True,
        debug_hold_compiling_s=None,
        debug_hold_compiling_cached_s=None,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
    )
    spec = cli.fault_spec(args)
    assert (spec is not None) == installed
    # The opt-in is still required, on every host.
    args.enable_fault_injection = False
    with pytest.raises(cli.UsageError, match="--enable-fault-injection"):
        cli.fault_spec(args)


def _decoded(tokens: list[int], tops: list[list[tuple[int, float]]]) -> Decoded:
    return Decoded(tokens, tops)


def test_compare_runs_accepts_equal_runs_and_near_ties_and_rejects_real_differences() -> None:
    alone = _decoded([5, 6, 7], [[(5, -0.1), (9, -3.0)], [(6, -0.5), (2, -0.52)], [(7, -0.2), (1, -4.0)]])
    assert compare_runs(alone, alone, 1e-3) is None
    # Diverging at a near-tie (margin 0.02 <= tolerance 0.05): either token is right.
    tie = _decoded([5, 2, 3], [[(5, -0.1), (9, -3.0)], [(2, -0.49), (6, -0.51)], [(3, -1.0), (1, -2.0)]])
    assert compare_runs(alone, tie, 0.05) is None
    assert "position 1" in (compare_runs(alone, tie, 1e-3) or "")
    wrong = _decoded([9, 6, 7], [[(9, -0.1), (5, -3.0)], [(6, -0.5), (2, -0.52)], [(7, -0.2), (1, -4.0)]])
    assert "token 9 batched vs 5 alone" in (compare_runs(alone, wrong, 0.05) or "")
    drift = _decoded([5, 6, 7], [[(5, -0.3), (9, -3.0)], [(6, -0.5), (2, -0.52)], [(7, -0.2), (1, -4.0)]])
    assert "logprob" in (compare_runs(alone, drift, 0.05) or "")


def test_weights_fingerprint_sees_any_changed_element() -> None:
    model = ToyPagedModel()
    before = weights_fingerprint(model)
    assert before == weights_fingerprint(model)
    with torch.no_grad():
        model.wo[1, 3, 2] = torch.nextafter(model.wo[1, 3, 2], torch.tensor(1e9))  # one ulp
    after = weights_fingerprint(model)
    assert [n for n in before if before[n] != after[n]] == ["wo"]


def _first_alarm(tokens: list[int], window: int) -> int | None:
    det = RepetitionDetector(window)
    return next((i for i, t in enumerate(tokens) if det.feed(t)), None)


def test_repetition_detector_fires_once_the_window_repeats_a_short_pattern() -> None:
    assert _first_alarm([7] * 40, 16) == 15  # the 16th identical token
    cycle = [1, 2, 3] * 20
    assert _first_alarm(cycle, 18) == 17
    assert _first_alarm([5, 9] + [4] * 15, 16) is None  # 15 repeats < window
    text = list(range(100))  # ordinary output: nothing repeats
    assert _first_alarm(text, 16) is None
    # A pattern longer than max_period (8) is not degenerate by this rule.
    assert _first_alarm(list(range(9)) * 10, 16) is None


@pytest.mark.parametrize("window", [-1, 3, 15, 5000, 1.5, True])
def test_repetition_window_is_validated(window: object) -> None:
    with pytest.raises(ValueError, match="repetition_window"):
        check_window(window)  # type: ignore[arg-type]


def _fp8_engine(checkpoint: Path, fault: str | None) -> tuple[LLMEngine, FaultInjector | None]:
    # FP8 weights stay e4m3 in Fp8Linear modules (the CUDA default; on CPU they are dequantised at load).
    model, _ = load_model(checkpoint, "cpu", torch.bfloat16, keep_fp8=True)
    eng = LLMEngine.from_model(model, EngineConfig(dtype=torch.bfloat16, block_size=4, num_kv_blocks=256))
    injector = None
    if fault is not None:
        injector = eng.runner.faults = FaultInjector(eng.runner.model, FaultSpec.parse(fault))
    return eng, injector


FP8_PROMPTS = [[3, 4, 5, 6], [9, 8, 7], [11, 12, 13, 14, 15], [20, 21], [30, 31, 32], [40, 41, 42, 43]]


def test_fp8_outlier_is_recovered_by_one_float32_recompute(tiny_fp8_checkpoint: Path) -> None:
    eng, injector = _fp8_engine(tiny_fp8_checkpoint, "nan_layer=0,nan_p=0.3,nan_fp8_only=1,seed=3")
    assert injector is not None
    for i, p in enumerate(FP8_PROMPTS):
        eng.add_request(p, GREEDY, request_id=f"r{i}")
    guard = StepGuard(eng.runner.model, torch.bfloat16)
    assert guard.has_precision_fallback
    result = _guarded_run(eng, guard, eng.runner.execute)
    assert injector.poisoned, "the fault never fired: pick another seed"
    assert all(isinstance(v, list) and len(v) == GREEDY.max_tokens for v in result.values()), result
    assert guard.stats.precision_fallbacks_total >= len(injector.poisoned)
    assert guard.stats.precision_fallbacks_recovered_total == guard.stats.precision_fallbacks_total
    assert guard.stats.nonfinite_logits_total == 0


def test_fp8_nan_that_survives_the_recompute_fails_only_its_requests(tiny_fp8_checkpoint: Path) -> None:
    clean_eng, _ = _fp8_engine(tiny_fp8_checkpoint, None)
    clean = clean_eng.generate(FP8_PROMPTS, GREEDY)
    eng, injector = _fp8_engine(tiny_fp8_checkpoint, "nan_layer=1,nan_p=0.05,seed=0")
    assert injector is not None
    for i, p in enumerate(FP8_PROMPTS):
        eng.add_request(p, GREEDY, request_id=f"r{i}")
    guard = StepGuard(eng.runner.model, torch.bfloat16)
    result = _guarded_run(eng, guard, eng.runner.execute)
    assert injector.poisoned and len(injector.poisoned) < len(FP8_PROMPTS), injector.poisoned
    for i in range(len(FP8_PROMPTS)):
        rid = f"r{i}"
        if rid in injector.poisoned:
            assert result[rid] == NONFINITE_LOGITS
        else:
            assert result[rid] == clean[i]
    assert guard.stats.nonfinite_logits_total == len(injector.poisoned)
    assert guard.stats.precision_fallbacks_total == len(injector.poisoned)
    assert guard.stats.precision_fallbacks_recovered_total == 0


def test_no_fallback_without_a_reduced_precision_path(tiny_fp8_checkpoint: Path) -> None:
    model, _ = load_model(tiny_fp8_checkpoint, "cpu", torch.float32, keep_fp8=True)
    assert not StepGuard(model, torch.float32).has_precision_fallback


# ---- through the engine (LLMEngine.step, AsyncEngine) -----------------------------------------------

TINY = Path(__file__).resolve().parents[2] / "runtime" / "sovereign_runtime" / "builtin" / "sovereign-tiny"


def _run_engine(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, Any]:
    """request id -> output tokens, plus the finishing output of each request."""
    tokens: dict[str, list[int]] = {}
    finals: dict[str, Any] = {}
    for i, p in enumerate(prompts):
        eng.add_request(p, params, request_id=f"r{i}")
        tokens[f"r{i}"] = []
    while eng.has_unfinished():
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finals[out.request_id] = out
    eng.scheduler.check()
    return {"tokens": tokens, "finals": finals}


def test_injected_nan_fails_exactly_the_affected_requests_and_no_nan_token_is_returned() -> None:
    prompts = [[(7 * i + j) % 90 + 3 for j in range(3 + i % 5)] for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    clean = _run_engine(LLMEngine.from_pretrained(TINY, EngineConfig()), prompts, params)["tokens"]
    eng = LLMEngine.from_pretrained(TINY, EngineConfig())
    injector = eng.runner.faults = FaultInjector(
        eng.runner.model, FaultSpec.parse("nan_layer=1,nan_p=0.06,seed=2")
    )
    run = _run_engine(eng, prompts, params)
    affected = injector.poisoned
    assert 0 < len(affected) < len(prompts), affected
    for rid, final in run["finals"].items():
        if rid in affected:
            # 100 % of affected requests error; what they got before the NaN is exactly the clean prefix.
            assert final.finish_reason == "error" and final.error is not None
            assert final.error.kind == NONFINITE_LOGITS
            got = run["tokens"][rid]
            assert got == clean[rid][: len(got)] and len(got) < len(clean[rid])
        else:
            assert final.finish_reason == "length" and final.error is None
            assert run["tokens"][rid] == clean[rid]  # unaffected requests in the same batches unchanged
    stats = eng.stats()
    assert stats.nonfinite_logits_total == len(affected) and stats.num_requests_running == 0


def test_the_async_engine_raises_request_failed_for_a_failed_request_only() -> None:
    import asyncio

    from sovereign_runtime.engine import RequestFailed
    from sovereign_runtime.engine.async_engine import AsyncEngine

    eng = AsyncEngine(LLMEngine.from_pretrained(TINY, EngineConfig()))
    eng.engine.runner.faults = FaultInjector(
        eng.engine.runner.model, FaultSpec.parse("nan_layer=0,nan_p=0.1,seed=1")
    )
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def one(i: int) -> str:
        try:
            async for _ in eng.generate([5 + i, 6, 7], params, request_id=f"q{i}"):
                pass
        except RequestFailed as exc:
            return exc.kind
        return "ok"

    async def main() -> list[str]:
        return await asyncio.gather(*(one(i) for i in range(8)))

    try:
        kinds = asyncio.run(main())
    finally:
        eng.shutdown()
    poisoned = eng.engine.runner.faults.poisoned  # type: ignore[union-attr]
    assert kinds == [NONFINITE_LOGITS if f"q{i}" in poisoned else "ok" for i in range(8)]
    assert "ok" in kinds and NONFINITE_LOGITS in kinds


def test_an_exception_in_the_engine_step_fails_only_its_request() -> None:
    eng = LLMEngine.from_pretrained(TINY, EngineConfig())
    prompts = [[3, 4, 5], [9, 8, 7, 6], [11, 12]]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    clean = _run_engine(LLMEngine.from_pretrained(TINY, EngineConfig()), prompts, params)["tokens"]
    real = eng.runner.execute

    def execute(batch: ScheduledBatch, after_layer: Any = None) -> Any:
        if any(s.request_id == "r1" and s.num_output_tokens == 2 for s in batch.seqs):
            raise OverflowError("Python int too large to convert to C long")
        return real(batch, after_layer)

    eng.runner.execute = execute  # type: ignore[method-assign]
    run = _run_engine(eng, prompts, params)
    assert run["finals"]["r1"].error.kind == STEP_EXCEPTION
    assert "OverflowError" in str(run["finals"]["r1"].error)
    assert run["tokens"]["r0"] == clean["r0"] and run["tokens"]["r2"] == clean["r2"]
    assert eng.stats().isolated_exceptions_total == 1


def test_repetition_detection_ends_a_degenerate_request_with_finish_reason_error() -> None:
    eng = LLMEngine.from_pretrained(TINY, EngineConfig())
    # The tiny model loops on this prompt when EOS is ignored: greedy output repeats a short pattern.
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, repetition_window=16)
    run = _run_engine(eng, [[0] * 4], params)
    final = run["finals"]["r0"]
    tokens = run["tokens"]["r0"]
    assert final.finish_reason == "error" and final.error is None and len(tokens) < 200
    assert eng.stats().degenerate_outputs_total == 1
    off = _run_engine(
        LLMEngine.from_pretrained(TINY, EngineConfig()),
        [[0] * 4],
        SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
    )
    assert off["finals"]["r0"].finish_reason == "length"


def test_guard_off_is_the_unguarded_engine() -> None:
    eng = LLMEngine.from_pretrained(TINY, EngineConfig())
    eng.set_output_guard(False)
    assert not eng.runner.sampler.check_finite
    out = _run_engine(eng, [[3, 4, 5]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert out["finals"]["r0"].finish_reason == "length"
