"""Tensor-parallel serving: rank 0 runs the whole engine, ranks 1..N-1 only run the model with it.

Rank 0 owns the HTTP server, scheduler, block pool, radix cache and sampler exactly as with one rank; its
model is a ``TensorParallelLeader`` wrapping its shard. Each forward, the leader broadcasts the step's
inputs (flattened token ids, positions and the ``AttentionMetadata`` tensors the runner built) and then
runs its shard; every worker (``run_worker``) receives them and runs its own shard on them, so the
all-reduces inside the layers line up. Binding the KV cache is broadcast too, so every rank holds a
same-shaped latent cache (replicated: MLA's latent is shared by all heads). Only rank 0 computes logits
(lm_head is replicated) and samples.

KV rows that do not come from a forward (the decode role's rows received from a prefill instance) are
written through ``TensorParallelLeader.write_kv_rows``, which broadcasts them so every replica gets them.
Ordering: every broadcast round (steps, binds, row writes) happens under the leader's one lock, in one
order all ranks follow; the decode role writes all of a request's rows (each write returns only once
broadcast and applied on rank 0) before it hands the request to the scheduler as a running decode, so
every rank holds the rows before the first step that reads them.

Processes: ``serve`` on rank 0 starts the workers as subprocesses of the same CLI with hidden
``--tp-rank``/``--tp-rendezvous`` flags; they rendezvous through a ``FileStore`` in a fresh temporary
directory (no port to collide on). Rank 0 watches its workers and exits non-zero if one dies (a collective
with a dead peer could otherwise block forever under NCCL); each worker exits when rank 0 is gone.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..model.context import AttentionMetadata, attention_context, get_attention_metadata

log = logging.getLogger("sovereign_runtime.tensor_parallel")

# Commands of the header every broadcast round starts with.
_STOP, _BIND_CACHE, _STEP, _WRITE_ROWS, _MTP_STEP = 0, 1, 2, 3, 4
_HEADER_LEN = 8
_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)
# A worker waits in a broadcast for as long as the server is idle; the collective timeout must not end
# that wait. Dead peers are detected by the process watchers below instead.
_COLLECTIVE_TIMEOUT = timedelta(days=365)
_WATCH_INTERVAL_S = 0.5


def init_process_group(rank: int, world_size: int, rendezvous_file: str, device: torch.device) -> None:
    """Join the group: NCCL between GPUs, gloo on CPU; rendezvous through the shared file."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "gloo":
        # All ranks share this host: talk over loopback rather than whatever the hostname resolves to.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        backend,
        init_method=f"file://{rendezvous_file}",
        rank=rank,
        world_size=world_size,
        timeout=_COLLECTIVE_TIMEOUT,
    )


def _broadcast_header(values: Sequence[int], device: torch.device) -> None:
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    header[: len(values)] = torch.tensor(list(values), dtype=torch.int64)
    dist.broadcast(header.to(device), src=0)


def _receive_header(device: torch.device) -> list[int]:
    header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=device)
    dist.broadcast(header, src=0)
    return header.tolist()


def _write_slot_rows(cache: torch.Tensor, layer: int, slot_index: torch.Tensor, rows: torch.Tensor) -> None:
    """``cache[layer]``'s flat slots ``slot_index`` := ``rows`` (the same write on every rank)."""
    width = cache.shape[-1]
    # On the bytes: index_copy_ has no float8 kernel on every device, and a byte copy is the same write.
    cache[layer].view(-1, width).view(torch.uint8).index_copy_(
        0, slot_index, rows.contiguous().view(torch.uint8)
    )


class TensorParallelLeader(nn.Module):
    """Rank 0's model: broadcasts each forward's inputs to the workers, then runs its own shard.

    Implements the runner's model contract (``bind_kv_cache``, ``__call__``, ``compute_logits``, ``config``).
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.config = model.config
        self._device = next(model.parameters()).device
        # One round of collectives at a time (the engine thread steps; shutdown may come from another).
        self._lock = threading.Lock()
        self._stopped = False
        self._kv_cache: torch.Tensor | None = None

    @property
    def lm_head(self) -> nn.Module:  # PagedRunner reads the device and dtype from it
        return self.model.lm_head

    def attention_layers(self) -> list[nn.Module]:
        return self.model.attention_layers()

    def bind_kv_cache(self, cache: torch.Tensor) -> None:
        with self._lock:
            _broadcast_header([_BIND_CACHE, *cache.shape, _CACHE_DTYPES.index(cache.dtype)], self._device)
            self.model.bind_kv_cache(cache)
            self._kv_cache = cache

    def write_kv_rows(self, layer: int, slot_index: torch.Tensor, rows: torch.Tensor) -> None:
        """Store ``rows`` (``[n, kv_dim]``) at flat slots ``slot_index`` of layer ``layer`` on every rank.

        Returns once rank 0's cache holds them and the workers have them queued ahead of any later step
        (see the module docstring for why that ordering suffices). Safe from any thread.
        """
        with self._lock:
            cache = self._kv_cache
            if cache is None or self._stopped:
                raise RuntimeError("no tensor-parallel KV cache to write to (not bound, or workers stopped)")
            layers, _, _, width = cache.shape
            # Checked before broadcasting: a bad write must fail here, never leave the workers mid-round.
            if rows.ndim != 2 or rows.shape[1] != width or slot_index.shape != (rows.shape[0],):
                raise ValueError(f"KV rows must be [n, {width}] with n slot indices")
            if not 0 <= layer < layers:
                raise ValueError(f"layer {layer} is outside [0, {layers})")
            if rows.shape[0] == 0:
                return
            index = slot_index.to(self._device, torch.int64).contiguous()
            rows = rows.to(device=cache.device, dtype=cache.dtype).contiguous()
            _broadcast_header([_WRITE_ROWS, layer, rows.shape[0], width], self._device)
            dist.broadcast(index, src=0)
            # As raw bytes: gloo has no float8 (and the bytes are the same for every dtype).
            dist.broadcast(rows.view(torch.uint8), src=0)
            _write_slot_rows(cache, layer, index, rows)

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

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        with self._lock:
            self._broadcast_step(_STEP, input_ids, positions)
            return self.model(input_ids, positions)

    def mtp_hidden(
        self, hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """The MTP layer on every rank (it is sharded like a decoder layer): the step's inputs, then the
        hidden rows it reads (replicated: rank 0 picks them after verifying)."""
        with self._lock:
            self._broadcast_step(_MTP_STEP, input_ids, positions)
            rows = hidden.to(self._device, self.model.model.embed_tokens.weight.dtype).contiguous()
            dist.broadcast(rows.view(torch.uint8), src=0)  # bytes: gloo has no bfloat16
            return self.model.mtp_hidden(rows, input_ids, positions)

    def mtp_head(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.mtp_head(hidden)  # replicated: rank 0 alone

    @property
    def mtp(self) -> nn.ModuleList:
        return self.model.mtp

    @property
    def mtp_unavailable(self) -> str | None:
        return self.model.mtp_unavailable

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def stop_workers(self) -> None:
        """Tell the workers to leave their loop (they then exit 0); idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            _broadcast_header([_STOP], self._device)


def run_worker(model: nn.Module, device: torch.device) -> None:
    """A worker rank's loop: apply rank 0's broadcasts (bind the cache, run a step, write received KV rows)
    until it says stop."""
    cache: torch.Tensor | None = None
    while True:
        header = _receive_header(device)
        command = header[0]
        if command == _STOP:
            return
        if command == _BIND_CACHE:
            layers, blocks, block_size, width, dtype_index = header[1:6]
            cache = torch.zeros(
                layers, blocks, block_size, width, dtype=_CACHE_DTYPES[dtype_index], device=device
            )
            model.bind_kv_cache(cache)
            continue
        if command == _WRITE_ROWS:
            if cache is None:
                raise RuntimeError("KV rows to write before any cache was bound")
            layer, num_rows, width = header[1:4]
            index = torch.empty(num_rows, dtype=torch.int64, device=device)
            raw = torch.empty(num_rows, width * cache.element_size(), dtype=torch.uint8, device=device)
            dist.broadcast(index, src=0)
            dist.broadcast(raw, src=0)
            _write_slot_rows(cache, layer, index, raw.view(cache.dtype))
            continue
        if command not in (_STEP, _MTP_STEP):
            raise RuntimeError(f"unknown tensor-parallel command {command}")
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
        if command == _MTP_STEP:
            hidden_size = model.config.hidden_size
            dtype = model.model.embed_tokens.weight.dtype  # the activation dtype rank 0 sends
            raw = torch.empty(num_tokens, hidden_size * dtype.itemsize, dtype=torch.uint8, device=device)
            dist.broadcast(raw, src=0)
            with torch.no_grad(), attention_context(meta):
                model.mtp_hidden(raw.view(dtype), input_ids, positions)
            continue
        with torch.no_grad(), attention_context(meta):
            model(input_ids, positions)


@dataclass
class WorkerGroup:
    """Rank 0's handle on ranks 1..N-1 (subprocesses) and their rendezvous directory."""

    size: int
    rendezvous_file: str
    processes: list[subprocess.Popen[bytes]]
    _directory: tempfile.TemporaryDirectory[str]
    _stopping: threading.Event = field(default_factory=threading.Event)

    def watch(self) -> None:
        """Exit this process (status 1) as soon as a worker dies unasked: its collectives would never end."""

        def loop() -> None:
            while not self._stopping.wait(_WATCH_INTERVAL_S):
                for rank, process in enumerate(self.processes, start=1):
                    code = process.poll()
                    if code is not None and not self._stopping.is_set():
                        log.error("tensor-parallel rank %d exited with status %s; exiting", rank, code)
                        self.stop(timeout_s=2.0)
                        logging.shutdown()
                        os._exit(1)

        threading.Thread(target=loop, name="tp-worker-watch", daemon=True).start()

    def expect_exit(self) -> None:
        """From now on a worker's exit is a shutdown, not a crash (call before ``stop_workers``)."""
        self._stopping.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Wait for the workers to leave (after ``stop_workers``), killing any that do not in time."""
        self._stopping.set()
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._directory.cleanup()


def spawn_workers(serve_argv: Sequence[str], size: int) -> WorkerGroup:
    """Start ranks 1..size-1 as ``sovereign-runtime serve <same flags> --tp-rank R --tp-rendezvous FILE``.

    Call from the main thread before serving, so the workers load their shards while rank 0 loads its own.
    """
    directory = tempfile.TemporaryDirectory(prefix="sovereign-tp-")
    rendezvous_file = str(Path(directory.name) / "rendezvous")
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sovereign_runtime",
                *serve_argv,
                "--tp-rank",
                str(rank),
                "--tp-rendezvous",
                rendezvous_file,
            ],
            stdin=subprocess.DEVNULL,
        )
        for rank in range(1, size)
    ]
    return WorkerGroup(size, rendezvous_file, processes, directory)


def exit_when_parent_dies() -> None:
    """In a worker: leave (status 1) once rank 0 is gone, even while blocked in a collective."""
    parent = os.getppid()

    def loop() -> None:
        while True:
            time.sleep(_WATCH_INTERVAL_S)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=loop, name="tp-parent-watch", daemon=True).start()


def worker_device(device: str, rank: int) -> torch.device:
    """Rank ``rank``'s device: its own GPU (``cuda:rank``) or the CPU."""
    if device == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
