"""The serving engine: paged latent KV pool, radix prefix cache, scheduler, model runner, sampler."""

from .sampling import SamplingParams

__all__ = ["SamplingParams"]
