"""Internal is internal: with an API key and the deployment's internal token, remote prefill still
runs (no silent fallback to local), and no client can point a decode worker at a URL of its choosing
or call the prefill's internal endpoint."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import web
from disagg_support import MODEL, Instance, LiveApp
from server_support import byte_tokenizer_checkpoint
from sovereign_runtime.disagg.service import INTERNAL_TOKEN_HEADER, PREFILL_PATH
from sovereign_runtime.router.app import Router, RouterConfig
from sovereign_runtime.router.app import create_app as create_router_app

torch.set_num_threads(1)
KEY, TOKEN = "client-key", "deployment-secret"


@pytest.fixture(scope="module")
def pd(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    checkpoint = byte_tokenizer_checkpoint(
        tiny_checkpoint_factory, tmp_path_factory.mktemp("pd-auth") / "ckpt"
    )
    started: list[Any] = []
    try:
        prefill = Instance(checkpoint, "prefill", api_key=KEY, internal_token=TOKEN)
        started.append(prefill)
        decode = Instance(checkpoint, "decode", api_key=KEY, internal_token=TOKEN, transfer_timeout_s=20.0)
        started.append(decode)
        router = Router(
            RouterConfig(
                static_members={"prefill": [prefill.url], "decode": [decode.url]},
                health_interval_s=3600,
                disaggregation_threshold_chars=0,
                internal_token=TOKEN,
            )
        )
        front = LiveApp(create_router_app(router))
        started.append(front)
        front.run(router.check_all())
        yield {"prefill": prefill, "decode": decode, "router": front}
    finally:
        for item in reversed(started):
            item.close()


def post(url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _completion(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}


def test_remote_prefill_runs_with_an_api_key_and_zero_fallbacks(pd: dict[str, Any]) -> None:
    prefill, decode = pd["prefill"], pd["decode"]
    before = prefill.kv_health()["transfers_ok"]
    for i in range(3):
        status, answer = post(
            pd["router"].url + "/v1/completions",
            _completion(f"request {i}: the quick brown fox"),
            {"Authorization": f"Bearer {KEY}"},
        )
        assert status == 200, answer
    # The decode's call to /v1/internal/prefill sent the key (a 401 there would mean local fallback).
    assert decode.kv_health()["fallbacks"] == 0
    assert prefill.kv_health()["transfers_ok"] == before + 3


def test_a_client_cannot_point_the_decode_at_a_url(pd: dict[str, Any]) -> None:
    hits: list[str] = []

    async def canary(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/{tail:.*}", canary)
    listener = LiveApp(app)
    decode = pd["decode"]
    try:
        forged = {"prefill_url": listener.url, "room": "forgedroom1"}
        headers = {"Authorization": f"Bearer {KEY}"}
        # Straight at the decode worker, with a valid API key but without the internal token...
        status, answer = post(
            decode.url + "/v1/completions", _completion("hello there", kv_transfer_params=forged), headers
        )
        assert status == 200, answer
        # ...and through the router, sending a forged token header as well.
        forged_headers = {**headers, INTERNAL_TOKEN_HEADER: "guess"}
        status, answer = post(
            pd["router"].url + "/v1/completions",
            _completion("hello again", kv_transfer_params=forged),
            forged_headers,
        )
        assert status == 200, answer
        assert hits == []  # nobody dialled the client's URL
        assert decode.kv_health()["fallbacks"] == 0
    finally:
        listener.close()


def test_the_internal_prefill_endpoint_refuses_callers_without_the_token(pd: dict[str, Any]) -> None:
    body = {"room": "r1", "ticket": {}, "prompt_token_ids": [1, 2], "sampling": {}}
    status, answer = post(pd["prefill"].url + PREFILL_PATH, body, {"Authorization": f"Bearer {KEY}"})
    assert status == 403 and "internal" in answer["error"]["message"]
