"""The server's edge against a hostile or careless client: every mistake a 4xx with an OpenAI error,
oversized and over-long inputs refused before they cost anything, load refused politely (429)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from server_support import FakeEngine, LiveServer, write_byte_tokenizer
from sovereign_runtime.engine.api import EngineStats
from sovereign_runtime.server import LoadedRuntime, ServerConfig, create_app
from sovereign_runtime.server.edge import NORMALIZATION_MARGIN
from sovereign_runtime.tokenizer import Tokenizer

MODEL = "tiny-test"
MAX_LEN = 64
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(write_byte_tokenizer(tmp_path_factory.mktemp("tok")))


def _engine(tokenizer: Tokenizer, **kwargs: Any) -> FakeEngine:
    assert tokenizer.eos_token_id is not None
    return FakeEngine(
        script=tokenizer.encode("ok", add_special_tokens=False), eos_token_id=tokenizer.eos_token_id, **kwargs
    )


def _serve(engine: FakeEngine, tokenizer: Tokenizer, **config: Any) -> LiveServer:
    rt = LoadedRuntime(engine=engine, tokenizer=tokenizer, max_model_len=MAX_LEN)
    return LiveServer(create_app(ServerConfig(served_model_name=MODEL, **config), runtime=rt))


@pytest.fixture
def server(tokenizer: Tokenizer) -> Iterator[LiveServer]:
    srv = _serve(_engine(tokenizer), tokenizer, max_body_bytes=200_000)
    yield srv
    srv.close()


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}


def _completion(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 4, **extra}


def _assert_error(status: int, body: Any, expected: int, param: str | None = None) -> dict[str, Any]:
    assert status == expected, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"[" * 100_000, "nested too deeply"),
        (b'{"max_tokens": ' + b"9" * 5000 + b"}", "could not parse"),
        (
            json.dumps(_chat(messages=[{"role": "user", "content": "\ud800"}])).encode(),
            "lone UTF-16 surrogate",
        ),
        (b'{"messages": "\xff\xfe"}', "could not parse"),
    ],
    ids=["100k-deep", "5000-digit-int", "lone-surrogate", "non-utf8"],
)
def test_bodies_that_used_to_500_are_400s(server: LiveServer, raw: bytes, fragment: str) -> None:
    status, body = server.request("POST", CHAT, raw=raw)
    assert fragment in _assert_error(status, body, 400)["message"]
    assert server.request("POST", CHAT, _chat())[0] == 200  # and the server keeps serving


def test_a_body_over_the_limit_is_a_413_openai_error(server: LiveServer) -> None:
    status, body = server.request("POST", COMP, {"prompt": "x" * 250_000})
    assert "limit of 200000 bytes" in _assert_error(status, body, 413)["message"]


def test_an_over_long_prompt_is_refused_by_its_size_before_tokenisation(
    server: LiveServer, tokenizer: Tokenizer
) -> None:
    limit = MAX_LEN * tokenizer.max_token_bytes * NORMALIZATION_MARGIN
    for path, body, param in (
        (COMP, {"prompt": "x" * (limit + 1)}, "prompt"),
        (CHAT, {"messages": [{"role": "user", "content": "x" * (limit + 1)}]}, "messages"),
    ):
        status, answer = server.request("POST", path, body)
        error = _assert_error(status, answer, 400, param)
        # The size bound, not the token count: the tokenizer never saw it.
        assert error["code"] == "context_length_exceeded" and "bytes" in error["message"]


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "w", "parameters": {}}}]}, "tools"),
        # This server's chat template writes no tools: the model could not see them.
        (
            {"tools": [{"type": "function", "function": {"name": "w"}}], "tool_choice": "required"},
            "tools",
        ),
        ({"response_format": {"type": "grammar"}}, "response_format"),
    ],
)
def test_features_we_lack_are_refused_by_name_never_ignored(
    server: LiveServer, changes: dict[str, Any], param: str
) -> None:
    status, body = server.request("POST", CHAT, _chat(**changes))
    assert _assert_error(status, body, 400, param)["code"] == "unsupported_value"


def test_what_is_supported_of_those_still_works(server: LiveServer) -> None:
    for changes in ({"response_format": {"type": "text"}}, {"tool_choice": "none"}, {"logit_bias": {}}):
        assert server.request("POST", CHAT, _chat(**changes))[0] == 200, changes


@pytest.mark.parametrize(
    ("logit_bias", "code", "fragment"),
    [
        ([15, -100], "invalid_type", "must be an object"),
        ("15:-100", "invalid_type", "must be an object"),
        ({"fifteen": -100}, "invalid_value", "integer token ids"),
        ({"1.5": -100}, "invalid_value", "integer token ids"),
        ({"-1": -100}, "invalid_value", "non-negative"),
        ({"262": 5}, "invalid_value", "[0, 262)"),
        ({"99999999999999999999999": 5}, "invalid_value", "integer token ids"),
        ({"15": "-100"}, "invalid_value", "finite numbers"),
        ({"15": None}, "invalid_value", "finite numbers"),
        ({"15": True}, "invalid_value", "finite numbers"),
        ({"15": -100.01}, "invalid_value", "[-100, 100]"),
        ({"15": 1e9}, "invalid_value", "[-100, 100]"),
        ({str(t): 1 for t in range(301)}, "invalid_value", "at most 300"),
    ],
    ids=lambda v: str(v)[:24],
)
@pytest.mark.parametrize("path", [CHAT, COMP])
def test_bad_logit_bias_is_a_400_naming_it(
    server: LiveServer, path: str, logit_bias: Any, code: str, fragment: str
) -> None:
    body = _chat(logit_bias=logit_bias) if path == CHAT else _completion(logit_bias=logit_bias)
    status, answer = server.request("POST", path, body)
    error = _assert_error(status, answer, 400, "logit_bias")
    assert error["code"] == code and fragment in error["message"], error


def test_an_int64_overflowing_top_k_is_a_400(server: LiveServer) -> None:
    for path, body in ((CHAT, _chat(top_k=2**63, top_p=0.5)), (COMP, _completion(top_k=2**63))):
        status, answer = server.request("POST", path, body)
        _assert_error(status, answer, 400, "top_k")


def test_non_finite_logit_bias_is_a_400(server: LiveServer) -> None:
    # JSON has no NaN, but Python's json (the server's parser and some clients) reads and writes it.
    raw = (
        b'{"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"15": NaN}}'
    )
    status, answer = server.request("POST", CHAT, raw=raw)
    assert "finite" in _assert_error(status, answer, 400, "logit_bias")["message"]


def test_a_valid_logit_bias_reaches_the_engine_normalised(tokenizer: Tokenizer) -> None:
    engine = _engine(tokenizer)
    srv = _serve(engine, tokenizer)
    try:
        bias: dict[str, float] = {str(t): -100 for t in range(200)}
        bias["261"] = 100.0
        status, answer = srv.request("POST", CHAT, _chat(logit_bias=bias))
        assert status == 200, answer
        assert srv.request("POST", COMP, _completion(logit_bias={"7": 2.5}))[0] == 200
        assert srv.request("POST", COMP, _completion(logit_bias={}))[0] == 200
    finally:
        srv.close()
    chat_params, comp_params, empty_params = engine.seen_params
    assert chat_params.logit_bias == {int(k): float(v) for k, v in bias.items()}
    assert comp_params.logit_bias == {7: 2.5} and empty_params.logit_bias == {}


def test_the_openai_tool_call_history_is_a_400_not_a_500(server: LiveServer) -> None:
    history = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    status, body = server.request("POST", CHAT, _chat(messages=history))
    # This server's template writes no tool calls: rendering would drop them, so it is refused.
    assert "tool_calls" in _assert_error(status, body, 400, "messages")["message"]
    # An assistant turn with null content and no tool calls renders as an empty turn.
    plain = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "b"},
    ]
    assert server.request("POST", CHAT, _chat(messages=plain))[0] == 200


def test_one_call_takes_a_bounded_number_of_prompts(server: LiveServer) -> None:
    status, body = server.request("POST", COMP, {"prompt": ["1 + 1"] * 5000, "max_tokens": 1})
    assert "at most 64 prompts" in _assert_error(status, body, 400, "prompt")["message"]


def test_undecodable_authorization_is_a_401_not_a_500(tokenizer: Tokenizer) -> None:
    srv = _serve(_engine(tokenizer), tokenizer, api_key="secret")
    try:
        payload = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                % (len(payload), payload)
            )
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 401"), head
        assert json.loads(body)["error"]["code"] == "invalid_api_key"
    finally:
        srv.close()


class _FullEngine(FakeEngine):
    """An engine that runs nothing yet: every admitted request waits (a saturated replica)."""

    def stats(self) -> EngineStats:
        stats = super().stats()
        stats.num_requests_running = 0
        return stats


def test_a_full_waiting_queue_answers_429_with_retry_after(tokenizer: Tokenizer) -> None:
    engine = _FullEngine(script=[5] * 8, eos_token_id=tokenizer.eos_token_id or 0, delay_s=0.2)
    srv = _serve(engine, tokenizer, max_waiting_requests=2)
    try:
        results: list[int] = []
        slow = [
            threading.Thread(
                target=lambda: results.append(srv.request("POST", COMP, {"prompt": "x", "max_tokens": 8})[0])
            )
            for _ in range(2)
        ]
        for t in slow:
            t.start()
        deadline = 50
        while len(engine.active) < 2 and deadline:
            threading.Event().wait(0.05)
            deadline -= 1
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
        conn.request(
            "POST",
            COMP,
            body=json.dumps({"prompt": "x", "max_tokens": 1}),
            headers={"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        error = json.loads(resp.read())["error"]
        assert resp.status == 429 and resp.getheader("Retry-After") == "1"
        assert error["code"] == "queue_full" and "--max-waiting-requests 2" in error["message"]
        conn.close()
        for t in slow:
            t.join(10)
        assert results == [200, 200]  # the admitted ones are served
        _, metrics = srv.request("GET", "/metrics")
        assert f'sovereign:requests_rejected_total{{model_name="{MODEL}",reason="queue_full"}} 1.0' in metrics
    finally:
        srv.close()


def test_the_prestop_drain_hook_authenticates_with_the_api_key(tokenizer: Tokenizer) -> None:
    import os
    import subprocess
    import sys

    from sovereign_operator.render.children import DRAIN_SCRIPT, RUNTIME_PORT
    from sovereign_runtime.server.app import STATE

    srv = _serve(_engine(tokenizer), tokenizer, api_key="secret")
    try:
        script = DRAIN_SCRIPT.replace(f"127.0.0.1:{RUNTIME_PORT}", f"127.0.0.1:{srv.port}")
        env = {**os.environ, "SOVEREIGN_API_KEY": "secret"}
        subprocess.run([sys.executable, "-c", script, "5"], env=env, check=True, timeout=30)
        # Without the key the POST /drain got a silent 401 and the pod was killed undrained.
        assert srv.app[STATE].draining
    finally:
        srv.close()


# ---- per-request deadlines ---------------------------------------------------------------------------


def _slow_server(tokenizer: Tokenizer, **config: Any) -> tuple[LiveServer, FakeEngine]:
    engine = FakeEngine(
        script=tokenizer.encode("a slow answer", add_special_tokens=False),
        eos_token_id=tokenizer.eos_token_id or 0,
        delay_s=0.1,
    )
    return _serve(engine, tokenizer, **config), engine


def test_a_request_past_its_own_deadline_is_aborted_with_a_408(tokenizer: Tokenizer) -> None:
    srv, engine = _slow_server(tokenizer)
    try:
        status, body = srv.request("POST", COMP, _completion(max_tokens=13, request_timeout=0.35))
        error = _assert_error(status, body, 408)
        assert error["code"] == "request_timeout" and "0.35 s" in error["message"]
        assert len(engine.aborted) == 1 and not engine.active  # the engine stopped working on it
        # Within the deadline nothing changes.
        status, body = srv.request("POST", COMP, _completion(max_tokens=2, request_timeout=30))
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"
        # A stream that runs out of time ends with an error event after what it already sent.
        events = srv.stream(CHAT, _chat(max_tokens=13, stream=True, request_timeout=0.35))
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_timeout"
        assert any(e.get("choices") for e in events[:-2] if isinstance(e, dict))
    finally:
        srv.close()


def test_the_server_deadline_caps_what_a_request_asks(tokenizer: Tokenizer) -> None:
    srv, _ = _slow_server(tokenizer, request_timeout_s=0.35)
    try:
        for asked in (None, 100):
            extra = {} if asked is None else {"request_timeout": asked}
            status, body = srv.request("POST", COMP, _completion(max_tokens=13, **extra))
            assert _assert_error(status, body, 408)["code"] == "request_timeout"
    finally:
        srv.close()


@pytest.mark.parametrize("bad", [0, -1, "soon", 10**6, True])
def test_a_bad_request_timeout_is_a_400_naming_it(server: LiveServer, bad: Any) -> None:
    status, body = server.request("POST", COMP, _completion(request_timeout=bad))
    _assert_error(status, body, 400, "request_timeout")
