"""The known-answer self-test on the built-in model: passes clean, and each injected fault fails its check."""

from __future__ import annotations

import asyncio
import importlib
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from sovereign_runtime.builtin import resolve_builtin
from sovereign_runtime.engine.async_engine import AsyncEngine
from sovereign_runtime.engine.engine import EngineConfig, LLMEngine
from sovereign_runtime.engine.selftest import (
    BATCH_INVARIANCE,
    KNOWN_ANSWERS,
    NUMERICS,
    WEIGHTS,
    SelfTest,
    SelfTestConfig,
    SelfTestReport,
    is_saturated,
    tiny_known_answers,
)
from sovereign_runtime.model.faults import FaultInjector, FaultSpec
from sovereign_runtime.tokenizer import Tokenizer

TINY = resolve_builtin("sovereign-tiny")


@pytest.fixture
def engine() -> Iterator[AsyncEngine]:
    eng = AsyncEngine(LLMEngine.from_pretrained(TINY, EngineConfig()))
    try:
        yield eng
    finally:
        eng.shutdown()


def _run(engine: AsyncEngine, fault: str | None = None) -> SelfTestReport:
    async def main() -> SelfTestReport:
        test = SelfTest(engine, SelfTestConfig(known_answers=tiny_known_answers(Tokenizer.from_dir(TINY))))
        test.take_fingerprint()
        if fault is not None:
            engine.engine.runner.faults = FaultInjector(engine.engine.runner.model, FaultSpec.parse(fault))
        return await test.run()

    return asyncio.run(main())


def _verdicts(report: SelfTestReport) -> dict[str, bool]:
    return {c.name: c.ok for c in report.checks}


def test_a_clean_model_passes_every_check(engine: AsyncEngine) -> None:
    report = _run(engine)
    assert report.ok, report.to_json()
    assert set(_verdicts(report)) == {BATCH_INVARIANCE, NUMERICS, WEIGHTS, KNOWN_ANSWERS}
    body = report.to_json()
    assert body["passed"] is True and body["failing_check"] is None and body["duration_s"] > 0


def test_a_batch_size_dependent_fault_fails_batch_invariance(engine: AsyncEngine) -> None:
    report = _run(engine, "batch_min_seqs=3")
    assert not report.ok and report.failing is not None and report.failing.name == BATCH_INVARIANCE
    assert "in a batch of 3" in report.failing.detail
    assert _verdicts(report)[NUMERICS] and _verdicts(report)[WEIGHTS]


def test_a_corrupted_weight_block_fails_weights_and_known_answers(engine: AsyncEngine) -> None:
    report = _run(engine, "corrupt_weight=model.layers.1.mlp.shared_experts.down_proj.weight")
    verdicts = _verdicts(report)
    assert not verdicts[WEIGHTS] and not verdicts[KNOWN_ANSWERS]
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in next(
        c.detail for c in report.checks if c.name == WEIGHTS
    )


def test_nan_in_every_sequence_fails_the_self_test_without_raising(engine: AsyncEngine) -> None:
    report = _run(engine, "nan_layer=0,nan_p=1")
    assert report.failing is not None and report.failing.name == BATCH_INVARIANCE
    assert "non-finite" in report.failing.detail


def test_a_broken_decode_attention_kernel_fails_numerics(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernels = importlib.import_module("sovereign_runtime.kernels.mla_decode")  # the module, not the function

    real = kernels.mla_decode

    def off_by_a_bit(*args: object, **kwargs: object) -> torch.Tensor:
        return real(*args, **kwargs) * 1.01  # type: ignore[arg-type]

    monkeypatch.setattr(kernels, "mla_decode", off_by_a_bit)
    report = _run(engine)
    numerics = next(c for c in report.checks if c.name == NUMERICS)
    assert not numerics.ok and "decode attention kernel" in numerics.detail


def test_saturation_means_queued_requests_or_no_room_for_the_test() -> None:
    class Stats:
        def __init__(self, running: int, waiting: int) -> None:
            self.num_requests_running, self.num_requests_waiting = running, waiting

    assert not is_saturated(Stats(0, 0), 64, 8)
    assert is_saturated(Stats(0, 1), 64, 8)
    assert is_saturated(Stats(57, 0), 64, 8)


_TRITON_CHECK = """
import importlib, torch
from sovereign_runtime.builtin import resolve_builtin
from sovereign_runtime.engine.selftest import attention_kernel_error
from sovereign_runtime.model import load_model
kernels = importlib.import_module("sovereign_runtime.kernels.mla_decode")
kernels.mla_decode = kernels.mla_decode_triton  # what the dispatch runs on CUDA
model, _ = load_model(resolve_builtin("sovereign-tiny"), "cpu", torch.float32)
print(attention_kernel_error(model.model.layers[0].self_attn, torch.float32))
"""


def test_the_kernel_check_drives_the_triton_kernel_as_served_on_cuda() -> None:
    # The interpreter must be on before Triton is imported: a fresh process (as test_kernel_mla_decode.py).
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _TRITON_CHECK], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.strip().splitlines()[-1]) < 1e-4
