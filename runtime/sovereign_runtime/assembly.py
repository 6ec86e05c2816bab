"""The runtime's assembly: a checkpoint becomes a running engine the HTTP server can serve.

Tokenizer, weights (one rank, or this rank's shard under tensor parallelism), KV pool and the engine
thread, reported phase by phase while the server already answers probes. This module stands above the
engine and the server: the server only serves the ``LoadedRuntime`` it is handed, and the CLI wires the
two together (``cli.py``).
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .builtin import resolve_builtin
from .engine.async_engine import AsyncEngine
from .engine.engine import EngineConfig, LLMEngine
from .engine.grammar import Grammars
from .engine.selftest import prepare_output_guard
from .engine.speculative import SpeculativeConfig
from .engine.tensor_parallel import (
    TensorParallelLeader,
    WorkerGroup,
    destroy_process_group,
    exit_when_parent_dies,
    init_process_group,
    run_worker,
    worker_device,
)
from .model import load_model
from .model.config import ModelConfig
from .model.faults import FaultSpec
from .model.parallel import TensorParallel, tensor_parallel_problem
from .server.state import LoadedRuntime, Loader, ProgressFn
from .tokenizer import Tokenizer

DTYPES = ("float32", "bfloat16", "float16")

log = logging.getLogger("sovereign_runtime")


@dataclass
class EngineOptions:
    model_path: Path
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    max_model_len: int | None = None
    max_num_seqs: int = 64
    kv_cache_gib: float | None = None
    num_kv_blocks: int | None = None
    # Set when serving with --tensor-parallel-size > 1: this process is rank 0 of the group.
    tensor_parallel: WorkerGroup | None = None
    # The output self-test before ready and periodically (engine/selftest.py), and a test-only fault.
    self_test: bool = True
    fault: FaultSpec | None = None
    # MTP speculative decoding (--speculative-*); off by itself when the checkpoint has no MTP layer.
    speculative: SpeculativeConfig | None = None


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was requested but no CUDA device is available")
    return device


def resolve_dtype(dtype: str) -> torch.dtype | None:
    """None for ``auto`` (the checkpoint's own dtype)."""
    if dtype == "auto":
        return None
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {dtype!r}")
    return getattr(torch, dtype)  # type: ignore[no-any-return]


def load_runtime(options: EngineOptions, progress: ProgressFn) -> LoadedRuntime:
    """Load everything the server needs; runs in a worker thread while HTTP already answers probes."""
    progress("loading_weights", 0.0, "reading the tokenizer")
    tokenizer = Tokenizer.from_dir(options.model_path)
    device = resolve_device(options.device)
    dtype = resolve_dtype(options.dtype)
    progress("loading_weights", 0.05, f"loading weights from {options.model_path} onto {device}")
    group = options.tensor_parallel
    if group is None:
        model, _config = load_model(options.model_path, device, dtype)
    else:
        model = _load_leader(options, group, device, dtype)
    progress("loading_weights", 0.9, "allocating the KV cache")
    speculative, unavailable = options.speculative, None
    if speculative is not None and not len(getattr(model, "mtp", ())):
        unavailable = getattr(model, "mtp_unavailable", None) or (
            "config.json declares no MTP layer (num_nextn_predict_layers 0)"
        )
        log.warning("--speculative-algorithm %s asked for, but %s: serving without speculative decoding",
                    speculative.algorithm, unavailable)  # fmt: skip
        speculative = None
    config = EngineConfig(
        max_num_seqs=options.max_num_seqs,
        max_model_len=options.max_model_len,
        num_kv_blocks=options.num_kv_blocks,
        kv_cache_gib=options.kv_cache_gib,
        device=device,
        dtype=dtype,
        speculative=speculative,
    )
    core = LLMEngine.from_model(model, config)
    core.speculative_unavailable = unavailable
    stop_ids = sorted(core.scheduler.eos_token_ids) or [t for t in (tokenizer.eos_token_id,) if t is not None]
    core.runner.grammars = Grammars(tokenizer, core.vocab_size, stop_ids)
    engine = AsyncEngine(core)
    # builtin:sovereign-tiny knows its exact answers; any model gets batch invariance, numerics, weights.
    tiny = options.model_path.resolve() == resolve_builtin("sovereign-tiny").resolve()
    self_test, saturated = prepare_output_guard(
        engine, tokenizer, self_test=options.self_test, known_answers=tiny, fault=options.fault
    )
    progress("loading_weights", 1.0, "weights loaded")
    return LoadedRuntime(
        engine=engine,
        tokenizer=tokenizer,
        max_model_len=engine.max_model_len,
        self_test=self_test,
        saturated=saturated,
        speculative=speculative_card(options.speculative, speculative is not None, unavailable),
        close=engine.shutdown if group is None else lambda: _close_group(engine, model, group),
    )


def speculative_card(
    requested: SpeculativeConfig | None, enabled: bool, unavailable: str | None
) -> dict[str, Any]:
    """What ``/v1/models`` says about speculative decoding."""
    if requested is None:
        return {"enabled": False}
    card: dict[str, Any] = {
        "enabled": enabled,
        "algorithm": requested.algorithm,
        "num_draft_tokens": requested.num_draft_tokens,
        "max_batch_size": requested.max_batch_size,
    }
    if unavailable is not None:
        card["reason"] = unavailable
    return card


def make_loader(options: EngineOptions) -> Loader:
    return lambda progress: load_runtime(options, progress)


# ---- tensor parallelism (engine/tensor_parallel.py holds the collectives) -----------------------------


def tensor_parallel_problem_for(model_path: Path, size: int, device: str) -> str | None:
    """Why this checkpoint or machine cannot run ``size`` ranks, or None; read before starting anything."""
    problem = tensor_parallel_problem(ModelConfig.from_pretrained(model_path), size)
    if problem:
        return problem
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        visible = torch.cuda.device_count()
        if size > visible:
            return f"--tensor-parallel-size {size} needs {size} CUDA devices; {visible} visible"
    return None


def _load_leader(
    options: EngineOptions, group: WorkerGroup, device: str, dtype: torch.dtype | None
) -> TensorParallelLeader:
    """Rank 0's shard, joined to the workers' group and wrapped to broadcast every step to them."""
    rank0_device = worker_device(device, 0)
    init_process_group(0, group.size, group.rendezvous_file, rank0_device)
    model, _config = load_model(
        options.model_path, rank0_device, dtype, tensor_parallel=TensorParallel(0, group.size)
    )
    return TensorParallelLeader(model)


def _close_group(engine: AsyncEngine, leader: TensorParallelLeader, group: WorkerGroup) -> None:
    """Stop stepping, then release the workers (they exit 0) and leave the process group."""
    engine.shutdown()
    group.expect_exit()
    leader.stop_workers()
    group.stop()
    destroy_process_group()


def serve_worker(
    model_path: Path, device: str, dtype: str, rank: int, size: int, rendezvous_file: str
) -> int:
    """A worker rank's whole life: join the group, load this rank's shard, follow rank 0 until it stops."""
    exit_when_parent_dies()
    # A terminal's Ctrl-C or a signal to the whole process group reaches the workers too: they leave when
    # rank 0 tells them (after its drain) or when it is gone, never on their own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch_device = worker_device(resolve_device(device), rank)
    init_process_group(rank, size, rendezvous_file, torch_device)
    try:
        model, _ = load_model(
            model_path, torch_device, resolve_dtype(dtype), tensor_parallel=TensorParallel(rank, size)
        )
        run_worker(model, torch_device)
    finally:
        destroy_process_group()
    return 0
