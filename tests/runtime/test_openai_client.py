"""The real `openai` Python client against a live server (real engine, tiny checkpoint, API key on)."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from server_support import LiveServer, byte_tokenizer_checkpoint, write_byte_tokenizer
from sovereign_runtime.assembly import EngineOptions, make_loader
from sovereign_runtime.server import ServerConfig, create_app
from sovereign_runtime.server.app import STATE
from tokenizers import pre_tokenizers

MODEL = "tiny-openai"
KEY = "sk-sovereign-test"


@pytest.fixture(scope="module")
def server(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    ckpt = byte_tokenizer_checkpoint(tiny_checkpoint_factory, tmp_path_factory.mktemp("oai") / "ckpt")
    options = EngineOptions(
        model_path=ckpt, device="cpu", max_model_len=128, max_num_seqs=4, num_kv_blocks=32
    )
    srv = LiveServer(
        create_app(
            ServerConfig(served_model_name=MODEL, api_key=KEY, warmup=False), loader=make_loader(options)
        )
    )
    try:
        deadline = time.monotonic() + 120
        while not srv.app[STATE].ready:
            assert srv.app[STATE].phase != "failed", srv.app[STATE].error
            assert time.monotonic() < deadline
            time.sleep(0.05)
        yield srv
    finally:
        srv.close()


@pytest.fixture
def client(server: LiveServer) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    yield c
    c.close()


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_chat(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=6, temperature=0
    )
    assert resp.object == "chat.completion" and resp.model == MODEL
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert resp.usage is not None and 1 <= resp.usage.completion_tokens <= 6
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_completions(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model=MODEL, prompt=["abc", "xyz"], max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in resp.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in resp.choices)
    assert resp.usage is not None and resp.usage.completion_tokens == 10


def test_streaming_chat_matches_non_streaming(client: openai.OpenAI) -> None:
    kwargs = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "stream please"}],
        "max_tokens": 8,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    full = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)  # type: ignore[call-overload]
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            text += (delta.content or "") + (getattr(delta, "reasoning_content", None) or "")
            finish = choice.finish_reason or finish
    message = full.choices[0].message
    assert text == (getattr(message, "reasoning_content", None) or "") + (message.content or "")
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 8


def test_streaming_completion(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="abc", max_tokens=4, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert chunks[-1].choices[0].finish_reason == "length"


def test_errors(client: openai.OpenAI, server: LiveServer) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=3
        )
    assert bad.value.status_code == 400 and bad.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    assert bad.value.param == "max_tokens"
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-9", prompt="x")
    assert missing.value.code == "model_not_found"
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    wrong.close()
    # Still serving.
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=1).choices


def test_logit_bias_as_the_client_sends_it(client: openai.OpenAI) -> None:
    # The client's own form: {token id string: int}. The byte tokenizer's "Z" is one token.
    z = sorted(pre_tokenizers.ByteLevel.alphabet()).index("Z")
    resp = client.completions.create(
        model=MODEL, prompt="abc", max_tokens=4, logit_bias={str(z): 100}, extra_body={"ignore_eos": True}
    )
    assert resp.choices[0].text == "ZZZZ"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], logit_bias={str(z): 101}
        )
    assert bad.value.status_code == 400 and bad.value.param == "logit_bias"


# ---- tool calling: forced calls decoded under their schemas by the real engine --------------------------

CITY = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def tool_client(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[openai.OpenAI]:
    from test_server_tools import MARKERS, TOOL_TEMPLATE

    # The byte vocabulary plus DeepSeek's five tool-call markers; the checkpoint keeps its own template
    # and the server is given the tool template as serve --chat-template gives it.
    src = tiny_checkpoint_factory(vocab_size=262 + len(MARKERS), bos_token_id=256, eos_token_id=257)
    ckpt = tmp_path_factory.mktemp("oai-tools") / "ckpt"
    shutil.copytree(src, ckpt)
    write_byte_tokenizer(ckpt, extra_special=MARKERS)
    options = EngineOptions(
        model_path=ckpt,
        device="cpu",
        max_model_len=512,
        max_num_seqs=4,
        num_kv_blocks=64,
        chat_template=TOOL_TEMPLATE,
    )
    srv = LiveServer(
        create_app(ServerConfig(served_model_name=MODEL, warmup=False), loader=make_loader(options))
    )
    try:
        srv.wait_ready()
        c = openai.OpenAI(base_url=srv.url + "/v1", max_retries=0, timeout=120, api_key="unused")
        yield c
        c.close()
    finally:
        srv.close()


def ask(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "weather and time?"}],
        tools=[CITY, CLOCK],
        temperature=0,
        **{"max_tokens": 160, **kwargs},
    )


def test_named_tool_choice_returns_arguments_that_match_the_schema(tool_client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    resp = ask(tool_client, tool_choice=choice)
    assert resp.choices[0].finish_reason == "tool_calls"
    message = resp.choices[0].message
    assert message.content is None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_time" and call.id.startswith("call_")
    assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    # Streamed, the same call arrives as a header entry and argument pieces.
    name, arguments = None, ""
    for chunk in ask(tool_client, tool_choice=choice, stream=True):
        for delta_call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            name = delta_call.function.name or name
            arguments += delta_call.function.arguments or ""
    assert name == "get_time" and json.loads(arguments) == json.loads(call.function.arguments)


def test_required_tool_choice_calls_one_of_the_tools(tool_client: openai.OpenAI) -> None:
    resp = ask(tool_client, tool_choice="required", parallel_tool_calls=False)
    assert resp.choices[0].finish_reason == "tool_calls"
    calls = resp.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name in ("get_weather", "get_time")
    args = json.loads(calls[0].function.arguments)
    assert set(args) == ({"city"} if calls[0].function.name == "get_weather" else {"zone"})


def test_auto_tool_choice_serves_a_model_that_answers_in_text(tool_client: openai.OpenAI) -> None:
    # The random model writes no markup: its answer is plain content and nothing is lost.
    resp = ask(tool_client, max_tokens=12, extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length" and not resp.choices[0].message.tool_calls
    assert resp.usage is not None and resp.usage.completion_tokens == 12


def test_n_choices_from_the_real_engine(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "pick"}]
    greedy = client.chat.completions.create(
        model=MODEL, messages=messages, n=2, temperature=0, max_tokens=6, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in greedy.choices] == [0, 1]
    assert greedy.choices[0].message.content == greedy.choices[1].message.content

    def sampled() -> list[str]:
        resp = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            n=3,
            temperature=1,
            seed=11,
            max_tokens=8,
            extra_body={"ignore_eos": True},
        )
        assert resp.usage is not None and resp.usage.completion_tokens == 24
        return [c.message.content or "" for c in resp.choices]

    first = sampled()
    # Seeded choices differ from each other and repeat exactly.
    assert len(set(first)) == 3 and sampled() == first
