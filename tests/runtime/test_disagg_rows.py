"""KV rows in the paged cache (read/write through a block table) and the prefill's per-layer exporter."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sovereign_runtime.disagg.kv_rows import read_rows, write_rows
from sovereign_runtime.disagg.service import _Exporter
from sovereign_runtime.disagg.transport import KVTransferError


def _cache() -> torch.Tensor:
    return torch.zeros(3, 8, 4, 5)  # layers, blocks, block_size, kv_dim


def test_rows_round_trip_across_scattered_blocks() -> None:
    cache = _cache()
    table = [6, 2, 5]  # positions 0-3 in block 6, 4-7 in block 2, 8-11 in block 5
    rows = torch.arange(7 * 5, dtype=torch.float32).view(7, 5)
    write_rows(cache, table, 1, 3, rows)  # positions 3..9
    assert torch.equal(cache[1, 6, 3], rows[0]) and torch.equal(cache[1, 2, 0], rows[1])
    assert torch.equal(cache[1, 5, 1], rows[6]) and cache[0].abs().sum() == 0 and cache[2].abs().sum() == 0
    back = read_rows(cache, table, 3, 10)
    assert back.shape == (3, 7, 5) and torch.equal(back[1], rows) and back[0].abs().sum() == 0
    with pytest.raises(ValueError, match="KV rows must be"):
        write_rows(cache, table, 0, 0, torch.zeros(2, 4))
    with pytest.raises(IndexError):
        write_rows(cache, table, 0, 10, torch.zeros(3, 5))  # past the table: never a stray write


class _Stream:
    def __init__(self, fail_after: int | None = None) -> None:
        self.frames: list[tuple[int, int, torch.Tensor]] = []
        self.fail_after = fail_after

    def send_layer(self, layer: int, first: int, kv: torch.Tensor) -> None:
        if self.fail_after is not None and len(self.frames) >= self.fail_after:
            raise KVTransferError("decode connection broke")
        self.frames.append((layer, first, kv.clone()))


def _chunk(exporter: _Exporter, seq: Any, start: int, end: int, layers: int = 3) -> None:
    """What the engine does for one forward chunk: the hook after each decoder layer."""
    for layer in range(layers):
        exporter(seq, layer, start, end)


def test_exporter_sends_each_chunk_once_per_layer_from_the_decode_cached_point() -> None:
    cache = torch.randn(3, 8, 4, 5)
    seq: Any = SimpleNamespace(block_table=[1, 4, 7])
    stream = _Stream()
    exporter = _Exporter(stream, cache, num_cached=4, num_prompt=11)  # type: ignore[arg-type]
    _chunk(exporter, seq, 5, 6)  # the prefill had 0-4 cached, computed position 5: rows 4, 5 go
    _chunk(exporter, seq, 5, 6)  # nothing new (e.g. the same chunk recomputed after a preemption)
    _chunk(exporter, seq, 6, 12)  # the rest; position 11 is the sampled token, not a prompt row
    assert [(layer, first, kv.shape[0]) for layer, first, kv in stream.frames] == [
        (0, 0, 2), (1, 0, 2), (2, 0, 2), (0, 2, 5), (1, 2, 5), (2, 2, 5)
    ]  # fmt: skip
    full = read_rows(cache, seq.block_table, 4, 11)
    for layer in range(3):
        got = torch.cat([kv for lay, _, kv in stream.frames if lay == layer])
        assert torch.equal(got, full[layer])
    assert exporter.sent == 11 and exporter.bytes == full.numel() * 4


def test_exported_rows_are_copies_that_later_cache_writes_do_not_change() -> None:
    cache = torch.randn(2, 4, 4, 5)
    seq: Any = SimpleNamespace(block_table=[2, 0])
    stream = _Stream()
    exporter = _Exporter(stream, cache, num_cached=0, num_prompt=6)  # type: ignore[arg-type]
    exporter(seq, 0, 0, 6)
    want = read_rows(cache, seq.block_table, 0, 6)[0].clone()
    sent = stream.frames[0][2]
    cache.zero_()  # the next step reuses the blocks
    assert torch.equal(sent, want) and exporter.sent == 0  # layer 1 of the chunk is still to come


def test_exporter_failure_aborts_the_prefill_and_stops_sending() -> None:
    aborted: list[bool] = []
    stream = _Stream(fail_after=4)
    exporter = _Exporter(stream, torch.randn(3, 8, 4, 5), 0, 20, lambda: aborted.append(True))  # type: ignore[arg-type]
    seq: Any = SimpleNamespace(block_table=[0, 1, 2, 3, 4])
    _chunk(exporter, seq, 0, 8)
    exporter(seq, 0, 8, 16)
    with pytest.raises(KVTransferError):
        exporter(seq, 1, 8, 16)
    exporter(seq, 2, 8, 16)
    _chunk(exporter, seq, 16, 20)  # after a failure nothing more is sent
    assert aborted == [True] and "connection broke" in (exporter.error or "") and len(stream.frames) == 4
    assert exporter.sent == 8
