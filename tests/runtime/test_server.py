"""HTTP shape of the OpenAI server over a scripted fake engine: endpoints, streaming, errors, auth,
health phases, drain, metrics and aborts on disconnect. End-to-end tests with the real engine live in
test_server_e2e.py."""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_support import FakeEngine, LiveServer, write_byte_tokenizer
from sovereign_runtime.server import LoadedRuntime, ServerConfig, create_app
from sovereign_runtime.server.app import STATE
from sovereign_runtime.server.runner import wait_drained
from sovereign_runtime.tokenizer import Tokenizer

MODEL = "tiny-test"
MAX_LEN = 64
REPLY = "<think>2+2=4</think>\nThe answer is 4 é!"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(write_byte_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture
def engine(tokenizer: Tokenizer) -> FakeEngine:
    assert tokenizer.eos_token_id is not None
    return FakeEngine(
        script=tokenizer.encode(REPLY, add_special_tokens=False), eos_token_id=tokenizer.eos_token_id
    )


def _serve(engine: FakeEngine, tokenizer: Tokenizer, **config: Any) -> LiveServer:
    rt = LoadedRuntime(engine=engine, tokenizer=tokenizer, max_model_len=MAX_LEN)
    return LiveServer(create_app(ServerConfig(served_model_name=MODEL, **config), runtime=rt))


@pytest.fixture
def server(engine: FakeEngine, tokenizer: Tokenizer) -> Iterator[LiveServer]:
    srv = _serve(engine, tokenizer)
    yield srv
    srv.close()


def _wait(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "What is 2+2?"}], **extra}


# ---- endpoints ---------------------------------------------------------------------------------------


def test_models_lists_the_served_model(server: LiveServer) -> None:
    status, body = server.request("GET", "/v1/models")
    assert status == 200
    assert [m["id"] for m in body["data"]] == [MODEL]
    assert body["data"][0]["max_model_len"] == MAX_LEN


def test_chat_completion_splits_reasoning_and_reports_usage(
    server: LiveServer, engine: FakeEngine, tokenizer: Tokenizer
) -> None:
    engine.cached_tokens = 3
    status, body = server.request("POST", "/v1/chat/completions", chat_body())
    assert status == 200, body
    choice = body["choices"][0]
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert choice["message"] == {
        "role": "assistant",
        "content": "The answer is 4 é!",
        "reasoning_content": "2+2=4",
    }
    assert choice["finish_reason"] == "stop"
    _, prompt_ids = tokenizer.encode_chat(chat_body()["messages"])
    assert engine.seen_prompts == [prompt_ids]
    completion = len(tokenizer.encode(REPLY, add_special_tokens=False)) + 1  # + EOS
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": completion,
        "total_tokens": len(prompt_ids) + completion,
        "prompt_tokens_details": {"cached_tokens": 3},
    }
    # Without max_tokens the budget is the rest of the context.
    assert engine.seen_params[0].max_tokens == MAX_LEN - len(prompt_ids)


def test_chat_length_finish(server: LiveServer) -> None:
    status, body = server.request("POST", "/v1/chat/completions", chat_body(max_tokens=4))
    assert status == 200
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"]["reasoning_content"] == "2+2"
    assert body["choices"][0]["message"]["content"] == ""
    assert body["usage"]["completion_tokens"] == 4


def test_chat_stream_with_usage(server: LiveServer) -> None:
    events = server.stream(
        "/v1/chat/completions", chat_body(stream=True, stream_options={"include_usage": True})
    )
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "2+2=4"
    assert "".join(d.get("content") or "" for d in deltas) == "The answer is 4 é!"
    assert all("\ufffd" not in (d.get("content") or "") for d in deltas)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "stop" and all(f is None for f in finishes[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert all(c["usage"] is None for c in chunks[:-1])


def test_chat_stream_without_usage_has_no_usage_chunk(server: LiveServer) -> None:
    events = server.stream("/v1/chat/completions", chat_body(stream=True))
    assert events[-1] == "[DONE]"
    assert all(e["choices"] for e in events[:-1])
    assert all("usage" not in e for e in events[:-1])


@pytest.mark.parametrize(
    "prompt",
    ["Hello", [72, 105], ["Hello", "Hi"], [[72, 105], [72]]],
    ids=["text", "ids", "texts", "id-lists"],
)
def test_completions_accept_every_prompt_form(
    server: LiveServer, engine: FakeEngine, tokenizer: Tokenizer, prompt: Any
) -> None:
    status, body = server.request(
        "POST", "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 7}
    )
    assert status == 200, body
    n = len(prompt) if isinstance(prompt[0], str | list) and not isinstance(prompt, str) else 1
    assert [c["index"] for c in body["choices"]] == list(range(n))
    for c in body["choices"]:
        assert c["text"] == tokenizer.decode(engine.script[:7]) == "<think>2+2=4</think>"
        assert c["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 7 * n
    if prompt == [72, 105]:
        assert engine.seen_prompts == [[72, 105]]


def test_completions_default_max_tokens_is_16(server: LiveServer, engine: FakeEngine) -> None:
    status, _body = server.request("POST", "/v1/completions", {"prompt": "x"})
    assert status == 200
    assert engine.seen_params[0].max_tokens == 16


def test_completions_stream_multiple_prompts(
    server: LiveServer, engine: FakeEngine, tokenizer: Tokenizer
) -> None:
    body = {
        "model": MODEL,
        "prompt": ["a", "b"],
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = server.stream("/v1/completions", body)
    assert events[-1] == "[DONE]"
    texts: dict[int, str] = {0: "", 1: ""}
    for e in events[:-2]:
        for c in e["choices"]:
            texts[c["index"]] += c["text"]
    expected = tokenizer.decode(engine.script[:5])
    assert texts == {0: expected, 1: expected}
    assert events[-2]["usage"]["completion_tokens"] == 10


def test_stop_string_trims_output_and_aborts(server: LiveServer, engine: FakeEngine) -> None:
    status, body = server.request(
        "POST", "/v1/completions", {"prompt": "x", "max_tokens": 40, "stop": ["answer"]}
    )
    assert status == 200
    assert body["choices"][0]["text"] == "<think>2+2=4</think>\nThe "
    assert body["choices"][0]["finish_reason"] == "stop"
    _wait(lambda: len(engine.aborted) == 1)
    assert not engine.active


def test_stop_string_in_stream(server: LiveServer) -> None:
    events = server.stream("/v1/chat/completions", chat_body(stream=True, stop="is 4"))
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert content == "The answer "
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_sampling_parameters_reach_the_engine(server: LiveServer, engine: FakeEngine) -> None:
    status, _ = server.request(
        "POST",
        "/v1/chat/completions",
        chat_body(
            temperature=0.5,
            top_p=0.9,
            top_k=5,
            max_completion_tokens=9,
            seed=123,
            stop_token_ids=[3, 4],
            ignore_eos=True,
        ),
    )
    assert status == 200
    p = engine.seen_params[0]
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.seed) == (0.5, 0.9, 5, 9, 123)
    assert (p.stop_token_ids, p.ignore_eos, p.logprobs) == ([3, 4], True, None)


def test_chat_logprobs(server: LiveServer, engine: FakeEngine) -> None:
    status, body = server.request(
        "POST", "/v1/chat/completions", chat_body(max_tokens=3, logprobs=True, top_logprobs=2)
    )
    assert status == 200
    assert engine.seen_params[0].logprobs == 2
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == [-0.5, -0.5, -0.5]
    assert [len(c["top_logprobs"]) for c in content] == [2, 2, 2]
    assert content[0]["token"] == "<think>"


def test_completion_logprobs(server: LiveServer, engine: FakeEngine) -> None:
    status, body = server.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2, "logprobs": 1})
    assert status == 200
    lp = body["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [-0.5, -0.5] and len(lp["top_logprobs"]) == 2 and lp["text_offset"][0] == 0


def test_completion_return_token_ids(server: LiveServer, engine: FakeEngine) -> None:
    body = {"prompt": [[5, 6, 7], [8]], "max_tokens": 4, "return_token_ids": True}
    status, full = server.request("POST", "/v1/completions", body)
    assert status == 200
    script = engine.script[:4]
    assert [(c["prompt_token_ids"], c["token_ids"]) for c in full["choices"]] == [
        ([5, 6, 7], script),
        ([8], script),
    ]
    events = server.stream("/v1/completions", {**body, "prompt": [5, 6, 7], "stream": True})
    chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
    assert chunks[0]["prompt_token_ids"] == [5, 6, 7]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == script
    status, plain = server.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert "token_ids" not in plain["choices"][0]
    status, _ = server.request("POST", "/v1/completions", {**body, "return_token_ids": "yes"})
    assert status == 400


# ---- errors ------------------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        (CHAT, chat_body(max_tokens=-1), 400, "max_tokens"),
        (CHAT, chat_body(max_tokens=0), 400, "max_tokens"),
        (CHAT, chat_body(max_tokens=10**9), 400, "max_tokens"),
        (CHAT, chat_body(max_completion_tokens=-5), 400, "max_completion_tokens"),
        (CHAT, chat_body(max_tokens="ten"), 400, "max_tokens"),
        (CHAT, chat_body(temperature=2.5), 400, "temperature"),
        (CHAT, chat_body(temperature=-0.1), 400, "temperature"),
        (CHAT, chat_body(temperature="hot"), 400, "temperature"),
        (CHAT, chat_body(top_p=0), 400, "top_p"),
        (CHAT, chat_body(top_p=1.5), 400, "top_p"),
        (CHAT, chat_body(top_k=-3), 400, "top_k"),
        (CHAT, chat_body(seed="x"), 400, "seed"),
        (CHAT, chat_body(stop=5), 400, "stop"),
        (CHAT, chat_body(stream="yes"), 400, "stream"),
        (CHAT, chat_body(n=17), 400, "n"),
        (CHAT, chat_body(n=0), 400, "n"),
        (COMP, {"prompt": ["a"] * 9, "n": 8}, 400, "n"),
        (CHAT, chat_body(top_logprobs=3), 400, "top_logprobs"),
        (CHAT, chat_body(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
        (CHAT, chat_body(stream_options={"include_usage": True}), 400, "stream_options"),
        (CHAT, chat_body(max_tokens=MAX_LEN - 5), 400, "max_tokens"),  # prompt + max_tokens > context
        (CHAT, chat_body(max_completion_tokens=MAX_LEN - 5), 400, "max_completion_tokens"),
        (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x" * 200}]}, 400, "messages"),
        (CHAT, {"model": MODEL}, 400, "messages"),
        (CHAT, {"model": MODEL, "messages": []}, 400, "messages"),
        (CHAT, {"model": MODEL, "messages": "hi"}, 400, "messages"),
        (CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
        (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
        (
            CHAT,
            {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]},
            400,
            "messages",
        ),  # template raises
        (CHAT, chat_body(model="other-model"), 404, "model"),
        (CHAT, chat_body(model=7), 400, "model"),
        (COMP, {"model": MODEL}, 400, "prompt"),
        (COMP, {"prompt": 5}, 400, "prompt"),
        (COMP, {"prompt": [1, "a"]}, 400, "prompt"),
        (COMP, {"prompt": [10**6]}, 400, "prompt"),
        (COMP, {"prompt": "y" * 100}, 400, "prompt"),
        (COMP, {"prompt": "x", "max_tokens": 1.5}, 400, "max_tokens"),
        (COMP, {"prompt": "x", "logprobs": 99}, 400, "logprobs"),
        (COMP, {"prompt": "x", "echo": True}, 400, "echo"),
        (COMP, {"prompt": "x", "model": "nope"}, 404, "model"),
    ],
)
def test_bad_requests_get_openai_errors_naming_the_parameter(
    server: LiveServer, path: str, body: dict[str, Any], status: int, param: str
) -> None:
    got, err = server.request("POST", path, body)
    assert got == status, err
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["param"] == param
    assert err["error"]["message"]
    # The server keeps serving.
    ok, _ = server.request("POST", COMP, {"prompt": "x", "max_tokens": 2})
    assert ok == 200


@pytest.mark.parametrize(
    ("path", "body", "param", "rule"),
    [
        (CHAT, chat_body(logprobs=True, top_logprobs=50), "top_logprobs", "must be in [0, 20], got 50"),
        (CHAT, chat_body(max_completion_tokens=0), "max_completion_tokens", "must be in [1, "),
        (COMP, {"prompt": "x", "temperature": 2.5}, "temperature", "must be in [0, 2], got 2.5"),
        (COMP, {"prompt": "x", "seed": -1}, "seed", "must be in [0, 2**63), got -1"),
    ],
)
def test_engine_bounds_reach_the_client_in_its_own_parameter_names(
    server: LiveServer, path: str, body: dict[str, Any], param: str, rule: str
) -> None:
    """SamplingParams owns the bounds; the server names the parameter the client sent, not the engine's."""
    status, err = server.request("POST", path, body)
    assert status == 400 and err["error"]["param"] == param and err["error"]["code"] == "invalid_value"
    assert err["error"]["message"].startswith(f"'{param}' {rule}")


def test_the_server_imports_the_engine_contract_without_torch() -> None:
    code = "import sys, sovereign_runtime.server; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_malformed_json_and_non_object_body(server: LiveServer) -> None:
    status, err = server.request("POST", CHAT, raw=b"{not json")
    assert status == 400 and err["error"]["code"] == "invalid_json"
    status, err = server.request("POST", COMP, body=[1, 2])
    assert status == 400 and err["error"]["type"] == "invalid_request_error"


def test_unknown_route_is_a_json_404(server: LiveServer) -> None:
    status, err = server.request("GET", "/v1/nothing")
    assert status == 404 and "error" in err
    status, err = server.request("GET", CHAT)
    assert status == 405 and "error" in err


def test_api_key(engine: FakeEngine, tokenizer: Tokenizer) -> None:
    srv = _serve(engine, tokenizer, api_key="s3cret")
    try:
        status, err = srv.request("GET", "/v1/models")
        assert status == 401 and err["error"]["code"] == "invalid_api_key"
        status, _ = srv.request("POST", COMP, {"prompt": "x"}, headers={"Authorization": "Bearer wrong"})
        assert status == 401
        status, _ = srv.request("POST", COMP, {"prompt": "x"}, headers={"Authorization": "Bearer s3cret"})
        assert status == 200
        status, _ = srv.request("POST", "/drain")
        assert status == 401
        # Probes and scrapes stay open.
        assert srv.request("GET", "/health")[0] == 200
        assert srv.request("GET", "/health/ready")[0] == 200
        assert srv.request("GET", "/metrics")[0] == 200
    finally:
        srv.close()


# ---- health phases, drain ----------------------------------------------------------------------------


def test_startup_phases_while_loading(engine: FakeEngine, tokenizer: Tokenizer) -> None:
    release = threading.Event()

    def loader(progress: Callable[[str, float, str], None]) -> LoadedRuntime:
        progress("loading_weights", 0.5, "shard 1/2")
        assert release.wait(30)
        return LoadedRuntime(engine=engine, tokenizer=tokenizer, max_model_len=MAX_LEN)

    srv = LiveServer(create_app(ServerConfig(served_model_name=MODEL), loader=loader))
    try:
        _wait(lambda: srv.request("GET", "/health/startup")[1].get("progress") == 0.5)
        status, body = srv.request("GET", "/health/startup")
        assert status == 503 and body["phase"] == "loading_weights" and body["detail"] == "shard 1/2"
        assert srv.request("GET", "/health")[0] == 200
        assert srv.request("GET", "/health/ready")[0] == 503
        status, err = srv.request("POST", COMP, {"prompt": "x"})
        assert status == 503 and "not ready" in err["error"]["message"]
        _, metrics = srv.request("GET", "/metrics")
        assert 'sovereign:startup_phase{model_name="tiny-test",phase="loading_weights"} 1.0' in metrics
        release.set()
        _wait(lambda: srv.request("GET", "/health/startup")[0] == 200)
        assert srv.request("GET", "/health/startup")[1]["phase"] == "ready"
        assert srv.request("GET", "/health/ready")[0] == 200
        # Warm-up ran real requests through the engine before ready.
        assert len(engine.finished) == 3
        assert srv.request("POST", COMP, {"prompt": "x"})[0] == 200
    finally:
        release.set()
        srv.close()


def test_debug_hold_keeps_startup_in_compiling_with_rising_progress(
    engine: FakeEngine, tokenizer: Tokenizer
) -> None:
    rt = LoadedRuntime(engine=engine, tokenizer=tokenizer, max_model_len=MAX_LEN)
    config = ServerConfig(served_model_name=MODEL, debug_hold_compiling_s=1.0)
    srv = LiveServer(create_app(config, loader=lambda progress: rt))
    try:
        _wait(lambda: srv.request("GET", "/health/startup")[1]["phase"] == "compiling")
        status, first = srv.request("GET", "/health/startup")
        assert status == 503 and first["detail"] == "held by --debug-hold-compiling-s (test only)"
        assert srv.request("GET", "/health/ready")[0] == 503
        time.sleep(0.4)
        _, later = srv.request("GET", "/health/startup")
        assert later["phase"] == "ready" or later["progress"] > first["progress"]
        _wait(lambda: srv.request("GET", "/health/startup")[0] == 200)
        assert srv.request("GET", "/health/ready")[0] == 200
    finally:
        srv.close()


def test_a_cached_hold_is_short_once_a_completed_hold_marked_the_jit_cache(
    engine: FakeEngine, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """--debug-hold-compiling-cached-s: the first start compiles (holds the full time) and leaves its mark
    in the JIT cache; a later start on the same cache holds the cached time (a warm cache)."""
    rt = LoadedRuntime(engine=engine, tokenizer=tokenizer, max_model_len=MAX_LEN)
    config = ServerConfig(
        served_model_name=MODEL,
        debug_hold_compiling_s=1.0,
        debug_hold_cached_s=0.0,
        debug_hold_cache_dir=str(tmp_path / "triton"),
    )
    compiled: list[float] = []
    for _ in range(2):
        srv = LiveServer(create_app(config, loader=lambda progress: rt))
        try:
            _wait(lambda srv=srv: srv.request("GET", "/health/startup")[0] == 200)  # type: ignore[misc]
            compiled.append(srv.request("GET", "/health/startup")[1]["phase_seconds"]["compiling"])
        finally:
            srv.close()
    assert compiled[0] >= 1.0 > compiled[1]
    assert json.loads((tmp_path / "triton" / "sovereign-debug-hold.json").read_text()) == {"held_s": 1.0}


def test_failed_load_reports_failed_phase(tokenizer: Tokenizer) -> None:
    def loader(progress: Callable[[str, float, str], None]) -> LoadedRuntime:
        raise RuntimeError("weights corrupt")

    srv = LiveServer(create_app(ServerConfig(served_model_name=MODEL), loader=loader))
    try:
        _wait(lambda: srv.request("GET", "/health/startup")[1]["phase"] == "failed")
        status, body = srv.request("GET", "/health/startup")
        assert status == 503 and "weights corrupt" in body["error"]
    finally:
        srv.close()


def test_drain_finishes_in_flight_and_refuses_new(
    engine: FakeEngine, tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sovereign_runtime.server")
    engine.delay_s = 0.02
    srv = _serve(engine, tokenizer)
    try:
        result: dict[str, Any] = {}
        t = threading.Thread(
            target=lambda: result.update(r=srv.request("POST", COMP, {"prompt": "x", "max_tokens": 20}))
        )
        t.start()
        _wait(lambda: len(engine.active) == 1)
        status, body = srv.request("POST", "/drain")
        assert status == 202 and body["in_flight"] == 1
        status, body = srv.request("GET", "/health/ready")
        assert status == 503 and body["status"] == "draining"
        status, err = srv.request("POST", COMP, {"prompt": "x"})
        assert status == 503 and "draining" in err["error"]["message"]
        t.join(10)
        assert result["r"][0] == 200 and result["r"][1]["choices"][0]["finish_reason"] == "length"
        _wait(srv.app[STATE].drained.is_set)
        assert srv.run(wait_drained(srv.app)) is True
    finally:
        srv.close()
    # What `kubectl logs` shows of a scale-down: the drain's cause, in-flight count and duration.
    lines = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("drain started (POST /drain): 1 request(s) in flight") for m in lines), lines
    assert any(
        m.startswith("drain finished in ") and m.endswith("all 1 in-flight request(s) completed")
        for m in lines
    ), lines


# ---- metrics -----------------------------------------------------------------------------------------

CONTRACT_METRICS = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "sovereign:prefix_cache_hit_rate": "gauge",
    "sovereign:prompt_tokens_waiting": "gauge",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "sovereign:startup_phase": "gauge",
}


def _scrape(server: LiveServer) -> dict[str, Any]:
    status, text = server.request("GET", "/metrics")
    assert status == 200
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(families: dict[str, Any], sample_name: str, **labels: str) -> float:
    for fam in families.values():
        for s in fam.samples:
            if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(sample_name)


def test_metrics_use_contract_names_and_count(server: LiveServer) -> None:
    status, _body = server.request("POST", COMP, {"prompt": "abc", "max_tokens": 5})
    assert status == 200
    fams = _scrape(server)
    assert {name: fams[name].type for name in CONTRACT_METRICS} == CONTRACT_METRICS
    assert _value(fams, "vllm:prompt_tokens_total", model_name=MODEL) == 3
    assert _value(fams, "vllm:generation_tokens_total") == 5
    assert _value(fams, "vllm:request_success_total", finished_reason="length") == 1
    assert _value(fams, "vllm:request_success_total", finished_reason="stop") == 0
    assert _value(fams, "vllm:time_to_first_token_seconds_count") == 1
    assert _value(fams, "vllm:inter_token_latency_seconds_count") == 4
    assert _value(fams, "vllm:e2e_request_latency_seconds_count") == 1
    assert _value(fams, "sovereign:prefix_cache_hit_rate") == pytest.approx(0.4)
    assert _value(fams, "vllm:prefix_cache_hits_total") == 4
    assert _value(fams, "sovereign:startup_phase", phase="ready") == 1
    assert _value(fams, "vllm:num_requests_running") == 0


# ---- disconnects ------------------------------------------------------------------------------------


def _open_and_drop(port: int, path: str, body: dict[str, Any], read_first: bool) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    if read_first:
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.read(6) == b"data: "  # the first event arrived: the request is running
    else:
        time.sleep(0.2)
    conn.sock.close() if conn.sock else None
    conn.close()


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_the_request(engine: FakeEngine, tokenizer: Tokenizer, stream: bool) -> None:
    engine.delay_s = 0.05
    srv = _serve(engine, tokenizer)
    try:
        _open_and_drop(srv.port, COMP, {"prompt": "x", "max_tokens": 60, "stream": stream}, read_first=stream)
        _wait(lambda: len(engine.aborted) == 1, timeout=3.0)
        assert not engine.active and not engine.finished
        fams = _scrape(srv)
        assert _value(fams, "vllm:request_success_total", finished_reason="abort") == 1
        # The server is still healthy and serves the next request.
        assert srv.request("POST", COMP, {"prompt": "x", "max_tokens": 2})[0] == 200
    finally:
        srv.close()


def test_create_app_needs_exactly_one_source(engine: FakeEngine, tokenizer: Tokenizer) -> None:
    # create_app refuses an ambiguous setup rather than guessing.
    with pytest.raises(ValueError):
        create_app(ServerConfig(served_model_name=MODEL))
    rt = LoadedRuntime(engine=engine, tokenizer=tokenizer, max_model_len=MAX_LEN)
    with pytest.raises(ValueError):
        create_app(ServerConfig(served_model_name=MODEL), runtime=rt, loader=lambda progress: rt)


def test_drain_is_bounded_by_the_timeout(engine: FakeEngine, tokenizer: Tokenizer) -> None:
    engine.delay_s = 0.5  # a request that would take 30 s
    srv = _serve(engine, tokenizer, drain_timeout_s=0.3)
    try:

        def doomed() -> None:
            # The server closes this connection when it gives up waiting.
            with contextlib.suppress(ConnectionError):
                srv.request("POST", COMP, {"prompt": "x", "max_tokens": 60})

        t = threading.Thread(target=doomed, daemon=True)
        t.start()
        _wait(lambda: len(engine.active) == 1)
        assert srv.request("POST", "/drain")[0] == 202
        started = time.monotonic()
        assert srv.run(wait_drained(srv.app)) is False
        assert 0.2 <= time.monotonic() - started < 2.0
    finally:
        srv.close()
    # Shutting the server down cancelled the handler, which aborted the request in the engine.
    _wait(lambda: len(engine.aborted) == 1 and not engine.active)


# ---- n: several choices per prompt ------------------------------------------------------------------


def test_chat_n_choices_are_separate_requests_and_usage_counts_the_prompt_once(
    server: LiveServer, engine: FakeEngine
) -> None:
    status, body = server.request("POST", "/v1/chat/completions", chat_body(n=3, seed=5))
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == "The answer is 4 é!" for c in body["choices"])
    # Seeded: each choice its own seed, counting up, so they differ and each is reproducible.
    assert [p.seed for p in engine.seen_params] == [5, 6, 7]
    assert len(engine.seen_prompts) == 3 and len({tuple(p) for p in engine.seen_prompts}) == 1
    prompt = len(engine.seen_prompts[0])
    one = len(engine.script) + 1
    assert body["usage"]["prompt_tokens"] == prompt
    assert body["usage"]["completion_tokens"] == 3 * one
    assert not engine.active  # all three ended


def test_chat_n_streams_every_choice_by_index(server: LiveServer) -> None:
    events = server.stream(
        "/v1/chat/completions", chat_body(n=2, stream=True, stream_options={"include_usage": True})
    )
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant"
        assert "".join(c["delta"].get("content") or "" for c in mine) == "The answer is 4 é!"
        assert "".join(c["delta"].get("reasoning_content") or "" for c in mine) == "2+2=4"
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["stop"]
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == 2 * (usage["completion_tokens"] // 2) > 0


def test_completion_n_choices_follow_their_prompts(server: LiveServer, engine: FakeEngine) -> None:
    status, body = server.request(
        "POST", "/v1/completions", {"prompt": ["ab", "xyz"], "n": 2, "max_tokens": 3}
    )
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    # Choice index = prompt index x n + j: the first two answer "ab", the next two "xyz".
    assert [len(p) for p in engine.seen_prompts] == [2, 2, 3, 3]
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 12
    events = server.stream(
        "/v1/completions", {"prompt": ["ab", "xyz"], "n": 2, "max_tokens": 3, "stream": True}
    )
    finishes = sorted(e["choices"][0]["index"] for e in events[:-1] if e["choices"][0]["finish_reason"])
    assert finishes == [0, 1, 2, 3]


# ---- /tokenize and /detokenize -------------------------------------------------------------------------


def test_tokenize_and_detokenize_round_trip(server: LiveServer, tokenizer: Tokenizer) -> None:
    status, body = server.request("POST", "/tokenize", {"model": MODEL, "prompt": "héllo"})
    assert status == 200, body
    assert body["tokens"] == tokenizer.encode("héllo") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == MAX_LEN
    status, back = server.request("POST", "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back == {"prompt": "héllo"}
    # A chat is rendered by the template exactly as /v1/chat/completions renders it.
    status, body = server.request("POST", "/tokenize", {"messages": chat_body()["messages"]})
    assert status == 200 and body["tokens"] == tokenizer.encode_chat(chat_body()["messages"])[1]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "b"}]}, "messages[0].role"),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
    ],
)
def test_tokenize_errors_name_the_field(
    server: LiveServer, path: str, body: dict[str, Any], param: str
) -> None:
    status, answer = server.request("POST", path, body)
    assert status in (400, 404) and answer["error"]["param"] == param, answer


def test_tokenize_needs_the_api_key(engine: FakeEngine, tokenizer: Tokenizer) -> None:
    srv = _serve(engine, tokenizer, api_key="k")
    try:
        assert srv.request("POST", "/tokenize", {"prompt": "a"})[0] == 401
        assert srv.request("POST", "/detokenize", {"tokens": [1]})[0] == 401
        ok = srv.request("POST", "/tokenize", {"prompt": "a"}, headers={"Authorization": "Bearer k"})
        assert ok[0] == 200
    finally:
        srv.close()
