"""Slow clients (slowloris) against the runtime's server and the router: headers, bodies and idle
connections all have deadlines, answered with an OpenAI-style 408 where a request had begun."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web
from server_support import FakeEngine, LiveServer, write_byte_tokenizer
from sovereign_runtime.read_deadlines import (
    DeadlineGuard,
    DeadlineSite,
    ReadDeadlines,
    add_read_deadline_flags,
)
from sovereign_runtime.router.app import Router, RouterConfig
from sovereign_runtime.router.app import create_app as create_router_app
from sovereign_runtime.server import LoadedRuntime, ServerConfig, create_app
from sovereign_runtime.tokenizer import Tokenizer

FAST = ReadDeadlines(header_timeout_s=0.4, body_timeout_s=0.4, idle_timeout_s=1.5)


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def _read_all(sock: socket.socket, within_s: float = 5.0) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and how long that took."""
    started = time.monotonic()
    sock.settimeout(within_s)
    chunks = []
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return b"".join(chunks), time.monotonic() - started
        chunks.append(chunk)


def _status_and_body(raw: bytes) -> tuple[int, Any]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body) if body else None


class _Echo:
    """A minimal app on a DeadlineSite: /echo answers the body's length, /slow answers after a while."""

    def __init__(self, deadlines: ReadDeadlines) -> None:
        self.timeouts: list[str] = []
        self.guard = DeadlineGuard(deadlines, on_timeout=self.timeouts.append)
        self.loop = asyncio.new_event_loop()

        async def echo(request: web.Request) -> web.Response:
            return web.json_response({"bytes": len(await request.read())})

        async def slow(request: web.Request) -> web.Response:
            await asyncio.sleep(1.0)  # longer than the header deadline: a slow answer is not a slow client
            return web.json_response({"ok": True})

        async def start() -> tuple[web.AppRunner, int]:
            app = web.Application(middlewares=[self.guard.middleware()])
            app.router.add_post("/echo", echo)
            app.router.add_get("/slow", slow)
            runner = web.AppRunner(app, **deadlines.runner_kwargs())
            await runner.setup()
            site = DeadlineSite(runner, "127.0.0.1", 0, self.guard)
            await site.start()
            return runner, int(runner.addresses[0][1])

        import threading

        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.runner, self.port = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def echo() -> Iterator[_Echo]:
    server = _Echo(FAST)
    yield server
    server.close()


def test_partial_headers_get_a_408_and_the_connection_closes(echo: _Echo) -> None:
    with _connect(echo.port) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\n")  # ...and never the blank line
        raw, took = _read_all(sock)
    status, body = _status_and_body(raw)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert "headers" in body["error"]["message"] and 0.3 < took < 2.0
    assert echo.timeouts == ["header"]


def test_a_connection_that_sends_nothing_is_closed(echo: _Echo) -> None:
    with _connect(echo.port) as sock:
        raw, took = _read_all(sock)
    assert raw == b"" and took < 2.0 and echo.timeouts == ["header"]


def test_a_body_that_trickles_gets_a_408(echo: _Echo) -> None:
    with _connect(echo.port) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789")
        raw, took = _read_all(sock)
    status, body = _status_and_body(raw)
    assert status == 408 and "body" in body["error"]["message"] and took < 2.0
    assert echo.timeouts == ["body"]


def test_a_kept_alive_connection_serves_requests_apart_and_closes_when_idle(echo: _Echo) -> None:
    request = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
    with _connect(echo.port) as sock:
        sock.sendall(request)
        assert b'{"bytes": 3}' in sock.recv(65536)
        # Idle longer than the header deadline: the next request's clock starts at its first byte.
        time.sleep(0.8)
        sock.sendall(request)
        assert b'{"bytes": 3}' in sock.recv(65536)
        raw, took = _read_all(sock)  # then nothing: the idle timeout closes it
    assert raw == b"" and 1.0 < took < 3.0
    assert echo.timeouts == []


def test_a_slow_answer_is_not_a_slow_client(echo: _Echo) -> None:
    with _connect(echo.port) as sock:
        sock.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        raw, _ = _read_all(sock)
    assert _status_and_body(raw) == (200, {"ok": True}) and echo.timeouts == []


def test_slow_clients_do_not_keep_others_out(echo: _Echo) -> None:
    hogs = [_connect(echo.port) for _ in range(50)]
    try:
        for hog in hogs:
            hog.sendall(b"POST /echo HTTP/1.1\r\n")
        with _connect(echo.port) as sock:
            sock.sendall(
                b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi"
            )
            raw, _ = _read_all(sock)
        assert _status_and_body(raw) == (200, {"bytes": 2})
        for hog in hogs:
            _read_all(hog)  # every hog is closed by its deadline
        assert echo.timeouts == ["header"] * 50
    finally:
        for hog in hogs:
            hog.close()


def test_bad_deadlines_are_refused() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_read_deadline_flags(parser)
    args = parser.parse_args(["--header-timeout", "5"])
    assert (args.header_timeout, args.body_timeout, args.idle_timeout) == (5.0, 60.0, 75.0)
    for bad in ("0", "-1", "nan", "inf", "soon"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--body-timeout", bad])
    with pytest.raises(ValueError, match="idle_timeout_s"):
        ReadDeadlines(idle_timeout_s=0)


def _metric(text: str, name: str, kind: str) -> float:
    for line in text.splitlines():
        if line.startswith(name) and f'kind="{kind}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{{kind={kind}}} not in /metrics")


def test_the_runtime_server_times_out_slow_clients_and_counts_them(tmp_path: Any) -> None:
    tokenizer = Tokenizer.from_dir(write_byte_tokenizer(tmp_path / "tok"))
    assert tokenizer.eos_token_id is not None
    engine = FakeEngine(
        script=tokenizer.encode("ok", add_special_tokens=False), eos_token_id=tokenizer.eos_token_id
    )
    rt = LoadedRuntime(engine=engine, tokenizer=tokenizer, max_model_len=64)
    server = LiveServer(create_app(ServerConfig(served_model_name="m", read_deadlines=FAST), runtime=rt))
    try:
        with _connect(server.port) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
            raw, _ = _read_all(sock)
        status, body = _status_and_body(raw)
        assert status == 408 and body["error"]["code"] == "request_timeout"
        with _connect(server.port) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\n")
            raw, _ = _read_all(sock)
        assert _status_and_body(raw)[0] == 408
        status, metrics = server.request("GET", "/metrics")
        text = metrics if isinstance(metrics, str) else str(metrics)
        assert status == 200
        assert _metric(text, "sovereign:request_read_timeouts_total", "body") == 1
        assert _metric(text, "sovereign:request_read_timeouts_total", "header") == 1
        # An ordinary request still works, and a body over the limit is still a 413 (the size check
        # comes before the deadline's read).
        status, answer = server.request(
            "POST", "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2}
        )
        assert status == 200 and answer["choices"][0]["text"] == "ok"
    finally:
        server.close()


def test_the_router_times_out_slow_clients_and_counts_them() -> None:
    from sovereign_runtime.router.cli import serve_router

    router = Router(RouterConfig(static_members={"worker": ["http://127.0.0.1:9"]}, read_deadlines=FAST))
    app = create_router_app(router)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    async def main() -> None:
        task = asyncio.create_task(serve_router(app, "127.0.0.1", port))
        try:
            await _listening(port)
            raw = await asyncio.to_thread(_slow_headers, port)
            status, body = _status_and_body(raw)
            assert status == 408 and body["error"]["code"] == "request_timeout"
            assert router.metrics.read_timeouts.labels("header")._value.get() >= 1
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())


async def _listening(port: int) -> None:
    for _ in range(100):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.05)
            continue
        writer.close()
        return
    raise AssertionError("the router did not listen")


def _slow_headers(port: int) -> bytes:
    with _connect(port) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        return _read_all(sock)[0]
