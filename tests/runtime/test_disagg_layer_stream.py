"""The prefill role streams the KV per layer: layer i's rows reach the sender while later layers compute.

Engine level, one process, no sockets: a prefill ``LLMEngine`` exports through the real ``_Exporter`` into a
recording stream that writes each frame straight into a decode ``LLMEngine``'s reserved blocks, as the TCP
receiver does; the decode then continues and must give the unified engine's greedy tokens exactly.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import torch
from sovereign_runtime.disagg.kv_rows import write_rows
from sovereign_runtime.disagg.service import _Exporter
from sovereign_runtime.engine import SamplingParams
from sovereign_runtime.engine.engine import EngineConfig, LLMEngine
from sovereign_runtime.engine.remote_prefill import RemoteFirstToken, RemotePrefill, RemoteSlot

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _engine(path: Path, **kw: Any) -> LLMEngine:
    cfg = EngineConfig(**{"block_size": 4, "num_kv_blocks": 64, "max_num_batched_tokens": 64, **kw})
    return LLMEngine.from_pretrained(path, cfg)


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 256) for _ in range(n)]


class _LoopbackStream:
    """Records what the engine thread hands over, in order, and lands the rows in the decode's slot."""

    def __init__(self, events: list[tuple[str, int]], slot: RemoteSlot | None = None) -> None:
        self.events, self.slot = events, slot
        self.frames: list[tuple[int, int, int]] = []

    def send_layer(self, layer: int, first: int, kv: torch.Tensor) -> None:
        self.events.append(("send", layer))
        self.frames.append((layer, first, kv.shape[0]))
        if self.slot is not None:
            s = self.slot
            write_rows(s.kv_cache, s.block_table, layer, s.num_cached + first, kv)


def _prefill(llm: LLMEngine, prompt: list[int], stream: _LoopbackStream, num_cached: int = 0) -> int:
    """Run the prompt on the prefill engine with the exporter installed; returns the first token."""
    exporter = _Exporter(stream, llm.runner.kv_cache, num_cached, len(prompt))  # type: ignore[arg-type]
    rid = llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    llm.kv_export_hooks[rid] = exporter
    tokens = []
    while llm.has_unfinished():
        tokens += [t for o in llm.step() for t in o.new_token_ids]
    llm.kv_export_hooks.pop(rid)
    assert exporter.error is None and exporter.sent == len(prompt)
    assert len(tokens) == 1
    return tokens[0]


def _unified(llm: LLMEngine, prompt: list[int]) -> list[int]:
    llm.add_request(prompt, GREEDY)
    tokens = []
    while llm.has_unfinished():
        tokens += [t for o in llm.step() for t in o.new_token_ids]
    return tokens


def test_layer_zero_is_handed_to_the_sender_before_the_last_layer_runs(tiny_checkpoint: Path) -> None:
    llm = _engine(tiny_checkpoint)
    layers = list(llm.runner.model.model.layers)  # type: ignore[attr-defined]
    events: list[tuple[str, int]] = []
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda _m, _a, i=i: events.append(("forward", i)))
    stream = _LoopbackStream(events)
    prompt = _prompt(21)  # one chunk (fits max_num_batched_tokens)
    _prefill(llm, prompt, stream)
    last = len(layers) - 1
    assert len(layers) >= 3
    # Interleaved: each layer's frame follows that layer's forward and precedes the next layer's.
    assert events == [e for i in range(len(layers)) for e in (("forward", i), ("send", i))]
    assert events.index(("send", 0)) < events.index(("forward", last))
    # One frame per decoder layer with the whole prompt; the MTP layer (in the checkpoint) is not sent.
    assert stream.frames == [(i, 0, len(prompt)) for i in range(len(layers))]


def test_single_and_multi_chunk_transfers_reproduce_unified_greedy(tiny_checkpoint: Path) -> None:
    unified = _engine(tiny_checkpoint)
    for prompt, chunk in ((_prompt(29, 1), 64), (_prompt(37, 2), 16)):
        want = _unified(unified, prompt)
        prefill = _engine(tiny_checkpoint, max_num_batched_tokens=chunk)
        decode = _engine(tiny_checkpoint)
        seq = decode.make_sequence(prompt, GREEDY)
        remote = RemotePrefill(decode)
        slot = remote.reserve(seq)
        assert slot is not None and slot.num_cached == 0
        stream = _LoopbackStream([], slot)
        first = _prefill(prefill, prompt, stream)
        num_layers = prefill.runner.kv_cache.shape[0]
        chunks = -(-len(prompt) // chunk)
        assert len(stream.frames) == chunks * num_layers
        out = remote.commit(seq.request_id, RemoteFirstToken(first), time.monotonic())
        assert out is not None
        got = list(out.new_token_ids)
        while decode.has_unfinished():
            got += [t for o in decode.step() for t in o.new_token_ids]
        assert got == want, (len(prompt), chunk)
        decode.scheduler.check()
        assert not prefill.kv_export_hooks
