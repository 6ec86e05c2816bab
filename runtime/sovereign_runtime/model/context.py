"""The one explicit context object that carries attention metadata for a forward pass.

The engine's model runner builds an ``AttentionMetadata`` for each step and installs it with
``attention_context(meta)``; attention layers read it with ``get_attention_metadata()``. Layers hold no
other global state.

A step processes a flattened batch: the *new* tokens of every scheduled sequence, concatenated. A
sequence may contribute one token (decode), a whole prompt, or a chunk of a prompt whose earlier part
is already in the paged cache (chunked prefill, radix-cache hit). Every sequence's new tokens occupy
positions ``[context_len - query_len, context_len)``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [num_tokens] int64: absolute position of each new token
    # [num_tokens] int64: cache slot each new token writes (block * block_size + offset)
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor  # [batch + 1] int32: prefix sums of new-token counts per sequence
    context_lens: torch.Tensor  # [batch] int32: tokens in the cache for each sequence after this step
    block_tables: torch.Tensor  # [batch, max_blocks] int32: physical block ids, padded with -1
    max_query_len: int
    max_context_len: int
    block_size: int
    # Called with the decoder layer's index right after that layer ran (its latents are in the cache), so
    # the prefill role can hand layer i's KV to its sender while layers i+1... compute. None (the default,
    # and whenever no exported sequence is in the batch) costs nothing. MTP layers never call it.
    after_layer: Callable[[int], None] | None = None
    # Values derived from the metadata that every layer of the step would otherwise recompute (e.g. the
    # decode gather slots); filled lazily by ``memo``, private to the step.
    _memo: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def memo(self, key: str, build: Callable[[], Any]) -> Any:
        """``build()`` once per step for ``key``; later layers get the same value."""
        try:
            return self._memo[key]
        except KeyError:
            value = self._memo[key] = build()
            return value

    @property
    def batch_size(self) -> int:
        return int(self.context_lens.shape[0])

    @property
    def is_decode(self) -> bool:
        """Every sequence contributes exactly one new token (the absorbed decode kernel applies)."""
        return self.max_query_len == 1


# Per thread: each engine runs its steps on its own thread, and several engines may share a process
# (a prefill and a decode instance in one test, a bench driving two pools).
_local = threading.local()


def get_attention_metadata() -> AttentionMetadata:
    current: AttentionMetadata | None = getattr(_local, "current", None)
    if current is None:
        raise RuntimeError("no attention context installed: run the model through attention_context(meta)")
    return current


def current_attention_metadata() -> AttentionMetadata | None:
    """The installed metadata, or None (callers that only read optional fields; layers raise instead)."""
    return getattr(_local, "current", None)


@contextmanager
def attention_context(meta: AttentionMetadata) -> Iterator[AttentionMetadata]:
    previous = getattr(_local, "current", None)
    _local.current = meta
    try:
        yield meta
    finally:
        _local.current = previous


# Largest scratch buffer kept between steps (bytes); a bigger request gets a fresh tensor each time.
SCRATCH_MAX_BYTES = 256 << 20


def scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised ``shape`` tensor from this thread's buffer ``name``, reused across steps.

    For large per-layer temporaries (the decode KV gather): a fresh multi-megabyte tensor per layer costs
    page faults on every step (the allocator hands big blocks back to the OS), measured several times the
    copy itself on CPU. The caller must be done with the tensor before asking for ``name`` again.
    """
    numel = 1
    for n in shape:
        numel *= n
    if numel * torch.empty((), dtype=dtype).element_size() > SCRATCH_MAX_BYTES:
        return torch.empty(shape, dtype=dtype, device=device)
    pool: dict[str, torch.Tensor] | None = getattr(_local, "scratch", None)
    if pool is None:
        pool = _local.scratch = {}
    buf = pool.get(name)
    if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
        buf = pool[name] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel].view(shape)
