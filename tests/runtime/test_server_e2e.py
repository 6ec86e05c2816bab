"""The server end to end through the real engine and model on a tiny random checkpoint (CPU, fp32)."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from server_support import LiveServer, byte_tokenizer_checkpoint, serving_checkpoint
from sovereign_runtime.model import greedy_generate, load_model
from sovereign_runtime.server.app import STATE

MODEL = "tiny-e2e"
MAX_LEN = 256


@pytest.fixture(scope="module")
def checkpoint(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    return byte_tokenizer_checkpoint(tiny_checkpoint_factory, tmp_path_factory.mktemp("e2e") / "ckpt")


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[LiveServer]:
    with serving_checkpoint(
        checkpoint, MODEL, max_model_len=MAX_LEN, max_num_seqs=8, num_kv_blocks=64
    ) as srv:
        yield srv


def _stats(server: LiveServer) -> Any:
    rt = server.app[STATE].runtime
    assert rt is not None
    return rt.engine.stats()


def test_ready_after_real_load_and_warmup(server: LiveServer) -> None:
    assert server.request("GET", "/health/ready")[0] == 200
    status, body = server.request("GET", "/v1/models")
    assert status == 200 and body["data"][0]["max_model_len"] == MAX_LEN


def test_greedy_completion_matches_the_model(server: LiveServer, checkpoint: Path) -> None:
    prompts = [[72, 101, 108, 108, 111], [87, 111, 114, 108, 100, 33, 10]]
    status, body = server.request(
        "POST",
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": prompts,
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 0,
        },
    )
    assert status == 200, body
    model, _ = load_model(checkpoint, "cpu", torch.float32)
    want = greedy_generate(model, prompts, 12)
    rt = server.app[STATE].runtime
    assert rt is not None
    for choice, ids in zip(body["choices"], want, strict=True):
        assert choice["finish_reason"] == "length"
        assert choice["text"] == rt.tokenizer.decode(ids)
        assert len(choice["logprobs"]["token_logprobs"]) == 12
        assert all(lp <= 0 for lp in choice["logprobs"]["token_logprobs"])
    assert body["usage"]["prompt_tokens"] == 12 and body["usage"]["completion_tokens"] == 24


def test_chat_stream_equals_non_stream(server: LiveServer) -> None:
    base = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say something"}],
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
    }
    status, full = server.request("POST", "/v1/chat/completions", base)
    assert status == 200
    events = server.stream(
        "/v1/chat/completions", {**base, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    streamed_content = "".join(d.get("content") or "" for d in deltas)
    streamed_reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    message = full["choices"][0]["message"]
    assert streamed_content == message["content"]
    assert streamed_reasoning == (message["reasoning_content"] or "")
    usage = events[-2]["usage"]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert usage[key] == full["usage"][key]
    # The same prompt again is served partly from the radix cache.
    assert (
        usage["prompt_tokens_details"]["cached_tokens"]
        > full["usage"]["prompt_tokens_details"]["cached_tokens"]
    )


def test_seeded_sampling_is_reproducible(server: LiveServer) -> None:
    body = {
        "model": MODEL,
        "prompt": "abc",
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 7,
        "ignore_eos": True,
    }
    a = server.request("POST", "/v1/completions", body)[1]["choices"][0]["text"]
    b = server.request("POST", "/v1/completions", body)[1]["choices"][0]["text"]
    assert a == b


def test_prompt_too_long_for_context(server: LiveServer) -> None:
    status, err = server.request(
        "POST", "/v1/completions", {"model": MODEL, "prompt": [65] * 250, "max_tokens": 10}
    )
    assert status == 400 and err["error"]["param"] == "max_tokens"
    assert err["error"]["code"] == "context_length_exceeded"
    status, err = server.request("POST", "/v1/completions", {"model": MODEL, "prompt": [65] * 300})
    assert status == 400 and err["error"]["param"] == "prompt"


def test_disconnect_frees_kv_blocks_at_once(server: LiveServer) -> None:
    assert _stats(server).kv_cache_usage == 0.0
    generated_before = _stats(server).generation_tokens_total
    body = {"model": MODEL, "prompt": [65] * 40, "max_tokens": 200, "ignore_eos": True, "stream": True}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request(
        "POST",
        "/v1/completions",
        body=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.read(6) == b"data: "  # the first event arrived: the request is running
    # The stats snapshot is refreshed after each engine step; wait for the one showing the request.
    deadline = time.monotonic() + 5
    while not (_stats(server).num_requests_running == 1 and _stats(server).kv_cache_usage > 0):
        assert time.monotonic() < deadline, "the streaming request never showed up as running"
        time.sleep(0.01)
    assert conn.sock is not None
    conn.sock.close()
    conn.close()
    deadline = time.monotonic() + 5
    while _stats(server).num_requests_running or _stats(server).kv_cache_usage:
        assert time.monotonic() < deadline, "aborted request still holds KV blocks"
        time.sleep(0.02)
    # The request stopped long before its 200 tokens.
    assert _stats(server).generation_tokens_total - generated_before < 150
    _, text = server.request("GET", "/metrics")
    assert 'vllm:request_success_total{finished_reason="abort",model_name="tiny-e2e"} 1.0' in text
