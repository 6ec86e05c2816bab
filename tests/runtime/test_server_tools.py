"""Tool calling: DeepSeek's tool-call markup parsed into OpenAI ``tool_calls`` (both layouts, streamed in
any split), the request's ``tools``/``tool_choice`` checked and rendered, forced calls through constrained
decoding, and the HTTP shapes over a scripted engine. The real engine's forced calls are in
test_openai_client.py."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_support import ASSISTANT, EOS, USER, FakeEngine, LiveServer, write_byte_tokenizer
from sovereign_runtime.cli import read_chat_template
from sovereign_runtime.program import UsageError
from sovereign_runtime.server import LoadedRuntime, ServerConfig, create_app
from sovereign_runtime.server.protocol import APIError, parse_chat_request, parse_completion_request
from sovereign_runtime.server.tools import (
    DEEPSEEK,
    ToolCall,
    ToolCallParser,
    ToolChoiceOutput,
    calls_from_required,
    detect_format,
    required_calls_schema,
)
from sovereign_runtime.tokenizer import Tokenizer

MODEL = "tiny-tools"
MARKERS = list(DEEPSEEK.markers)
B, E, CB, CE, SEP = (
    DEEPSEEK.calls_begin,
    DEEPSEEK.calls_end,
    DEEPSEEK.call_begin,
    DEEPSEEK.call_end,
    DEEPSEEK.separator,
)

# A DeepSeek-style template of our own that writes the tools, the calls of assistant turns and tool
# results (the shape of the templates vLLM ships for DeepSeek; not a copy of any).
TOOL_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}## Tools\n{% for t in tools %}{{ t['function']['name'] }}: "
    "{{ t['function']['parameters'] | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}" + USER + "{{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}" + ASSISTANT + "{{ m['content'] or '' }}"
    "{% if m['tool_calls'] %}"
    + B
    + "{% for c in m['tool_calls'] %}"
    + CB
    + "{{ c['function']['name'] }}"
    + SEP
    + "{{ c['function']['arguments'] }}"
    + CE
    + "{% endfor %}"
    + E
    + "{% endif %}"
    + EOS
    + "\n"
    "{% elif m['role'] == 'tool' %}<result>{{ m['content'] }}</result>\n"
    "{% else %}{{ m['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
V3_CALL = CB + "function" + SEP + 'get_weather\n```json\n{"city": "Paris"}\n```' + CE
V31_CALL = CB + "get_time" + SEP + '{"zone": "CET"}' + CE


def ids() -> Iterator[str]:
    return (f"call_{i}" for i in itertools.count())


def split_stream(text: str, cuts: list[int]) -> tuple[str, list[ToolCall]]:
    """Feed ``text`` in pieces cut at ``cuts``; what a streaming client would put together."""
    counter = ids()
    parser = ToolCallParser(DEEPSEEK, lambda: next(counter))
    content, calls = [], []
    for a, b in itertools.pairwise([0, *cuts, len(text)]):
        c, new = parser.feed(text[a:b])
        content.append(c)
        calls.extend(new)
    content.append(parser.flush())
    return "".join(content), calls


# ---- the markup parser -----------------------------------------------------------------------------


def test_both_deepseek_layouts_parse_with_content_before() -> None:
    text = "Checking." + B + V3_CALL + "\n" + V31_CALL + E
    counter = ids()
    content, calls = ToolCallParser.split(text, DEEPSEEK, lambda: next(counter))
    assert content == "Checking."
    assert calls == [
        ToolCall("get_weather", '{"city": "Paris"}', "call_0"),
        ToolCall("get_time", '{"zone": "CET"}', "call_1"),
    ]


def test_every_split_of_the_stream_reads_the_same() -> None:
    text = "Hi " + B + V3_CALL + V31_CALL + E
    whole = split_stream(text, [])
    assert whole[0] == "Hi " and len(whole[1]) == 2
    for cut in range(1, len(text)):
        assert split_stream(text, [cut]) == whole, cut
    # One character at a time: no piece of a marker ever reaches the content.
    assert split_stream(text, list(range(1, len(text)))) == whole


def test_calls_arrive_as_soon_as_their_end_marker_does() -> None:
    parser = ToolCallParser(DEEPSEEK)
    content, calls = parser.feed("a" + B + V3_CALL)
    assert content == "a" and [c.name for c in calls] == ["get_weather"]
    content, calls = parser.feed(V31_CALL[:-3])
    assert (content, calls) == ("", [])
    content, calls = parser.feed(V31_CALL[-3:] + E)
    assert [c.name for c in calls] == ["get_time"]


def test_text_that_only_looks_like_a_marker_is_content() -> None:
    text = "less <｜tool and more <｜tool▁sep｜ text"
    assert ToolCallParser.split(text, DEEPSEEK) == (text, [])


def test_unfinished_and_malformed_calls_come_back_as_content() -> None:
    # max_tokens cut the call: the markup is returned, not dropped.
    cut = "x" + B + CB + "function" + SEP + 'get_weather\n```json\n{"ci'
    assert ToolCallParser.split(cut, DEEPSEEK) == (cut, [])
    # A call without a separator is not a call; the section's other calls still are.
    bad = CB + "no separator here" + CE
    content, calls = ToolCallParser.split(B + bad + V31_CALL + E, DEEPSEEK)
    assert content == B + bad and [c.name for c in calls] == ["get_time"]


def test_format_is_detected_from_the_vocabulary() -> None:
    vocab = {m: 100 + i for i, m in enumerate(MARKERS)}
    found = detect_format(vocab.get)
    assert found is not None and found[0] is DEEPSEEK and found[1] == frozenset(vocab.values())
    del vocab[SEP]
    assert detect_format(vocab.get) is None


# ---- tool_choice readings ------------------------------------------------------------------------------


def test_named_function_streams_its_arguments_after_one_header_entry() -> None:
    out = ToolChoiceOutput("function", function="get_weather", make_id=lambda: "call_x")
    assert out.feed('{"city"') == (
        "",
        [
            {
                "index": 0,
                "id": "call_x",
                "type": "function",
                "function": {"name": "get_weather", "arguments": ""},
            },
            {"index": 0, "function": {"arguments": '{"city"'}},
        ],
    )
    assert out.feed(': "Oslo"}') == ("", [{"index": 0, "function": {"arguments": ': "Oslo"}'}}])
    assert out.finish("stop") == ("", [], "tool_calls")
    assert out.calls == [ToolCall("get_weather", '{"city": "Oslo"}', "call_x")]


def test_required_reads_a_list_and_returns_a_cut_list_as_content() -> None:
    out = ToolChoiceOutput("required", make_id=lambda: "call_r")
    text = '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]'
    assert out.feed(text) == ("", [])
    content, entries, finish = out.finish("stop")
    assert content == "" and finish == "tool_calls"
    assert [e["function"] for e in entries] == [
        {"name": "get_time", "arguments": "{}"},
        {"name": "get_weather", "arguments": '{"city": "Rome"}'},
    ]
    cut = ToolChoiceOutput("required")
    cut.feed(text[:30])
    assert cut.finish("length") == (text[:30], [], "length")
    assert calls_from_required('{"name": "x"}') is None


def test_required_schema_names_each_tool_and_limits_parallel_calls() -> None:
    schema = json.loads(required_calls_schema([WEATHER, TIME], parallel=False))
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    options = schema["items"]["anyOf"]
    assert [o["properties"]["name"]["const"] for o in options] == ["get_weather", "get_time"]
    assert options[0]["properties"]["arguments"] == WEATHER["function"]["parameters"]
    assert "maxItems" not in json.loads(required_calls_schema([WEATHER], parallel=True))


# ---- request validation -------------------------------------------------------------------------------


def chat(**extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Weather in Paris?"}], **extra}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": {"a": 1}}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_bad_tool_fields_are_refused_by_name(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as err:
        parse_chat_request(chat(**extra))
    assert err.value.param == param and err.value.status == 400


def test_tool_fields_parse() -> None:
    req = parse_chat_request(chat(tools=[WEATHER, TIME]))
    assert req.tools is not None and req.tools.choice == "auto" and req.tools.parallel
    assert [t["function"]["name"] for t in req.tools.tools] == ["get_weather", "get_time"]
    forced = parse_chat_request(
        chat(
            tools=[WEATHER, TIME],
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            parallel_tool_calls=False,
        )
    ).tools
    assert forced is not None and (forced.choice, forced.function, forced.parallel) == (
        "function",
        "get_time",
        False,
    )
    # 'none' with tools still renders them; 'none' or nothing without tools is a plain chat.
    assert parse_chat_request(chat(tools=[WEATHER], tool_choice="none")).tools.choice == "none"  # type: ignore[union-attr]
    assert parse_chat_request(chat(tool_choice="none")).tools is None


def test_history_tool_calls_are_checked_and_keep_null_content() -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
    }
    req = parse_chat_request(
        {
            "messages": [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ]
        }
    )
    turn = req.messages[1]
    # Templates tell a call-only turn by its null content; object arguments become JSON text.
    assert turn["content"] is None
    assert turn["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    for bad, param in [
        (
            {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {}}]},
            "messages[1].tool_calls[0].function",
        ),
        ({"role": "assistant", "content": None, "tool_calls": "x"}, "messages[1].tool_calls"),
        ({"role": "user", "content": "hi", "tool_calls": [call]}, "messages[1].tool_calls"),
        ({"role": "tool", "content": "x", "tool_call_id": 7}, "messages[1].tool_call_id"),
    ]:
        with pytest.raises(APIError) as err:
            parse_chat_request({"messages": [{"role": "user", "content": "q"}, bad]})
        assert err.value.param == param


def test_completions_refuse_tools() -> None:
    with pytest.raises(APIError) as err:
        parse_completion_request({"prompt": "x", "tools": [WEATHER]}, vocab_size=10)
    assert err.value.param == "tools"


def test_chat_template_flag_reads_and_checks_the_file(tmp_path: Path) -> None:
    good = tmp_path / "t.jinja"
    good.write_text(TOOL_TEMPLATE)
    assert read_chat_template(good) == TOOL_TEMPLATE
    assert read_chat_template(None) is None
    bad = tmp_path / "bad.jinja"
    bad.write_text("line one\n{% for m in messages %}")
    with pytest.raises(UsageError, match=r"bad\.jinja, line 2"):
        read_chat_template(bad)
    with pytest.raises(UsageError, match=r"missing\.jinja"):
        read_chat_template(tmp_path / "missing.jinja")


# ---- over HTTP, scripted engine --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tool_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = write_byte_tokenizer(tmp_path_factory.mktemp("tools"), TOOL_TEMPLATE, extra_special=MARKERS)
    return Tokenizer.from_dir(path)


def serve(tokenizer: Tokenizer, reply: str) -> tuple[LiveServer, FakeEngine]:
    assert tokenizer.eos_token_id is not None
    engine = FakeEngine(
        script=tokenizer.encode(reply, add_special_tokens=False), eos_token_id=tokenizer.eos_token_id
    )
    rt = LoadedRuntime(engine=engine, tokenizer=tokenizer, max_model_len=512)
    return LiveServer(create_app(ServerConfig(served_model_name=MODEL), runtime=rt)), engine


@pytest.fixture
def live(
    request: pytest.FixtureRequest, tool_tokenizer: Tokenizer
) -> Iterator[tuple[LiveServer, FakeEngine]]:
    srv, engine = serve(tool_tokenizer, request.param)
    yield srv, engine
    srv.close()


AUTO_REPLY = "<think>need weather</think>Let me look." + B + V3_CALL + V31_CALL + E


@pytest.mark.parametrize("live", [AUTO_REPLY], indirect=True)
def test_auto_answer_carries_the_calls(
    live: tuple[LiveServer, FakeEngine], tool_tokenizer: Tokenizer
) -> None:
    srv, engine = live
    status, body = srv.request("POST", "/v1/chat/completions", chat(tools=[WEATHER, TIME]))
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Let me look." and message["reasoning_content"] == "need weather"
    calls = message["tool_calls"]
    assert [(c["type"], c["function"]) for c in calls] == [
        ("function", {"name": "get_weather", "arguments": '{"city": "Paris"}'}),
        ("function", {"name": "get_time", "arguments": '{"zone": "CET"}'}),
    ]
    assert len({c["id"] for c in calls}) == 2 and all(c["id"].startswith("call_") for c in calls)
    # The template saw the tools: the model's prompt lists them.
    prompt = tool_tokenizer.decode(engine.seen_prompts[0])
    assert "## Tools\nget_weather:" in prompt and "get_time:" in prompt


@pytest.mark.parametrize("live", [AUTO_REPLY], indirect=True)
def test_auto_stream_sends_each_call_whole_and_no_markup(live: tuple[LiveServer, FakeEngine]) -> None:
    srv, _ = live
    events = srv.stream("/v1/chat/completions", chat(tools=[WEATHER, TIME], stream=True))
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == "Let me look."
    entries = [entry for d in deltas for entry in d.get("tool_calls", [])]
    assert [(e["index"], e["function"]["name"], e["function"]["arguments"]) for e in entries] == [
        (0, "get_weather", '{"city": "Paris"}'),
        (1, "get_time", '{"zone": "CET"}'),
    ]
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("live", [AUTO_REPLY], indirect=True)
def test_choice_none_renders_tools_but_reads_no_calls(live: tuple[LiveServer, FakeEngine]) -> None:
    srv, _ = live
    status, body = srv.request("POST", "/v1/chat/completions", chat(tools=[WEATHER], tool_choice="none"))
    assert status == 200
    message = body["choices"][0]["message"]
    # The markers are special tokens, left out of plain text as any other.
    assert "tool_calls" not in message and body["choices"][0]["finish_reason"] == "stop"
    assert message["content"].startswith("Let me look.function")


@pytest.mark.parametrize("live", ['{"city": "Oslo"}'], indirect=True)
def test_named_function_is_forced_through_its_schema(live: tuple[LiveServer, FakeEngine]) -> None:
    srv, engine = live
    choice = {"type": "function", "function": {"name": "get_weather"}}
    status, body = srv.request(
        "POST", "/v1/chat/completions", chat(tools=[WEATHER, TIME], tool_choice=choice)
    )
    assert status == 200, body
    assert json.loads(engine.seen_params[0].json_schema) == WEATHER["function"]["parameters"]
    message = body["choices"][0]["message"]
    assert message["content"] is None and body["choices"][0]["finish_reason"] == "tool_calls"
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    events = srv.stream("/v1/chat/completions", chat(tools=[WEATHER], tool_choice=choice, stream=True))
    entries = [e for ev in events[:-1] for e in ev["choices"][0]["delta"].get("tool_calls", [])]
    assert entries[0]["function"] == {"name": "get_weather", "arguments": ""} and entries[0]["id"].startswith(
        "call_"
    )
    assert "".join(e["function"]["arguments"] for e in entries) == '{"city": "Oslo"}'
    assert {e["index"] for e in entries} == {0}


@pytest.mark.parametrize("live", ['[{"name": "get_time", "arguments": {}}]'], indirect=True)
def test_required_is_forced_through_the_list_schema(live: tuple[LiveServer, FakeEngine]) -> None:
    srv, engine = live
    status, body = srv.request(
        "POST", "/v1/chat/completions", chat(tools=[WEATHER, TIME], tool_choice="required")
    )
    assert status == 200, body
    assert json.loads(engine.seen_params[0].json_schema) == json.loads(
        required_calls_schema([WEATHER, TIME], True)
    )
    assert body["choices"][0]["message"]["tool_calls"][0]["function"] == {
        "name": "get_time",
        "arguments": "{}",
    }


@pytest.mark.parametrize("live", ["It is sunny in Paris."], indirect=True)
def test_history_with_calls_and_results_is_rendered(
    live: tuple[LiveServer, FakeEngine], tool_tokenizer: Tokenizer
) -> None:
    srv, engine = live
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    body = {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        ],
        "tools": [WEATHER],
    }
    status, answer = srv.request("POST", "/v1/chat/completions", body)
    assert status == 200, answer
    assert answer["choices"][0]["message"]["content"] == "It is sunny in Paris."
    assert answer["choices"][0]["finish_reason"] == "stop"
    prompt = tool_tokenizer.decode(engine.seen_prompts[0])
    assert 'get_weather{"city": "Paris"}' in prompt and "<result>sunny, 21 C</result>" in prompt


def test_models_that_cannot_call_tools_say_why(tmp_path: Path) -> None:
    # The default test template renders neither tools nor tool calls.
    plain = Tokenizer.from_dir(write_byte_tokenizer(tmp_path / "plain"))
    srv, _ = serve(plain, "hi")
    try:
        status, body = srv.request("POST", "/v1/chat/completions", chat(tools=[WEATHER]))
        assert (
            status == 400
            and body["error"]["param"] == "tools"
            and "--chat-template" in body["error"]["message"]
        )
        history = {
            "messages": [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}],
                },
            ]
        }
        status, body = srv.request("POST", "/v1/chat/completions", history)
        assert status == 400 and body["error"]["param"] == "messages"
    finally:
        srv.close()
    # A template with tools but a vocabulary without markers: auto cannot read calls; forcing one can.
    no_markers = Tokenizer.from_dir(write_byte_tokenizer(tmp_path / "nomark", TOOL_TEMPLATE))
    srv, _ = serve(no_markers, "{}")
    try:
        status, body = srv.request("POST", "/v1/chat/completions", chat(tools=[WEATHER]))
        assert status == 400 and body["error"]["param"] == "tool_choice"
        status, body = srv.request("POST", "/v1/chat/completions", chat(tools=[TIME], tool_choice="required"))
        assert status == 200
    finally:
        srv.close()


def test_a_forced_call_is_not_read_as_reasoning_after_a_template_that_opens_it(tmp_path: Path) -> None:
    # R1's template ends the prompt with <think>; a schema-constrained answer writes no trace, so all of it
    # is the call (and, for response_format, the content).
    thinking = TOOL_TEMPLATE.replace(
        "{% if add_generation_prompt %}" + ASSISTANT,
        "{% if add_generation_prompt %}" + ASSISTANT + "<think>\n",
    )
    tok = Tokenizer.from_dir(write_byte_tokenizer(tmp_path / "r1", thinking, extra_special=MARKERS))
    srv, _ = serve(tok, '{"zone": "CET"}')
    try:
        choice = {"type": "function", "function": {"name": "get_time"}}
        status, body = srv.request("POST", "/v1/chat/completions", chat(tools=[TIME], tool_choice=choice))
        assert status == 200, body
        message = body["choices"][0]["message"]
        assert message["tool_calls"][0]["function"]["arguments"] == '{"zone": "CET"}'
        assert message["reasoning_content"] is None
        status, body = srv.request(
            "POST", "/v1/chat/completions", chat(response_format={"type": "json_object"})
        )
        assert status == 200 and body["choices"][0]["message"]["content"] == '{"zone": "CET"}'
    finally:
        srv.close()


# ---- chat_template_kwargs ---------------------------------------------------------------------------


def test_chat_template_kwargs_reach_the_template(tmp_path: Path) -> None:
    # DeepSeek-V3.1's template opens the reasoning trace when `thinking` is set.
    template = TOOL_TEMPLATE.replace(
        "{% if add_generation_prompt %}" + ASSISTANT,
        "{% if add_generation_prompt %}"
        + ASSISTANT
        + "{% if thinking %}<think>{% else %}</think>{% endif %}",
    )
    tok = Tokenizer.from_dir(write_byte_tokenizer(tmp_path / "v31", template))
    srv, engine = serve(tok, "step</think>done")
    try:
        status, body = srv.request(
            "POST", "/v1/chat/completions", chat(chat_template_kwargs={"thinking": True})
        )
        assert status == 200, body
        assert tok.decode(engine.seen_prompts[-1]).endswith("?\n<think>")
        # The prompt opened the trace, so the answer is split as reasoning then content.
        assert body["choices"][0]["message"]["reasoning_content"] == "step"
        assert body["choices"][0]["message"]["content"] == "done"
        status, body = srv.request("POST", "/v1/chat/completions", chat())
        assert tok.decode(engine.seen_prompts[-1]).endswith("?\n</think>")
        for bad, fragment in (({"messages": []}, "may not set ['messages']"), ([1], "must be an object")):
            status, body = srv.request("POST", "/v1/chat/completions", chat(chat_template_kwargs=bad))
            assert status == 400 and body["error"]["param"] == "chat_template_kwargs"
            assert fragment in body["error"]["message"]
    finally:
        srv.close()
