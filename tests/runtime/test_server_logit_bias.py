"""logit_bias end to end: the real engine and model (tiny random checkpoint, CPU) through the HTTP server.

The byte-level test tokenizer has one token per byte, so once every token outside ASCII letters and digits
is banned, a reply's text names its tokens exactly and the tests can read what the sampler chose.
"""

from __future__ import annotations

import json
import string
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from server_support import LiveServer, byte_tokenizer_checkpoint, serving_checkpoint
from sovereign_runtime.server.app import STATE
from sovereign_runtime.tokenizer import Tokenizer

MODEL = "tiny-bias"
VOCAB = 262  # byte_tokenizer_checkpoint's vocabulary
ALPHANUMERIC = string.ascii_letters + string.digits


@pytest.fixture(scope="module")
def server(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    checkpoint = byte_tokenizer_checkpoint(tiny_checkpoint_factory, tmp_path_factory.mktemp("bias") / "ckpt")
    with serving_checkpoint(checkpoint, MODEL, max_model_len=128, max_num_seqs=4, num_kv_blocks=32) as srv:
        yield srv


def _tokenizer(server: LiveServer) -> Tokenizer:
    rt = server.app[STATE].runtime
    assert rt is not None
    return rt.tokenizer


def _ids(tokenizer: Tokenizer, chars: str) -> set[int]:
    ids = [tokenizer.encode(c, add_special_tokens=False) for c in chars]
    assert all(len(i) == 1 for i in ids)
    return {i[0] for i in ids}


def _alphanumeric_only(tokenizer: Tokenizer) -> dict[str, float]:
    allowed = _ids(tokenizer, ALPHANUMERIC)
    return {str(t): -100 for t in range(VOCAB) if t not in allowed}


def _complete(server: LiveServer, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    status, answer = server.request("POST", "/v1/completions", {**body, **extra})
    assert status == 200, answer
    return answer["choices"][0]


def test_banned_tokens_never_appear(server: LiveServer) -> None:
    tokenizer = _tokenizer(server)
    bias = _alphanumeric_only(tokenizer)
    first = _complete(server, logit_bias=bias)["text"]
    assert len(first) == 12 and set(first) <= set(ALPHANUMERIC), first
    # Ban every token greedy chose: none of them comes back, the first token included (sampled with the
    # prefill), and the reply is still 12 tokens long.
    bias.update({str(t): -100 for t in _ids(tokenizer, first)})
    second = _complete(server, logit_bias=bias)["text"]
    assert len(second) == 12 and set(second) <= set(ALPHANUMERIC), second
    assert not set(second) & set(first), (first, second)


def test_a_forced_token_always_appears_greedy_sampled_and_in_chat(server: LiveServer) -> None:
    tokenizer = _tokenizer(server)
    (z,) = _ids(tokenizer, "Z")
    greedy = _complete(server, logit_bias={str(z): 100}, logprobs=1)
    assert greedy["text"] == "Z" * 12
    # logprobs are those of the biased distribution (OpenAI's order): the forced token is near-certain.
    assert all(lp > -1e-3 for lp in greedy["logprobs"]["token_logprobs"]), greedy["logprobs"]
    sampled = _complete(server, logit_bias={str(z): 100}, temperature=1.0, top_p=0.9, seed=3)
    assert sampled["text"] == "Z" * 12
    status, chat = server.request(
        "POST",
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 6,
            "ignore_eos": True,
            "logit_bias": {str(z): 100},
        },
    )
    assert status == 200, chat
    assert chat["choices"][0]["message"]["content"] == "Z" * 6


def test_without_a_bias_the_model_answers_otherwise(server: LiveServer) -> None:
    # The forced reply above is the bias's doing, not this random model's habit.
    assert _complete(server)["text"] != "Z" * 12


def test_a_token_id_past_the_vocabulary_is_a_400(server: LiveServer) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "logit_bias": {str(VOCAB): 5}}
    status, answer = server.request("POST", "/v1/completions", body)
    assert status == 400 and answer["error"]["param"] == "logit_bias", answer


def test_presence_and_frequency_penalties_change_the_reply_and_are_bounded(server: LiveServer) -> None:
    tokenizer = _tokenizer(server)
    bias = _alphanumeric_only(tokenizer)
    plain = _complete(server, logit_bias=bias, max_tokens=24)["text"]
    penalized = _complete(server, logit_bias=bias, max_tokens=24, presence_penalty=2, frequency_penalty=2)[
        "text"
    ]
    assert penalized != plain
    # A repeat costs at least 4 in the logits: fewer repeats than the unpenalized reply.
    assert len(penalized) - len(set(penalized)) < len(plain) - len(set(plain))
    body = {"model": MODEL, "max_tokens": 2}
    for path, extra in (
        ("/v1/completions", {"prompt": "Hello", "presence_penalty": 2.5}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "frequency_penalty": -3}),
    ):
        status, answer = server.request("POST", path, {**body, **extra})
        name = next(k for k in extra if k.endswith("penalty"))
        assert status == 400 and answer["error"]["param"] == name, answer
        assert "must be in [-2, 2]" in answer["error"]["message"]


def test_repetition_penalty_and_min_p_are_taken_and_vllm_extras_we_lack_are_refused_by_name(
    server: LiveServer,
) -> None:
    tokenizer = _tokenizer(server)
    bias = _alphanumeric_only(tokenizer)
    plain = _complete(server, logit_bias=bias, max_tokens=24)["text"]
    assert _complete(server, logit_bias=bias, max_tokens=24, repetition_penalty=2.0)["text"] != plain
    # min_p 1 keeps only the most likely token: sampling at any temperature is then greedy.
    sampled = _complete(server, logit_bias=bias, max_tokens=24, temperature=1.5, min_p=1.0, seed=3)["text"]
    assert sampled == plain
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    # Their "off" values are fine (vLLM clients send them).
    defaults = {"use_beam_search": False, "skip_special_tokens": True, "length_penalty": 1.0, "bad_words": []}
    status, answer = server.request("POST", "/v1/completions", {**body, **defaults})
    assert status == 200, answer
    for name, value in (
        ("use_beam_search", True),
        ("guided_json", {"type": "object"}),
        ("skip_special_tokens", False),
        ("prompt_logprobs", 1),
        ("bad_words", ["x"]),
    ):
        status, answer = server.request("POST", "/v1/completions", {**body, name: value})
        assert status == 400 and answer["error"]["param"] == name, answer
        assert answer["error"]["code"] == "unsupported_value"
    status, answer = server.request("POST", "/v1/completions", {**body, "repetition_penalty": 0})
    assert status == 400 and answer["error"]["param"] == "repetition_penalty", answer


def test_left_out_sampling_fields_take_the_models_generation_config(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """As vLLM's --generation-config auto (DeepSeek-R1 ships temperature 0.6 and top_p 0.95 there).
    Here the model's file asks for greedy: unseeded requests that leave temperature out all agree,
    and a request's own temperature still wins."""
    from sovereign_runtime.assembly import EngineOptions, make_loader
    from sovereign_runtime.cli import sampling_defaults
    from sovereign_runtime.server import ServerConfig, create_app

    checkpoint = byte_tokenizer_checkpoint(tiny_checkpoint_factory, tmp_path / "ckpt")
    (checkpoint / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "do_sample": False}))
    options = EngineOptions(model_path=checkpoint, device="cpu", max_model_len=128, num_kv_blocks=32)
    replies: dict[str, list[str]] = {}
    for mode in ("auto", "none"):
        config = ServerConfig(served_model_name=MODEL, sampling_defaults=sampling_defaults(mode, checkpoint))
        srv = LiveServer(create_app(config, loader=make_loader(options)))
        try:
            srv.wait_ready()
            body = {"model": MODEL, "prompt": "Hello", "max_tokens": 16, "ignore_eos": True}
            replies[mode] = []
            for extra in ({}, {}, {}, {"temperature": 1.0, "seed": 5}):
                status, answer = srv.request("POST", "/v1/completions", {**body, **extra})
                assert status == 200, answer
                replies[mode].append(answer["choices"][0]["text"])
        finally:
            srv.close()
    auto, none = replies["auto"], replies["none"]
    assert auto[0] == auto[1] == auto[2]  # greedy by the model's default
    assert auto[3] != auto[0]  # the request's own temperature
    assert len(set(none[:3])) > 1  # OpenAI's default temperature 1: sampled
