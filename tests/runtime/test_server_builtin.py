"""`builtin:sovereign-tiny` through the server: held-out questions answered correctly (≥ 95 %), greedy,
with the reasoning trace moved into `reasoning_content`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from server_support import LiveServer
from sovereign_runtime.assembly import EngineOptions, make_loader
from sovereign_runtime.builtin import resolve_builtin
from sovereign_runtime.builtin.tasks import check_answer, make_questions
from sovereign_runtime.server import ServerConfig, create_app
from sovereign_runtime.server.app import STATE

MODEL = "builtin:sovereign-tiny"
QUESTIONS = 200


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    options = EngineOptions(model_path=resolve_builtin(MODEL), device="cpu", max_num_seqs=32)
    srv = LiveServer(create_app(ServerConfig(served_model_name=MODEL), loader=make_loader(options)))
    try:
        deadline = time.monotonic() + 120
        while not srv.app[STATE].ready:
            assert srv.app[STATE].phase != "failed", srv.app[STATE].error
            assert time.monotonic() < deadline, "builtin model did not load"
            time.sleep(0.05)
        yield srv
    finally:
        srv.close()


def _ask(server: LiveServer, prompt: str) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": 64,
    }
    status, resp = server.request("POST", "/v1/chat/completions", body)
    assert status == 200, resp
    return resp["choices"][0]


def test_heldout_accuracy_through_the_server(server: LiveServer) -> None:
    questions = make_questions(QUESTIONS, seed=2026)
    # Concurrent requests: the engine batches them, as in production.
    with ThreadPoolExecutor(max_workers=16) as pool:
        choices = list(pool.map(lambda q: _ask(server, q.prompt), questions))
    correct = sum(
        check_answer(q, c["message"]["content"] or "") for q, c in zip(questions, choices, strict=True)
    )
    assert correct / len(questions) >= 0.95, f"{correct}/{len(questions)} correct"
    # The reasoning parser moved the trace out of the answer.
    with_trace = [c for c in choices if c["message"]["reasoning_content"]]
    assert len(with_trace) >= 0.95 * len(choices)
    assert all("<think>" not in (c["message"]["content"] or "") for c in choices)
    assert all(c["finish_reason"] == "stop" for c in with_trace)


def test_streamed_answer_equals_the_full_one(server: LiveServer) -> None:
    q = make_questions(1, seed=7)[0]
    full = _ask(server, q.prompt)["message"]
    body = {"model": MODEL, "messages": q.messages(), "temperature": 0, "max_tokens": 64, "stream": True}
    events = server.stream("/v1/chat/completions", body)
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == full["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == full["content"]
