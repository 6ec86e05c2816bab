"""Prefill/decode disaggregation: moving a prompt's latent KV cache from a prefill to a decode instance."""
