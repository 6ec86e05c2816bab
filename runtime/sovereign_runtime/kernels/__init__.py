"""Triton kernels, each with a torch reference of the same signature used on CPU."""

from .mla_decode import mla_decode, mla_decode_reference, mla_decode_triton

__all__ = ["mla_decode", "mla_decode_reference", "mla_decode_triton"]
