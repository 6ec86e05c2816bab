"""Build the engine for ``serve``: tokenizer, weights, KV pool, engine thread, reporting each phase."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..tokenizer import Tokenizer
from .state import LoadedRuntime, Loader, ProgressFn

if TYPE_CHECKING:
    import torch

    from ..engine.tensor_parallel import WorkerGroup

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


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


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was requested but no CUDA device is available")
    return device


def load_runtime(options: EngineOptions, progress: ProgressFn) -> LoadedRuntime:
    """Load everything the server needs; runs in a worker thread while HTTP already answers probes."""
    import torch

    from ..engine.async_engine import AsyncEngine
    from ..engine.engine import EngineConfig, LLMEngine
    from ..model import load_model

    progress("loading_weights", 0.0, "reading the tokenizer")
    tokenizer = Tokenizer.from_dir(options.model_path)
    device = resolve_device(options.device)
    dtype = None if options.dtype == "auto" else getattr(torch, _DTYPES[options.dtype])
    progress("loading_weights", 0.05, f"loading weights from {options.model_path} onto {device}")
    group = options.tensor_parallel
    if group is None:
        model, _config = load_model(options.model_path, device, dtype)
    else:
        model = _load_leader(options, group, device, dtype)
    progress("loading_weights", 0.9, "allocating the KV cache")
    config = EngineConfig(
        max_num_seqs=options.max_num_seqs,
        max_model_len=options.max_model_len,
        num_kv_blocks=options.num_kv_blocks,
        kv_cache_gib=options.kv_cache_gib,
        device=device,
        dtype=dtype,
    )
    engine = AsyncEngine(LLMEngine.from_model(model, config))
    progress("loading_weights", 1.0, "weights loaded")
    return LoadedRuntime(
        engine=engine,
        tokenizer=tokenizer,
        max_model_len=engine.max_model_len,
        close=engine.shutdown if group is None else lambda: _close_group(engine, model, group),
    )


def _close_group(engine: Any, leader: Any, group: WorkerGroup) -> None:
    """Stop stepping, then release the workers (they exit 0) and leave the process group."""
    from ..engine.tensor_parallel import destroy_process_group

    engine.shutdown()
    group.expect_exit()
    leader.stop_workers()
    group.stop()
    destroy_process_group()


def _load_leader(options: EngineOptions, group: WorkerGroup, device: str, dtype: torch.dtype | None) -> Any:
    """Rank 0's shard, joined to the workers' group and wrapped to broadcast every step to them."""
    from ..engine.tensor_parallel import TensorParallelLeader, init_process_group, worker_device
    from ..model import load_model
    from ..model.parallel import TensorParallel

    rank0_device = worker_device(device, 0)
    init_process_group(0, group.size, group.rendezvous_file, rank0_device)
    model, _config = load_model(
        options.model_path, rank0_device, dtype, tensor_parallel=TensorParallel(0, group.size)
    )
    return TensorParallelLeader(model)


def make_loader(options: EngineOptions) -> Loader:
    return lambda progress: load_runtime(options, progress)
