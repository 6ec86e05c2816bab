"""The router's HTTP/1.1 client to workers, against raw sockets that answer exactly the bytes a test
chooses: framing (length, chunked, close-delimited), keep-alive reuse, early exits, deadlines, errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager

import pytest
import uvloop
from sovereign_runtime.router import upstream as upstream_module
from sovereign_runtime.router.upstream import UpstreamError, UpstreamPool

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
loop_factory = asyncio.new_event_loop


@pytest.fixture(autouse=True, params=sorted(LOOPS))
def event_loop_kind(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test on asyncio's own loop and on uvloop's, which the router runs on."""
    global loop_factory
    loop_factory = LOOPS[request.param]
    yield
    loop_factory = asyncio.new_event_loop


def run(coro: Awaitable[object]) -> object:
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(asyncio.wait_for(coro, timeout=30))  # type: ignore[arg-type]


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request's head and body (Content-Length framed, as the pool always sends)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, await reader.readexactly(length)


@asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A server on loopback; yields its base URL and a list that counts accepted connections."""
    connections: list[int] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            await handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", connections
    finally:
        server.close()


def keep_alive_echo(answers: int) -> Handler:
    """Answers up to `answers` requests on one connection with the request's body, length-framed."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(answers):
            head, body = await read_request(reader)
            path = head.split(b" ")[1]
            payload = path + b"|" + body
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nX-Extra: 1\r\n"
                b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload
            )
            await writer.drain()

    return handler


def answers_with(reply: bytes) -> Handler:
    """Reads one request and writes `reply` as it is, then closes."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(reply)
        await writer.drain()

    return handler


def test_length_framed_answers_reuse_one_connection() -> None:
    async def main() -> None:
        async with raw_server(keep_alive_echo(10)) as (url, connections):
            pool = UpstreamPool(connect_timeout_s=2, request_timeout_s=5)
            for i in range(3):
                async with pool.request("POST", url, "/v1/x", f"body{i}".encode(), {"A": "b"}) as answer:
                    assert answer.status == 200
                    assert answer.headers["content-type"] == "text/plain"
                    assert answer.content_length == len(f"/v1/x|body{i}")
                    assert await answer.read() == f"/v1/x|body{i}".encode()
            await pool.close()
            assert len(connections) == 1

    run(main())


def test_request_head_carries_host_length_and_headers() -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):
            head, body = await read_request(reader)
            seen.append(head + body)
            writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
            await writer.drain()

    async def main() -> None:
        async with raw_server(handler) as (url, _):
            pool = UpstreamPool(connect_timeout_s=2, request_timeout_s=5)
            async with pool.request("POST", url, "/p", b"{}", {"Authorization": "Bearer k"}) as answer:
                assert answer.status == 204
                assert await answer.read() == b""
            async with pool.request("GET", url + "/base/", "/v1/models") as answer:  # a path prefix
                assert answer.status == 204
            await pool.close()
        host = url.removeprefix("http://").encode()
        assert seen[0].startswith(b"POST /p HTTP/1.1\r\nHost: " + host + b"\r\n")
        assert seen[1].startswith(b"GET /base/v1/models HTTP/1.1\r\n")
        assert b"\r\nContent-Length: 2\r\n" in seen[0]
        assert b"\r\nAuthorization: Bearer k\r\n" in seen[0]
        assert seen[0].endswith(b"\r\n\r\n{}")

    run(main())


def test_chunked_stream_arrives_piece_by_piece_and_the_connection_is_kept() -> None:
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):
            await read_request(reader)
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            writer.write(b"7\r\ndata: 1\r\n")
            await writer.drain()
            await release.wait()
            writer.write(b"7\r\ndata: 2\r\n0\r\n\r\n")
            await writer.drain()

    async def main() -> None:
        async with raw_server(handler) as (url, connections):
            pool = UpstreamPool(connect_timeout_s=2, request_timeout_s=5)
            for _ in range(2):
                release.clear()
                async with pool.request("POST", url, "/s", b"x") as answer:
                    assert answer.content_length is None
                    pieces = []
                    async for piece in answer.iter_chunks():
                        pieces.append(piece)
                        release.set()  # the second half is sent only after the first was read
                    assert pieces == [b"data: 1", b"data: 2"]
            await pool.close()
            assert len(connections) == 1

    run(main())


def test_close_delimited_body_ends_with_the_connection_and_is_not_reused() -> None:
    async def main() -> None:
        reply = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it"
        async with raw_server(answers_with(reply)) as (url, connections):
            pool = UpstreamPool(connect_timeout_s=2, request_timeout_s=5)
            for _ in range(2):
                async with pool.request("GET", url, "/") as answer:
                    assert await answer.read() == b"all of it"
            await pool.close()
            assert len(connections) == 2

    run(main())


def test_leaving_a_stream_early_closes_its_connection() -> None:
    closed = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await writer.drain()
        assert await reader.read() == b""  # the router hung up: the worker sees EOF
        closed.set()

    async def main() -> None:
        async with raw_server(handler) as (url, _):
            pool = UpstreamPool(connect_timeout_s=2, request_timeout_s=5)
            async with pool.request("POST", url, "/s") as answer:
                async for piece in answer.iter_chunks():
                    assert piece == b"abc"
                    break
            await asyncio.wait_for(closed.wait(), 5)
            await pool.close()

    run(main())


def test_deadline_covers_the_body() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        await writer.drain()
        await asyncio.sleep(10)

    async def main() -> None:
        async with raw_server(handler) as (url, _):
            pool = UpstreamPool(connect_timeout_s=2, request_timeout_s=0.3)
            with pytest.raises(TimeoutError):
                async with pool.request("GET", url, "/") as answer:
                    await answer.read()
            with pytest.raises(TimeoutError):  # a per-call deadline overrides the pool's
                async with pool.request("GET", url, "/", timeout_s=0.2) as answer:
                    await answer.read()
            await pool.close()

    run(main())


@pytest.mark.parametrize(
    "reply",
    [
        b"",  # closed before answering
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc",  # closed mid-body
        b"NOT HTTP AT ALL\r\n\r\n",  # unparsable
    ],
)
def test_broken_answers_are_upstream_errors(reply: bytes) -> None:
    async def main() -> None:
        async with raw_server(answers_with(reply)) as (url, _):
            pool = UpstreamPool(connect_timeout_s=2, request_timeout_s=5)
            with pytest.raises(UpstreamError):
                async with pool.request("GET", url, "/") as answer:
                    await answer.read()
            await pool.close()

    run(main())


def test_refused_connection_and_bad_urls_are_upstream_errors() -> None:
    async def main() -> None:
        async with raw_server(keep_alive_echo(1)) as (url, _):
            pass  # the port is closed again
        pool = UpstreamPool(connect_timeout_s=2, request_timeout_s=5)
        with pytest.raises(UpstreamError, match="cannot connect"):
            async with pool.request("GET", url, "/"):
                pass
        with pytest.raises(UpstreamError, match="is not an http://HOST"):
            async with pool.request("GET", "https://example.invalid", "/"):
                pass
        await pool.close()

    run(main())


def test_a_large_body_is_read_through_paused_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(upstream_module, "PAUSE_READING_BYTES", 1024)
    body = bytes(range(256)) * 4096  # 1 MiB

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n")
            for start in range(0, len(body), 65536):
                writer.write(body[start : start + 65536])
                await writer.drain()

    async def main() -> None:
        async with raw_server(handler) as (url, connections):
            pool = UpstreamPool(connect_timeout_s=2, request_timeout_s=10)
            async with pool.request("GET", url, "/") as answer:
                received = b""
                async for piece in answer.iter_chunks():
                    received += piece
                    await asyncio.sleep(0)
                assert received == body
            async with pool.request("GET", url, "/") as answer:  # resumed and reusable
                assert await answer.read() == body
            await pool.close()
            assert len(connections) == 1

    run(main())


def test_idle_connections_expire(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(upstream_module, "IDLE_KEEPALIVE_S", 0.05)

    async def main() -> None:
        async with raw_server(keep_alive_echo(10)) as (url, connections):
            pool = UpstreamPool(connect_timeout_s=2, request_timeout_s=5)
            async with pool.request("GET", url, "/") as answer:
                await answer.read()
            await asyncio.sleep(0.1)
            async with pool.request("GET", url, "/") as answer:
                await answer.read()
            await pool.close()
            assert len(connections) == 2

    run(main())


def test_a_kept_alive_connection_closed_unanswered_is_an_error_never_a_resend() -> None:
    """The worker may have read the request before closing (it crashed on it): sending it again
    would run it twice, so the failure goes to the router's retry policy."""
    requests: list[int] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        requests.append(1)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await read_request(reader)
        requests.append(2)  # read, then dropped unanswered

    async def main() -> None:
        async with raw_server(handler) as (url, _):
            pool = UpstreamPool(connect_timeout_s=2, request_timeout_s=5)
            async with pool.request("GET", url, "/") as answer:
                assert await answer.read() == b"ok"
            with pytest.raises(UpstreamError, match="closed the connection"):
                async with pool.request("GET", url, "/"):
                    pass
            await pool.close()
        assert requests == [1, 2]

    run(main())


def test_forgetting_a_worker_closes_its_idle_connections() -> None:
    async def main() -> None:
        async with raw_server(keep_alive_echo(10)) as (url, connections):
            pool = UpstreamPool(connect_timeout_s=2, request_timeout_s=5)
            async with pool.request("GET", url, "/") as answer:
                await answer.read()
            pool.forget(url)  # the worker left the pool; a new one at its address gets a new connection
            async with pool.request("GET", url, "/") as answer:
                await answer.read()
            await pool.close()
            assert len(connections) == 2

    run(main())
