"""Build the engine for ``serve``: tokenizer, weights, KV pool, engine thread, reporting each phase."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..tokenizer import Tokenizer
from .state import LoadedRuntime, Loader, ProgressFn

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

    from ..engine.engine import AsyncEngine, EngineConfig, LLMEngine
    from ..model import load_model

    progress("loading_weights", 0.0, "reading the tokenizer")
    tokenizer = Tokenizer.from_dir(options.model_path)
    device = resolve_device(options.device)
    dtype = None if options.dtype == "auto" else getattr(torch, _DTYPES[options.dtype])
    progress("loading_weights", 0.05, f"loading weights from {options.model_path} onto {device}")
    model, _config = load_model(options.model_path, device, dtype)
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
        close=engine.shutdown,
    )


def make_loader(options: EngineOptions) -> Loader:
    return lambda progress: load_runtime(options, progress)
