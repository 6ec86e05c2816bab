"""The serving engine: paged latent KV pool, radix prefix cache, scheduler, model runner, sampler."""

from .engine import AsyncEngine, EngineConfig, EngineStats, LLMEngine, RequestOutput, TokenLogprob
from .sampling import SamplingParams

__all__ = [
    "AsyncEngine",
    "EngineConfig",
    "EngineStats",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
]
