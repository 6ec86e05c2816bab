"""The front door: an OpenAI-compatible router over runtime workers (unified, or prefill/decode pairs)."""
