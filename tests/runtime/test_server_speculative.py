"""MTP speculative decoding through the server, a prefill/decode pair and the router: the answers are
those of the same model without speculation, token for token, and every surface says what is in force."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from disagg_support import Instance, LiveApp
from safetensors.torch import load_file, save_file
from sovereign_runtime.builtin import resolve_builtin
from sovereign_runtime.builtin.tasks import make_questions
from sovereign_runtime.engine.speculative import SpeculativeConfig
from sovereign_runtime.router.app import Router, RouterConfig
from sovereign_runtime.router.app import create_app as create_router_app

BUILTIN = resolve_builtin("sovereign-tiny")
SPEC = SpeculativeConfig(num_draft_tokens=2, max_batch_size=0)
QUESTIONS = [q.prompt for q in make_questions(4, seed=21)]


@pytest.fixture(scope="module")
def pools() -> Iterator[dict[str, Any]]:
    started: list[Any] = []
    try:
        plain = Instance(BUILTIN, "unified")
        started.append(plain)
        spec = Instance(BUILTIN, "unified", speculative=SPEC)
        started.append(spec)
        prefill = Instance(BUILTIN, "prefill")
        started.append(prefill)
        decode = Instance(BUILTIN, "decode", speculative=SPEC, transfer_timeout_s=20.0)
        started.append(decode)
        router = Router(
            RouterConfig(
                static_members={"prefill": [prefill.url], "decode": [decode.url]},
                health_interval_s=3600,
                disaggregation_threshold_chars=0,  # every request through the pair
            )
        )
        front = LiveApp(create_router_app(router))
        started.append(front)
        front.run(router.check_all())
        yield {"plain": plain, "spec": spec, "prefill": prefill, "decode": decode, "router": front}
    finally:
        for item in reversed(started):
            item.close()


def chat(instance: Any, prompt: str, **extra: Any) -> dict[str, Any]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": 64, **extra}  # fmt: skip
    if isinstance(instance, LiveApp):
        import urllib.request

        req = urllib.request.Request(
            instance.url + "/v1/chat/completions", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=60) as resp:
            return dict(json.loads(resp.read()))
    status, answer = instance.server.request("POST", "/v1/chat/completions", body)
    assert status == 200, answer
    return dict(answer)


def content(answer: dict[str, Any]) -> tuple[str | None, str | None, int]:
    message = answer["choices"][0]["message"]
    return message["content"], message.get("reasoning_content"), answer["usage"]["completion_tokens"]


def test_answers_equal_the_plain_servers_with_usage_saying_what_was_accepted(pools: dict[str, Any]) -> None:
    for prompt in QUESTIONS:
        ref, got = chat(pools["plain"], prompt), chat(pools["spec"], prompt)
        assert content(got) == content(ref), prompt
        assert "speculative_decoding" not in ref["usage"]
        extra = got["usage"]["speculative_decoding"]
        assert extra["verify_steps"] > 0 and extra["accepted_tokens"] <= extra["draft_tokens"]
        assert extra["accept_length"] == pytest.approx(
            1 + extra["accepted_tokens"] / extra["verify_steps"], abs=1e-3
        )


def test_stop_strings_and_max_tokens_cut_mid_draft_as_without_speculation(pools: dict[str, Any]) -> None:
    prompt = QUESTIONS[0]
    full = chat(pools["plain"], prompt)["choices"][0]["message"]["reasoning_content"] or ""
    assert len(full) > 8
    for stop in (full[3:5], full[6:7]):
        ref, got = chat(pools["plain"], prompt, stop=[stop]), chat(pools["spec"], prompt, stop=[stop])
        assert content(got) == content(ref), stop
        assert got["choices"][0]["finish_reason"] == ref["choices"][0]["finish_reason"]
    for n in (1, 2, 3, 5):
        assert content(chat(pools["spec"], prompt, max_tokens=n)) == content(
            chat(pools["plain"], prompt, max_tokens=n)
        )


def test_streamed_answer_and_logprobs_equal_the_plain_servers(pools: dict[str, Any]) -> None:
    body = {"model": "tiny", "prompt": QUESTIONS[1], "temperature": 0, "max_tokens": 40, "stream": True,
            "logprobs": 2, "stream_options": {"include_usage": True}}  # fmt: skip

    def streamed(instance: Instance) -> tuple[str, list[str], int]:
        events = instance.server.stream("/v1/completions", body)
        assert events[-1] == "[DONE]"
        chunks = [e for e in events[:-1] if e["choices"]]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        tokens = [t for c in chunks for t in (c["choices"][0]["logprobs"] or {}).get("tokens", [])]
        return text, tokens, events[-2]["usage"]["completion_tokens"]

    assert streamed(pools["spec"]) == streamed(pools["plain"])


def test_models_and_metrics_say_speculation_is_in_force(pools: dict[str, Any]) -> None:
    _, models = pools["spec"].server.request("GET", "/v1/models")
    card = models["data"][0]["speculative_decoding"]
    assert card == {"enabled": True, "algorithm": "mtp", "num_draft_tokens": 2, "max_batch_size": 0}
    _, plain = pools["plain"].server.request("GET", "/v1/models")
    assert plain["data"][0]["speculative_decoding"] == {"enabled": False}
    chat(pools["spec"], QUESTIONS[2])
    _, text = pools["spec"].server.request("GET", "/metrics")
    values = _metrics(text)
    assert values["sovereign:spec_decode_enabled"] == 1 and values["sovereign:spec_decode_requested"] == 1
    assert values["sovereign:spec_decode_num_draft_tokens"] == 2
    assert values["sovereign:spec_decode_num_accepted_tokens_total"] > 0
    assert 0 < values["sovereign:spec_decode_acceptance_rate"] <= 1
    assert values["sovereign:spec_decode_mean_accept_length"] > 1
    # What the operator reads per pod (its SpeculativeDecoding condition and pool status).
    _, startup = pools["spec"].server.request("GET", "/health/startup")
    report = startup["speculative_decoding"]
    assert report["enabled"] is True and report["num_draft_tokens"] == 2 and report["drafting"] is True
    assert 0 < report["acceptance_rate"] <= 1 and report["accepted_tokens_total"] > 0


def _metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("sovereign:spec_decode") and "{" in line:
            name, rest = line.split("{", 1)
            out[name] = float(rest.rsplit(" ", 1)[1])
    return out


def test_decode_role_and_router_answer_as_the_unified_plain_server(pools: dict[str, Any]) -> None:
    for number, prompt in enumerate(QUESTIONS):
        ref = content(chat(pools["plain"], prompt))
        params = {"prefill_url": pools["prefill"].url, "room": f"specroom{number}"}
        assert content(chat(pools["decode"], prompt, kv_transfer_params=params)) == ref, prompt
        assert content(chat(pools["router"], prompt)) == ref, prompt
    pools["decode"].assert_no_leaks()
    pools["prefill"].assert_no_leaks()
    _, text = pools["decode"].server.request("GET", "/metrics")
    assert _metrics(text)["sovereign:spec_decode_num_drafts_total"] > 0


def test_a_checkpoint_without_mtp_tensors_serves_and_says_why_speculation_is_off(tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(BUILTIN, bare)
    layers = json.loads((bare / "config.json").read_text())["num_hidden_layers"]
    tensors = load_file(str(bare / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if not k.startswith(f"model.layers.{layers}.")},
              str(bare / "model.safetensors"))  # fmt: skip
    instance = Instance(bare, "unified", speculative=SPEC)
    try:
        assert chat(instance, QUESTIONS[0])["choices"][0]["message"]["content"]
        _, models = instance.server.request("GET", "/v1/models")
        card = models["data"][0]["speculative_decoding"]
        assert card["enabled"] is False and "ships no MTP tensors" in card["reason"]
        _, text = instance.server.request("GET", "/metrics")
        values = _metrics(text)
        assert values["sovereign:spec_decode_requested"] == 1 and values["sovereign:spec_decode_enabled"] == 0
        _, startup = instance.server.request("GET", "/health/startup")
        assert (
            startup["speculative_decoding"]["enabled"] is False and startup["speculative_decoding"]["reason"]
        )
    finally:
        instance.close()


def test_inter_token_latency_counts_tokens_not_steps(pools: dict[str, Any]) -> None:
    # The autoscaler's ITL signal: a verify step that returns k tokens counts k gaps, so a pool whose
    # drafts are accepted is not read as one producing fewer, slower tokens.
    def itl_count(instance: Instance) -> float:
        _, text = instance.server.request("GET", "/metrics")
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:inter_token_latency_seconds_count")
        )

    before = {name: itl_count(pools[name]) for name in ("plain", "spec")}
    tokens = {name: 0 for name in before}
    for prompt in QUESTIONS[:2]:
        for name in before:
            tokens[name] += chat(pools[name], prompt)["usage"]["completion_tokens"]
    assert tokens["spec"] == tokens["plain"]
    gaps = {name: itl_count(pools[name]) - before[name] for name in before}
    assert gaps["spec"] == gaps["plain"] == tokens["plain"] - 2  # one gap per token after each first
