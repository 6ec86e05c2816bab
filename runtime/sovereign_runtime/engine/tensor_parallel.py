"""Serving one replica over several ranks: rank 0 runs the whole engine, the others run their part of the
model with it (tensor parallelism, pipeline parallelism, or both; engine/group.py lays the ranks out).

Rank 0 owns the HTTP server, scheduler, block pool, radix cache and sampler exactly as with one rank; its
model is a ``GroupLeader`` wrapping its own shard. Each forward, the leader broadcasts the step's inputs
(flattened token ids, positions and the ``AttentionMetadata`` tensors the runner built) to every rank, so
every rank knows the step; then:

- tensor parallelism alone: every rank runs its shard on the whole step, the all-reduces inside the layers
  line up, and rank 0 computes the logits (``lm_head`` is replicated) and samples;
- with pipeline stages: the step is cut into micro-batches of whole sequences (as many as there are
  stages), and each stage runs its layers on one micro-batch while the next stage runs the one before,
  so every stage works at once; stage ``s`` hands each micro-batch's hidden states to the same
  tensor-parallel position of stage ``s + 1``, and the last stage's first rank returns them (after the final
  norm) to rank 0, which computes the logits. The MTP layer runs on the last stage, its shared head on
  rank 0.

KV cache: every rank holds the latent pages of its stage's attention layers (replicated over the stage's
tensor-parallel ranks: MLA's latent is shared by all heads), in blocks of the leader's one block table.
Rows that do not come from a forward (the decode role's rows from a prefill instance) are written through
``GroupLeader.write_kv_rows`` to the stage owning the layer; the prefill role reads a later stage's rows back
through ``read_kv_rows``. Ordering: every round (steps, binds, row writes and reads) runs under the leader's
one lock in one order all ranks follow, and point-to-point messages are matched by source and tag.

A collective that fails (a peer died, or rank 0's own part raised after the others had started the step:
they could never line up again) fails the whole group (``Member.fail``): requests end with an error and
every rank exits, rather than one rank waiting forever.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..model.config import ModelConfig
from ..model.context import AttentionMetadata, attention_context, get_attention_metadata
from ..model.pipeline import (
    PipelineStage,
    bind_stage_kv_cache,
    run_stage,
    split_micro_batches,
    stage_attention_layers,
    stage_layer_counts,
)
from .api import RequestFailed
from .group import GroupLayout, Member

log = logging.getLogger("sovereign_runtime.tensor_parallel")

# Commands of the header every round starts with.
_STOP, _BIND_CACHE, _STEP, _WRITE_ROWS, _MTP_STEP, _READ_ROWS = range(6)
_HEADER_LEN = 8
# Point-to-point tags: what a message between two ranks is.
_TAG_HIDDEN, _TAG_RESULT, _TAG_ROWS, _TAG_MTP = 1, 2, 3, 4
_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)


class GroupFailure(RequestFailed):
    """The replica's process group broke: the request cannot finish on this replica (it restarts). Fatal
    to the engine step: never isolated to one request (``StepGuard``)."""

    fatal = True

    def __init__(self, message: str) -> None:
        super().__init__("group_failure", message)


@dataclass(frozen=True)
class Placement:
    """This rank in its group: the layout, its stage, its stage's tensor-parallel group, its device."""

    layout: GroupLayout
    rank: int
    stage: PipelineStage
    tp_group: Any  # None: the whole group (no pipeline stages)
    device: torch.device

    @property
    def pipelined(self) -> bool:
        return self.layout.pipeline_parallel > 1

    @property
    def last_stage_first_rank(self) -> int:
        return self.layout.stage_ranks(self.layout.pipeline_parallel - 1)[0]


# ---- wire helpers ------------------------------------------------------------------------------------


def collective_error(exc: BaseException) -> str:
    """One readable line for a failed collective: gloo's and NCCL's messages carry a source location and
    advice after the point (``[.../pair.cc:545] Read error [addr]: Connection reset by peer. This is ...``)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", text)
    text = text.split(". This is typically", 1)[0]
    return f"{type(exc).__name__}: {text}"


def _broadcast_header(values: Sequence[int], device: torch.device) -> None:
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    header[: len(values)] = torch.tensor(list(values), dtype=torch.int64)
    dist.broadcast(header.to(device), src=0)


def _receive_header(device: torch.device) -> list[int]:
    header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=device)
    dist.broadcast(header, src=0)
    return header.tolist()


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    # As raw bytes: gloo has no bfloat16 or float8 (and the bytes are the same for every backend).
    return tensor.contiguous().view(torch.uint8)


def _isend(tensor: torch.Tensor, dst: int, tag: int) -> Any:
    return dist.isend(_bytes(tensor), dst, tag=tag)


def _recv(
    rows: int, width: int, dtype: torch.dtype, src: int, tag: int, device: torch.device
) -> torch.Tensor:
    raw = torch.empty(rows, width * dtype.itemsize, dtype=torch.uint8, device=device)
    dist.recv(raw, src, tag=tag)
    return raw.view(dtype)


def _write_slot_rows(cache: torch.Tensor, layer: int, slot_index: torch.Tensor, rows: torch.Tensor) -> None:
    """``cache[layer]``'s flat slots ``slot_index`` := ``rows`` (the same write on every rank)."""
    width = cache.shape[-1]
    # On the bytes: index_copy_ has no float8 kernel on every device, and a byte copy is the same write.
    cache[layer].view(-1, width).view(torch.uint8).index_copy_(0, slot_index, _bytes(rows))


def _read_slot_rows(cache: torch.Tensor, layer: int, slot_index: torch.Tensor) -> torch.Tensor:
    return cache[layer].view(-1, cache.shape[-1]).index_select(0, slot_index)


def local_cache_layer(config: ModelConfig, stage: PipelineStage, layer: int) -> int:
    """Where engine cache layer ``layer`` sits in the cache of the stage holding it."""
    if stage.count == 1:
        return layer
    if layer >= config.num_hidden_layers:  # an MTP layer, after the last stage's decoder layers
        return len(stage.layers) + layer - config.num_hidden_layers
    return layer - stage.layers.start


def activation_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.dtype in (torch.float32, torch.bfloat16, torch.float16):
            return p.dtype
    return torch.float32


def _meta_from_header(header: list[int], device: torch.device) -> tuple[torch.Tensor, AttentionMetadata]:
    """Receive a step's inputs after its header; every rank rebuilds the leader's metadata from them."""
    num_tokens, num_seqs, max_blocks, max_query_len, max_context_len, block_size = header[1:7]
    longs = torch.empty(3 * num_tokens, dtype=torch.int64, device=device)
    ints = torch.empty(2 * num_seqs + 1 + num_seqs * max_blocks, dtype=torch.int32, device=device)
    dist.broadcast(longs, src=0)
    dist.broadcast(ints, src=0)
    input_ids, positions, slot_mapping = longs.split(num_tokens)
    meta = AttentionMetadata(
        positions=positions,
        slot_mapping=slot_mapping,
        query_start_loc=ints[: num_seqs + 1],
        context_lens=ints[num_seqs + 1 : 2 * num_seqs + 1],
        block_tables=ints[2 * num_seqs + 1 :].view(num_seqs, max_blocks),
        max_query_len=max_query_len,
        max_context_len=max_context_len,
        block_size=block_size,
    )
    return input_ids, meta


def _pipeline_step(
    model: nn.Module, place: Placement, input_ids: torch.Tensor, meta: AttentionMetadata
) -> list[Any]:
    """This rank's stage over the step's micro-batches, handing each one on; returns the pending sends."""
    layout, stage, rank = place.layout, place.stage, place.rank
    dtype, hidden = activation_dtype(model), model.config.hidden_size
    sends = []
    for micro in split_micro_batches(meta, layout.pipeline_parallel):
        rows = micro.tokens.stop - micro.tokens.start
        x = None
        if not stage.is_first:
            x = _recv(rows, hidden, dtype, layout.peer(rank, stage.index - 1), _TAG_HIDDEN, place.device)
        with torch.no_grad(), attention_context(micro.meta):
            x = run_stage(model, stage, input_ids[micro.tokens], x)
        if not stage.is_last:
            sends.append(_isend(x, layout.peer(rank, stage.index + 1), _TAG_HIDDEN))
        elif layout.tp_rank(rank) == 0:
            sends.append(_isend(x, 0, _TAG_RESULT))
    return sends


# ---- rank 0 --------------------------------------------------------------------------------------------


class StagedKVCache:
    """The engine's decoder-layer cache as the disaggregation code sees it when the layers live on several
    pipeline stages: shape and dtype of the whole, rows read and written through the leader."""

    def __init__(self, leader: GroupLeader, num_layers: int, local: torch.Tensor) -> None:
        self.leader = leader
        self.shape = (num_layers, *local.shape[1:])
        self.dtype = local.dtype
        self.device = local.device

    def read_rows(self, layer: int, slot_index: torch.Tensor) -> torch.Tensor:
        return self.leader.read_kv_rows(layer, slot_index)

    def write_rows(self, layer: int, slot_index: torch.Tensor, rows: torch.Tensor) -> None:
        self.leader.write_kv_rows(layer, slot_index, rows)


class GroupLeader(nn.Module):
    """Rank 0's model: broadcasts each forward's inputs, runs its own part, gathers the last stage's output.

    Implements the runner's model contract (``bind_kv_cache``, ``__call__``, ``compute_logits``, ``config``),
    the MTP drafter's (``mtp_hidden``, ``mtp_head``) and disaggregation's (``write_kv_rows``, ``read_kv_rows``).
    """

    def __init__(self, model: nn.Module, place: Placement, member: Member | None = None) -> None:
        super().__init__()
        self.model = model
        self.config = model.config
        self.place = place
        self.member = member
        self._device = place.device
        # One round of collectives at a time (the engine thread steps; shutdown may come from another).
        self._lock = threading.Lock()
        self._stopped = False
        self._broken: str | None = None
        self._kv_cache: torch.Tensor | None = None
        self._cache_layers = model.config.num_hidden_layers

    # ---- failure ---------------------------------------------------------------------------------------

    def _check(self) -> None:
        if self._broken is not None:
            raise GroupFailure(self._broken)
        if self.member is not None and self.member.failed is not None:
            raise GroupFailure(self.member.failed)

    def _fail(self, exc: BaseException) -> GroupFailure:
        if isinstance(exc, GroupFailure):
            return exc
        reason = f"a collective of the parallel group failed on rank 0: {collective_error(exc)}"
        self._broken = reason
        if self.member is not None:
            self.member.fail(reason)
        log.error("%s", reason)
        return GroupFailure(reason + "; this replica restarts")

    def _round(self, work: Any, *args: Any) -> Any:
        with self._lock:
            self._check()
            try:
                return work(*args)
            except Exception as exc:
                raise self._fail(exc) from exc

    # ---- the model contract ----------------------------------------------------------------------------

    @property
    def lm_head(self) -> nn.Module:  # PagedRunner reads the device and dtype from it
        return self.model.lm_head

    def attention_layers(self) -> list[nn.Module]:
        return stage_attention_layers(self.model, self.place.stage, self._cache_layers)

    def kv_cache_layers(self, cache_layers: int) -> tuple[int, int]:
        """For an engine cache of ``cache_layers`` layers: the layers rank 0 keeps, and the most any
        stage keeps (what sizing the block pool must fit)."""
        self._cache_layers = cache_layers
        counts = stage_layer_counts(self.config, self.place.layout.pipeline_parallel, cache_layers)
        return counts[0], max(counts)

    def transfer_cache(self, num_layers: int) -> StagedKVCache | None:
        """Disaggregation's view of the decoder layers' cache when they span stages; None otherwise (the
        local cache is all of it)."""
        if not self.place.pipelined or self._kv_cache is None:
            return None
        return StagedKVCache(self, num_layers, self._kv_cache)

    def bind_kv_cache(self, cache: torch.Tensor) -> None:
        if not self.place.pipelined:
            self._cache_layers = cache.shape[0]  # every rank holds every layer
        elif cache.shape[0] != self.kv_cache_layers(self._cache_layers)[0]:
            raise ValueError(
                f"rank 0's KV cache must hold its stage's {self.kv_cache_layers(self._cache_layers)[0]} layers"
                f" of {self._cache_layers} (kv_cache_layers), got {cache.shape[0]}"
            )

        def bind() -> None:
            header = [_BIND_CACHE, self._cache_layers, *cache.shape[1:], _CACHE_DTYPES.index(cache.dtype)]
            _broadcast_header(header, self._device)
            bind_stage_kv_cache(self.model, self.place.stage, cache, self._cache_layers)
            self._kv_cache = cache

        self._round(bind)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self._round(self._forward, input_ids, positions)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self._broadcast_step(_STEP, input_ids, positions)
        if not self.place.pipelined:
            return self.model(input_ids, positions)
        meta = get_attention_metadata()
        # Every stage's layers have run when the last micro-batch comes back, so a prefill's KV export
        # (which the engine runs after the forward, ``_LayerExport.finish``) reads complete rows.
        sends = _pipeline_step(self.model, self.place, input_ids, meta)
        dtype, hidden = activation_dtype(self.model), self.config.hidden_size
        outs = [
            _recv(
                micro.tokens.stop - micro.tokens.start,
                hidden,
                dtype,
                self.place.last_stage_first_rank,
                _TAG_RESULT,
                self._device,
            )
            for micro in split_micro_batches(meta, self.place.layout.pipeline_parallel)
        ]
        for send in sends:
            send.wait()
        return torch.cat(outs)

    def _broadcast_step(self, command: int, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        meta = get_attention_metadata()
        tables = meta.block_tables
        _broadcast_header(
            [
                command,
                input_ids.shape[0],
                meta.batch_size,
                tables.shape[1],
                meta.max_query_len,
                meta.max_context_len,
                meta.block_size,
            ],
            self._device,
        )
        longs = torch.cat([input_ids, positions, meta.slot_mapping]).to(self._device, torch.int64)
        ints = torch.cat([meta.query_start_loc, meta.context_lens, tables.reshape(-1)])
        dist.broadcast(longs, src=0)
        dist.broadcast(ints.to(self._device, torch.int32), src=0)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    # ---- MTP -------------------------------------------------------------------------------------------

    def mtp_hidden(
        self, hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """The MTP layer where it lives (every rank without stages, the last stage with them) on the
        step's inputs and the hidden rows it reads (rank 0 picks them after verifying)."""
        return self._round(self._mtp_hidden, hidden, input_ids, positions)

    def _mtp_hidden(
        self, hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        self._broadcast_step(_MTP_STEP, input_ids, positions)
        rows = hidden.to(self._device, activation_dtype(self.model)).contiguous()
        if not self.place.pipelined:
            dist.broadcast(_bytes(rows), src=0)
            return self.model.mtp_hidden(rows, input_ids, positions)
        layout = self.place.layout
        sends = [_isend(rows, r, _TAG_MTP) for r in layout.stage_ranks(layout.pipeline_parallel - 1)]
        out = _recv(
            rows.shape[0],
            rows.shape[1],
            rows.dtype,
            self.place.last_stage_first_rank,
            _TAG_RESULT,
            self._device,
        )
        for send in sends:
            send.wait()
        return out

    def mtp_head(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.mtp_head(hidden)  # rank 0 holds the shared heads

    @property
    def mtp(self) -> nn.ModuleList:
        return self.model.mtp

    @property
    def mtp_unavailable(self) -> str | None:
        return self.model.mtp_unavailable

    # ---- KV rows outside a forward ---------------------------------------------------------------------

    def _owner(self, layer: int) -> int:
        return self.place.stage.owner_of_layer(self.config, layer)

    def write_kv_rows(self, layer: int, slot_index: torch.Tensor, rows: torch.Tensor) -> None:
        """Store ``rows`` (``[n, kv_dim]``) at flat slots ``slot_index`` of cache layer ``layer`` on every
        rank holding it.

        Returns once rank 0 has sent them (and written its own), ahead of any later step on those ranks
        (see the module docstring for why that ordering suffices). Safe from any thread.
        """
        cache = self._kv_cache
        if cache is None or self._stopped:
            raise RuntimeError("no parallel KV cache to write to (not bound, or the group stopped)")
        width = cache.shape[-1]
        # Checked before the round: a bad write must fail here, never leave the other ranks mid-round.
        if rows.ndim != 2 or rows.shape[1] != width or slot_index.shape != (rows.shape[0],):
            raise ValueError(f"KV rows must be [n, {width}] with n slot indices")
        if not 0 <= layer < self._cache_layers:
            raise ValueError(f"layer {layer} is outside [0, {self._cache_layers})")
        if rows.shape[0] == 0:
            return
        index = slot_index.to(self._device, torch.int64).contiguous()
        rows = rows.to(device=cache.device, dtype=cache.dtype).contiguous()
        self._round(self._write_rows, layer, index, rows)

    def _write_rows(self, layer: int, index: torch.Tensor, rows: torch.Tensor) -> None:
        cache = self._kv_cache
        assert cache is not None
        owner = self._owner(layer)
        _broadcast_header([_WRITE_ROWS, layer, rows.shape[0], rows.shape[1]], self._device)
        if not self.place.pipelined:
            dist.broadcast(index, src=0)
            dist.broadcast(_bytes(rows), src=0)
        else:
            sends = []
            for r in self.place.layout.stage_ranks(owner):
                if r != 0:
                    sends += [dist.isend(index, r, tag=_TAG_ROWS), _isend(rows, r, _TAG_ROWS)]
            for send in sends:
                send.wait()
        if owner == 0:
            _write_slot_rows(cache, local_cache_layer(self.config, self.place.stage, layer), index, rows)

    def read_kv_rows(self, layer: int, slot_index: torch.Tensor) -> torch.Tensor:
        """A copy of cache layer ``layer``'s rows at flat slots ``slot_index``, from the stage holding it."""
        cache = self._kv_cache
        if cache is None or self._stopped:
            raise RuntimeError("no parallel KV cache to read from (not bound, or the group stopped)")
        if not 0 <= layer < self._cache_layers:
            raise ValueError(f"layer {layer} is outside [0, {self._cache_layers})")
        index = slot_index.to(self._device, torch.int64).contiguous()
        if self._owner(layer) == 0:
            return _read_slot_rows(cache, local_cache_layer(self.config, self.place.stage, layer), index)
        return self._round(self._read_rows, layer, index)

    def _read_rows(self, layer: int, index: torch.Tensor) -> torch.Tensor:
        cache = self._kv_cache
        assert cache is not None
        source = self.place.layout.stage_ranks(self._owner(layer))[0]
        _broadcast_header([_READ_ROWS, layer, index.shape[0]], self._device)
        dist.send(index, source, tag=_TAG_ROWS)
        return _recv(index.shape[0], cache.shape[-1], cache.dtype, source, _TAG_RESULT, self._device)

    def stop_workers(self) -> None:
        """Tell the other ranks to leave their loop (they then exit 0); idempotent."""
        with self._lock:
            if self._stopped or self._broken is not None:
                return
            self._stopped = True
            if self.member is not None:
                self.member.stop_watching()
            _broadcast_header([_STOP], self._device)


# ---- every other rank ------------------------------------------------------------------------------------


def run_worker(model: nn.Module, place: Placement) -> None:
    """A non-leader rank's loop: apply rank 0's rounds (bind the cache, run its part of a step, write or
    read KV rows) until it says stop."""
    device, stage, config = place.device, place.stage, model.config
    cache: torch.Tensor | None = None
    while True:
        header = _receive_header(device)
        command = header[0]
        if command == _STOP:
            return
        if command == _BIND_CACHE:
            cache_layers, blocks, block_size, width, dtype_index = header[1:6]
            layers = stage.kv_layers(config, cache_layers) if place.pipelined else cache_layers
            cache = torch.zeros(
                layers, blocks, block_size, width, dtype=_CACHE_DTYPES[dtype_index], device=device
            )
            bind_stage_kv_cache(model, stage, cache, cache_layers)
            continue
        if command in (_WRITE_ROWS, _READ_ROWS):
            if cache is None:
                raise RuntimeError("KV rows to move before any cache was bound")
            _rows_round(cache, command, header, place, config)
            continue
        if command not in (_STEP, _MTP_STEP):
            raise RuntimeError(f"unknown parallel-group command {command}")
        input_ids, meta = _meta_from_header(header, device)
        if command == _MTP_STEP:
            _mtp_round(model, place, input_ids, meta)
        elif place.pipelined:
            for send in _pipeline_step(model, place, input_ids, meta):
                send.wait()
        else:
            with torch.no_grad(), attention_context(meta):
                model(input_ids, meta.positions)


def _rows_round(
    cache: torch.Tensor, command: int, header: list[int], place: Placement, config: ModelConfig
) -> None:
    layer, num_rows = header[1], header[2]
    width = cache.shape[-1]
    local = local_cache_layer(config, place.stage, layer)
    if command == _WRITE_ROWS:
        if not place.pipelined:
            index = torch.empty(num_rows, dtype=torch.int64, device=place.device)
            dist.broadcast(index, src=0)
            raw = torch.empty(num_rows, width * cache.element_size(), dtype=torch.uint8, device=place.device)
            dist.broadcast(raw, src=0)
            _write_slot_rows(cache, local, index, raw.view(cache.dtype))
        elif place.stage.owner_of_layer(config, layer) == place.stage.index:
            index = torch.empty(num_rows, dtype=torch.int64, device=place.device)
            dist.recv(index, 0, tag=_TAG_ROWS)
            rows = _recv(num_rows, width, cache.dtype, 0, _TAG_ROWS, place.device)
            _write_slot_rows(cache, local, index, rows)
        return
    owner = place.stage.owner_of_layer(config, layer)
    if place.rank == place.layout.stage_ranks(owner)[0]:
        index = torch.empty(num_rows, dtype=torch.int64, device=place.device)
        dist.recv(index, 0, tag=_TAG_ROWS)
        dist.send(_bytes(_read_slot_rows(cache, local, index)), 0, tag=_TAG_RESULT)


def _mtp_round(model: nn.Module, place: Placement, input_ids: torch.Tensor, meta: AttentionMetadata) -> None:
    hidden_size, dtype = model.config.hidden_size, activation_dtype(model)
    num_tokens = input_ids.shape[0]
    if not place.pipelined:
        raw = torch.empty(num_tokens, hidden_size * dtype.itemsize, dtype=torch.uint8, device=place.device)
        dist.broadcast(raw, src=0)
        rows = raw.view(dtype)
    elif place.stage.is_last:
        rows = _recv(num_tokens, hidden_size, dtype, 0, _TAG_MTP, place.device)
    else:
        return  # the MTP layer lives on the last stage
    with torch.no_grad(), attention_context(meta):
        out = model.mtp_hidden(rows, input_ids, meta.positions)
    if place.pipelined and place.layout.tp_rank(place.rank) == 0:
        dist.send(_bytes(out), 0, tag=_TAG_RESULT)
