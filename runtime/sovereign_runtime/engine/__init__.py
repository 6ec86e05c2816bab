"""The serving engine: paged latent KV pool, radix prefix cache, scheduler, model runner, sampler.

This face holds only the torch-free contract its callers share (the server imports it without torch):
what a request asks for (``SamplingParams``), what it gets back, and the error naming a rejected field.
The engine itself: ``engine.LLMEngine`` (synchronous), ``async_engine.AsyncEngine`` (a background
thread for asyncio), ``remote_prefill`` (the decode side of disaggregation).
"""

from .api import EngineStats, InvalidRequest, RequestFailed, RequestOutput, SchedulerStats, TokenLogprob
from .sampling import SamplingParams

__all__ = [
    "EngineStats",
    "InvalidRequest",
    "RequestFailed",
    "RequestOutput",
    "SamplingParams",
    "SchedulerStats",
    "TokenLogprob",
]
