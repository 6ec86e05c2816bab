"""Prefill/decode disaggregation end to end: router + one prefill + two decode instances (in-process,
127.0.0.1) on a tiny random checkpoint, against a unified instance of the same weights."""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import web
from disagg_support import MODEL, Instance, LiveApp
from server_support import byte_tokenizer_checkpoint, free_port
from sovereign_runtime.disagg.transport import TcpKVSender
from sovereign_runtime.router.app import Router, RouterConfig
from sovereign_runtime.router.app import create_app as create_router_app
from tokenizers import pre_tokenizers

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def checkpoint(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    return byte_tokenizer_checkpoint(tiny_checkpoint_factory, tmp_path_factory.mktemp("pd") / "ckpt")


@pytest.fixture(scope="module")
def cluster(checkpoint: Path) -> Iterator[dict[str, Any]]:
    started: list[Any] = []
    try:
        unified = Instance(checkpoint, "unified")
        started.append(unified)
        prefill = Instance(checkpoint, "prefill")
        started.append(prefill)
        decodes = [Instance(checkpoint, "decode", transfer_timeout_s=20.0) for _ in range(2)]
        started += decodes
        router = Router(
            RouterConfig(
                static_members={"prefill": [prefill.url], "decode": [d.url for d in decodes]},
                health_interval_s=3600,
                disaggregation_threshold_chars=0,  # every request goes through a pair
            )
        )
        front = LiveApp(create_router_app(router))
        started.append(front)
        front.run(router.check_all())
        yield {"unified": unified, "prefill": prefill, "decodes": decodes, "router": front}
    finally:
        for item in reversed(started):
            item.close()


def post(url: str, body: dict[str, Any], timeout: float = 60.0) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def completion(base: str, prompt: str, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    status, answer = post(base + "/v1/completions", body)
    assert status == 200, answer
    return answer


PROMPTS = [f"request {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 3) for i in range(6)]


def test_router_pairs_give_the_unified_greedy_outputs_for_concurrent_requests(
    cluster: dict[str, Any],
) -> None:
    unified, prefill, decodes, router = (
        cluster["unified"],
        cluster["prefill"],
        cluster["decodes"],
        cluster["router"],
    )
    expected = [completion(unified.url, p, ignore_eos=True)["choices"][0]["text"] for p in PROMPTS]
    before = [d.kv_health()["tokens"] for d in decodes]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: completion(router.url, p, ignore_eos=True), PROMPTS))
    assert [a["choices"][0]["text"] for a in answers] == expected
    assert all(a["usage"]["completion_tokens"] == 8 for a in answers)
    # The KV really travelled: every prompt token (less cached pages) reached a decode instance.
    received = sum(d.kv_health()["tokens"] - b for d, b in zip(decodes, before, strict=True))
    cached = sum(a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers)
    assert received == sum(a["usage"]["prompt_tokens"] for a in answers) - cached > 0
    assert all(d.kv_health()["fallbacks"] == 0 and d.kv_health()["healthy"] for d in decodes)
    assert prefill.kv_health()["transfers_ok"] >= len(PROMPTS)
    for instance in (prefill, *decodes):
        instance.assert_no_leaks()


def test_streamed_answer_and_first_token_logprob_match_unified(cluster: dict[str, Any]) -> None:
    unified, prefill, decode = cluster["unified"], cluster["prefill"], cluster["decodes"][0]
    prompt = "stream me the latent cache " * 3
    params = {"prefill_url": prefill.url, "room": "streamroom1"}
    want = completion(unified.url, prompt, max_tokens=5, logprobs=2, ignore_eos=True)["choices"][0]
    events = decode.server.stream(
        "/v1/completions",
        {"model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0, "stream": True, "logprobs": 2,
         "ignore_eos": True, "kv_transfer_params": params},
    )  # fmt: skip
    chunks = [e for e in events if e != "[DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == want["text"]
    got_lp = [
        lp
        for c in chunks
        if c["choices"][0]["logprobs"]
        for lp in c["choices"][0]["logprobs"]["token_logprobs"]
    ]
    assert got_lp == pytest.approx(want["logprobs"]["token_logprobs"], abs=1e-4)
    decode.assert_no_leaks()


def test_prefix_cached_on_the_decode_is_not_sent_again(cluster: dict[str, Any]) -> None:
    unified, prefill, decode = cluster["unified"], cluster["prefill"], cluster["decodes"][1]
    base = "a long shared system prompt that the decode instance will keep in its radix cache. " * 2
    first = base + "question one?"
    second = base + "question two, somewhat longer?"
    h0 = decode.kv_health()["tokens"]
    a = completion(decode.url, first, kv_transfer_params={"prefill_url": prefill.url, "room": "prefixroom1"})
    h1 = decode.kv_health()["tokens"]
    b = completion(decode.url, second, kv_transfer_params={"prefill_url": prefill.url, "room": "prefixroom2"})
    h2 = decode.kv_health()["tokens"]
    cached = b["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 16 * (len(base) // 16) - 16 > 0  # whole shared pages came from the decode's cache
    assert h1 - h0 == a["usage"]["prompt_tokens"] - a["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert h2 - h1 == b["usage"]["prompt_tokens"] - cached  # only the uncached tail travelled
    assert b["choices"][0]["text"] == completion(unified.url, second)["choices"][0]["text"]
    decode.assert_no_leaks()


def test_unreachable_prefill_falls_back_to_local_prefill(cluster: dict[str, Any]) -> None:
    unified, decode = cluster["unified"], cluster["decodes"][0]
    dead = f"http://127.0.0.1:{free_port()}"
    before = decode.kv_health()["fallbacks"]
    started = time.monotonic()
    answer = completion(
        decode.url, "nobody prefills this " * 3, kv_transfer_params={"prefill_url": dead, "room": "deadroom1"}
    )
    assert time.monotonic() - started < 15
    assert (
        answer["choices"][0]["text"]
        == completion(unified.url, "nobody prefills this " * 3)["choices"][0]["text"]
    )
    health = decode.kv_health()
    assert health["fallbacks"] == before + 1 and "failed" in health["last_error"]
    assert not health["healthy"]  # a recent failure and no success since: the operator sees it
    status, metrics = decode.server.request("GET", "/metrics")
    assert status == 200 and "sovereign:kv_transfer_fallbacks_total" in metrics
    decode.assert_no_leaks()


def _fake_prefill(behaviour: Callable[[dict[str, Any]], Any]) -> LiveApp:
    """A prefill endpoint that misbehaves on purpose with the ticket it is given."""

    async def handler(request: web.Request) -> web.Response:
        body = await request.json()
        await asyncio.to_thread(behaviour, body)
        return web.json_response({"error": {"message": "gave up"}}, status=502)

    app = web.Application()
    app.router.add_post("/v1/internal/prefill", handler)
    return LiveApp(app)


def _dies_mid_transfer(body: dict[str, Any]) -> None:
    stream = TcpKVSender().open(body["ticket"])
    stream.send_layer(0, 0, torch.zeros(1, 64))  # wrong width: then the connection drops
    time.sleep(0.2)
    stream._close()


def _stalls_with_heartbeats(body: dict[str, Any]) -> None:
    stream = TcpKVSender(heartbeat_interval_s=0.2).open(body["ticket"])
    time.sleep(4.0)  # alive (heartbeats) but never finishes: only the total timeout ends it
    stream.fail("too late")


@pytest.mark.parametrize(
    "behaviour", [_dies_mid_transfer, _stalls_with_heartbeats], ids=["killed", "timeout"]
)
def test_prefill_dying_or_stalling_mid_transfer_falls_back_without_leaks(
    checkpoint: Path, cluster: dict[str, Any], behaviour: Callable[[dict[str, Any]], Any]
) -> None:
    unified = cluster["unified"]
    fake = _fake_prefill(behaviour)
    decode = Instance(checkpoint, "decode", transfer_timeout_s=2.0, idle_timeout_s=1.0)
    try:
        prompt = "this prefill will not finish its job " * 2
        started = time.monotonic()
        answer = completion(
            decode.url, prompt, kv_transfer_params={"prefill_url": fake.url, "room": "badroom1"}
        )
        assert time.monotonic() - started < 10
        assert answer["choices"][0]["text"] == completion(unified.url, prompt)["choices"][0]["text"]
        assert decode.kv_health()["fallbacks"] == 1
        decode.assert_no_leaks()
    finally:
        decode.close()
        fake.close()


def test_decode_dying_mid_transfer_fails_the_prefill_cleanly(cluster: dict[str, Any]) -> None:
    """The decode's receiver accepts and then vanishes: the prefill answers an error, frees its blocks."""
    import socket
    import threading

    prefill = cluster["prefill"]
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def accept_and_die() -> None:
        conn, _ = listener.accept()
        conn.recv(64)
        conn.close()
        listener.close()

    threading.Thread(target=accept_and_die, daemon=True).start()
    failed_before = prefill.kv_health()["transfers_failed"]
    started = time.monotonic()
    status, body = post(
        prefill.url + "/v1/internal/prefill",
        {
            "room": "deaddecode1",
            "ticket": {"transport": "tcp", "address": f"127.0.0.1:{port}", "room": "deaddecode1"},
            "prompt_token_ids": list(range(40, 140)),
            "num_cached_tokens": 0,
            "sampling": {"temperature": 0.0},
        },
    )
    assert status == 502 and "deaddecode1" in body["error"]["message"]
    assert time.monotonic() - started < 15
    assert prefill.kv_health()["transfers_failed"] == failed_before + 1
    prefill.assert_no_leaks()


def test_prefill_endpoint_rejects_bad_requests(cluster: dict[str, Any]) -> None:
    prefill = cluster["prefill"]
    status, body = post(prefill.url + "/v1/internal/prefill", {"room": "x", "prompt_token_ids": []})
    assert status == 400 and "bad prefill request" in body["error"]["message"]


def test_rdma_transport_through_nixl_over_ucx_tcp(checkpoint: Path, cluster: dict[str, Any]) -> None:
    """`--kv-transport rdma`: NIXL agents on both sides; UCX limited to TCP on loopback (no RDMA device
    here), so the code path that runs over InfiniBand/RoCE is the one exercised."""
    pytest.importorskip("nixl", reason="NIXL is an optional dependency of the rdma transport")
    os.environ.setdefault("UCX_TLS", "tcp")
    unified = cluster["unified"]
    prefill = Instance(checkpoint, "prefill", transport="rdma")
    decode = Instance(checkpoint, "decode", transport="rdma", transfer_timeout_s=20.0)
    try:
        prompt = "registered memory, written remotely " * 3
        params = {"prefill_url": prefill.url, "room": "rdmaroom1"}
        answer = completion(decode.url, prompt, kv_transfer_params=params)
        assert answer["choices"][0]["text"] == completion(unified.url, prompt)["choices"][0]["text"]
        health = decode.kv_health()
        assert health["transport"] == "rdma" and health["transfers_ok"] == 1 and health["fallbacks"] == 0
        assert health["tokens"] == answer["usage"]["prompt_tokens"]
        prefill.assert_no_leaks()
        decode.assert_no_leaks()
    finally:
        decode.close()
        prefill.close()


def test_decode_killed_mid_stream_ends_the_client_stream_cleanly(
    checkpoint: Path, cluster: dict[str, Any]
) -> None:
    """The router streams a paired request; the decode process is SIGKILLed after the first tokens: the
    client gets an in-band error event and [DONE] (no silent truncation, no hang), the prefill holds
    nothing."""
    import http.client
    import subprocess
    import sys

    prefill = cluster["prefill"]
    port = free_port()
    command = [sys.executable, "-m", "sovereign_runtime", "serve", "--model", str(checkpoint), "--role", "decode",
               "--host", "127.0.0.1", "--port", str(port), "--kv-port", str(free_port()), "--no-warmup",
               "--num-kv-blocks", "64", "--served-model-name", MODEL]  # fmt: skip
    proc = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, stderr=subprocess.DEVNULL)
    front: LiveApp | None = None
    try:
        deadline = time.monotonic() + 300  # importing torch at load 19 on 2 cores took over 120 s
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health/ready", timeout=2):
                    break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "decode process did not start"
                time.sleep(0.2)
        router = Router(
            RouterConfig(
                static_members={"prefill": [prefill.url], "decode": [f"http://127.0.0.1:{port}"]},
                health_interval_s=3600,
                disaggregation_threshold_chars=0,
            )
        )
        front = LiveApp(create_router_app(router))
        front.run(router.check_all())
        conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=30)
        body = {"model": MODEL, "prompt": "keep talking " * 4, "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        conn.request(
            "POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.readline().startswith(b"data: ")  # tokens flow from the decode process
        started = time.monotonic()
        proc.kill()
        rest = resp.read().decode()
        assert time.monotonic() - started < 20
        assert '"error"' in rest and rest.rstrip().endswith("data: [DONE]"), rest[-300:]
        assert '"finish_reason": "length"' not in rest
        conn.close()
        prefill.assert_no_leaks()
    finally:
        if front is not None:
            front.close()
        proc.kill()
        proc.wait(10)


def test_client_hanging_up_during_the_transfer_frees_the_reserved_blocks(checkpoint: Path) -> None:
    fake = _fake_prefill(_stalls_with_heartbeats)
    decode = Instance(checkpoint, "decode", transfer_timeout_s=20.0)
    try:
        body = {"model": MODEL, "prompt": "wait for me " * 5, "max_tokens": 4,
                "kv_transfer_params": {"prefill_url": fake.url, "room": "hangup1"}}  # fmt: skip
        with pytest.raises(TimeoutError):
            post(decode.url + "/v1/completions", body, timeout=1.0)
        llm = decode.engine.inner.engine
        deadline = time.monotonic() + 10
        while llm.scheduler.reserved or llm.scheduler.requests:  # the abort reaches the engine thread
            assert time.monotonic() < deadline, "reserved blocks were not freed after the client left"
            time.sleep(0.05)
        decode.assert_no_leaks()
        assert decode.kv_health()["fallbacks"] == 0  # cancelled, not failed over
    finally:
        decode.close()
        fake.close()


# The byte-level test tokenizer's id for "Z" (its vocabulary is the sorted byte alphabet).
_BYTE_Z = sorted(pre_tokenizers.ByteLevel.alphabet()).index("Z")


def _transfer_counts(cluster: dict[str, Any]) -> tuple[int, int, int]:
    decodes = [d.kv_health() for d in cluster["decodes"]]
    return (
        cluster["prefill"].kv_health()["transfers_failed"],
        sum(h["transfers_failed"] for h in decodes),
        sum(h["fallbacks"] for h in decodes),
    )


@pytest.mark.parametrize(
    "sampling",
    [
        {"min_tokens": 6, "max_tokens": 8},
        {"seed": 1234, "temperature": 1.0, "max_tokens": 12},
        {"stop": "STOP", "max_tokens": 12},  # "STOP" is replaced by a piece of the unified answer
        {"logprobs": 3, "max_tokens": 5},
        # The prefill samples the first token: it must apply the bias too (and report biased logprobs).
        {"logit_bias": {str(_BYTE_Z): 100}, "logprobs": 2, "max_tokens": 5},
        {"logit_bias": {str(_BYTE_Z): 100}, "seed": 5, "temperature": 1.0, "max_tokens": 5},
    ],
    ids=["min_tokens", "seed", "stop", "logprobs", "logit_bias", "logit_bias-seed"],
)
def test_sampling_parameters_give_the_unified_output_through_a_pair(
    cluster: dict[str, Any], sampling: dict[str, Any]
) -> None:
    """The prefill samples the first token exactly as a unified instance would, whatever the request's
    sampling parameters; the decode continues from there. No transfer fails, nothing is prefilled twice."""
    unified, router = cluster["unified"], cluster["router"]
    prompt = "sample me through a pair, " + "please " * 4
    body = {k: v for k, v in sampling.items() if k != "temperature"}
    temperature = sampling.get("temperature", 0)
    if "stop" in body:
        plain = completion(unified.url, prompt, max_tokens=12, ignore_eos=True)["choices"][0]["text"]
        body["stop"] = plain[5:7]  # a stop string the greedy answer reaches after a few tokens
    want = completion(unified.url, prompt, temperature=temperature, ignore_eos=True, **body)["choices"][0]
    before = _transfer_counts(cluster)
    ok_before = cluster["prefill"].kv_health()["transfers_ok"]
    got = completion(router.url, prompt, temperature=temperature, ignore_eos=True, **body)["choices"][0]
    assert got["text"] == want["text"] and got["finish_reason"] == want["finish_reason"]
    if "logit_bias" in body:
        assert got["text"] == "Z" * body["max_tokens"]
    if "logprobs" in body:
        assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
        assert got["logprobs"]["token_logprobs"] == pytest.approx(
            want["logprobs"]["token_logprobs"], abs=1e-4
        )
        assert [sorted(t) for t in got["logprobs"]["top_logprobs"]] == [
            sorted(t) for t in want["logprobs"]["top_logprobs"]
        ]
    assert _transfer_counts(cluster) == before  # no refusal by the prefill, no local prefill on the decode
    assert cluster["prefill"].kv_health()["transfers_ok"] == ok_before + 1


def test_a_json_schema_constrains_the_prefill_first_token_and_the_decode_after_it(
    cluster: dict[str, Any],
) -> None:
    """The prefill samples the first token under the schema's mask, the decode's matcher accepts it
    and continues: through a pair the output is the unified one, and it parses and validates."""
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    fmt = {"response_format": {"type": "json_schema", "json_schema": {"name": "ok", "schema": schema}}}
    unified, router = cluster["unified"], cluster["router"]
    prompt = "answer in JSON through a pair, " + "please " * 4
    for seed in (1, 2):
        body = {"temperature": 1.0, "seed": seed, "max_tokens": 120, **fmt}
        want = completion(unified.url, prompt, **body)["choices"][0]
        before = _transfer_counts(cluster)
        ok_before = cluster["prefill"].kv_health()["transfers_ok"]
        got = completion(router.url, prompt, **body)["choices"][0]
        assert got["text"] == want["text"] and got["finish_reason"] == want["finish_reason"] == "stop"
        assert json.loads(got["text"])["ok"] in (True, False)
        assert _transfer_counts(cluster) == before
        assert cluster["prefill"].kv_health()["transfers_ok"] == ok_before + 1
