"""Helpers for the server tests: a small byte-level tokenizer on disk and a scripted fake engine.

The fake engine honours the ``AsyncEngine`` contract in the engine's own types (an async generator of
``RequestOutput``, closing it aborts, ``EngineStats``) so HTTP-shape tests run in milliseconds; the
end-to-end tests use the real engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sovereign_runtime.engine import EngineStats, RequestOutput, TokenLogprob
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

BOS, EOS, USER, ASSISTANT = "<s>", "</s>", "<|user|>", "<|assistant|>"

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}" + USER + "{{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}" + ASSISTANT + "{{ m['content'] }}" + EOS + "\n"
    "{% else %}{{ raise_exception('unsupported role ' + m['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)


def write_byte_tokenizer(
    directory: Path, chat_template: str = CHAT_TEMPLATE, extra_special: Sequence[str] = ()
) -> Path:
    """A byte-level BPE without merges (one token per UTF-8 byte) plus special and think tokens;
    ``extra_special`` adds more special tokens after them (tool-call markers)."""
    directory.mkdir(parents=True, exist_ok=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in (BOS, EOS, USER, ASSISTANT)]
    )
    if extra_special:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra_special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "bos_token": {"content": BOS, "special": True},
        "eos_token": EOS,
        "add_bos_token": False,
        "chat_template": chat_template,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@dataclass
class FakeEngine:
    """Replies with ``script`` (token ids) one token per step, honouring max_tokens, stop ids and eos."""

    script: list[int]
    eos_token_id: int
    delay_s: float = 0.0
    cached_tokens: int = 0
    active: set[str] = field(default_factory=set)
    aborted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    seen_params: list[Any] = field(default_factory=list)
    seen_prompts: list[list[int]] = field(default_factory=list)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_requests_running=len(self.active),
            num_requests_waiting=0,
            kv_cache_usage=0.25 if self.active else 0.0,
            num_free_blocks=0,
            num_cached_blocks=0,
            prefix_cache_queries=10,
            prefix_cache_hits=4,
            prompt_tokens_waiting=0,
            num_preemptions=0,
        )

    def generate(
        self, prompt_token_ids: Sequence[int], params: Any, request_id: str | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        return self._run(list(prompt_token_ids), params, request_id or "fake")

    async def _run(self, prompt: list[int], params: Any, rid: str) -> AsyncGenerator[RequestOutput, None]:
        self.seen_params.append(params)
        self.seen_prompts.append(prompt)
        self.active.add(rid)
        done = False
        try:
            script = self.script if params.ignore_eos else [*self.script, self.eos_token_id]
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos else {self.eos_token_id})
            for i in range(params.max_tokens):
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                tok = script[i % len(script)]
                reason = None
                if tok in stops:
                    reason = "stop"
                elif i + 1 == params.max_tokens:
                    reason = "length"
                lps = None
                if params.logprobs is not None:
                    lps = [TokenLogprob(tok, -0.5, [(tok, -0.5), (7, -1.5)][: params.logprobs])]
                out_ids = [] if tok == self.eos_token_id and reason == "stop" else [tok]
                yield RequestOutput(
                    rid, out_ids, lps, reason is not None, reason, len(prompt), i + 1, self.cached_tokens
                )
                if reason:
                    done = True
                    return
        finally:
            self.active.discard(rid)
            (self.finished if done else self.aborted).append(rid)


class LiveServer:
    """Runs an aiohttp app on 127.0.0.1 (free port) in a thread with its own event loop."""

    def __init__(self, app: Any) -> None:
        import threading

        from sovereign_runtime.server import start_server

        self.app = app
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.server = self.run(start_server(app, "127.0.0.1", 0))
        self.port = self.server.port
        self.url = f"http://127.0.0.1:{self.port}"

    def run(self, coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Poll /health/startup until 200, failing at once if loading failed."""
        import time

        from sovereign_runtime.server.app import STATE

        deadline = time.monotonic() + timeout_s
        while self.request("GET", "/health/startup")[0] != 200:
            assert self.app[STATE].phase != "failed", self.app[STATE].error
            assert time.monotonic() < deadline, "server did not become ready"
            time.sleep(0.05)

    def close(self) -> None:
        try:
            self.run(self.server.close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
        raw: bytes | None = None,
    ) -> tuple[int, Any]:
        """One HTTP request; returns (status, parsed JSON or text)."""
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
            hdrs = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=data, headers=hdrs)
            resp = conn.getresponse()
            text = resp.read().decode()
            try:
                return resp.status, json.loads(text)
            except json.JSONDecodeError:
                return resp.status, text
        finally:
            conn.close()

    def stream(self, path: str, body: Any, headers: dict[str, str] | None = None) -> list[Any]:
        """POST and parse an SSE stream into JSON events, with "[DONE]" kept as the string."""
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request(
                "POST",
                path,
                body=json.dumps(body).encode(),
                headers={"Content-Type": "application/json", **(headers or {})},
            )
            resp = conn.getresponse()
            assert resp.status == 200, resp.read()
            assert resp.getheader("Content-Type", "").startswith("text/event-stream")
            events: list[Any] = []
            for block in resp.read().decode().split("\n\n"):
                if not block.strip():
                    continue
                assert block.startswith("data: "), block
                payload = block[len("data: ") :]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
            return events
        finally:
            conn.close()


def byte_tokenizer_checkpoint(tiny_checkpoint_factory: Any, destination: Path) -> Path:
    """A tiny random DeepSeek-V3 checkpoint whose vocabulary covers ``write_byte_tokenizer`` (EOS = "</s>")."""
    import shutil

    src = tiny_checkpoint_factory(vocab_size=262, bos_token_id=256, eos_token_id=257)
    shutil.copytree(src, destination)
    write_byte_tokenizer(destination)
    return destination


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def distinct_free_ports(n: int) -> list[int]:
    """n ports free right now and different from each other (all held open while they are picked)."""
    import socket

    sockets = [socket.create_server(("127.0.0.1", 0)) for _ in range(n)]
    try:
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@contextlib.contextmanager
def serving_checkpoint(checkpoint: Path, model_name: str, **engine: Any) -> Iterator[LiveServer]:
    """The real engine on ``checkpoint`` (CPU) behind the HTTP server, ready; closed on exit.
    ``engine``: EngineOptions fields (max_model_len, max_num_seqs, num_kv_blocks...)."""
    from sovereign_runtime.assembly import EngineOptions, make_loader
    from sovereign_runtime.server import ServerConfig, create_app

    options = EngineOptions(model_path=checkpoint, device="cpu", **engine)
    srv = LiveServer(create_app(ServerConfig(served_model_name=model_name), loader=make_loader(options)))
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.close()
