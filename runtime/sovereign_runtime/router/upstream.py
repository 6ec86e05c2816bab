"""The router's HTTP/1.1 client to its workers: pooled keep-alive connections, llhttp's C parser.

aiohttp's client spent about a fifth of the router's CPU per proxied request (py-spy, docs/BENCHMARKS.md
"Router overhead"): building a `ClientRequest`, its timers and tracing hooks, and parsing the answer in
Python layers around the C parser. A proxy to a handful of known workers needs much less: write the
request in one buffer, feed the answer to `httptools` (llhttp, what uvicorn parses with), hand the body
to the handler as it arrives.

Semantics the router relies on, kept from the aiohttp client it replaces:
- one deadline for the whole exchange, body included (`TimeoutError`), and one for connecting;
- a connection whose answer was not read to its end is closed, never reused: leaving a stream early
  (the client hung up) closes the worker's connection, which stops its generation;
- any failure to connect, a reset, an early close or an unparsable answer is `UpstreamError`.
Idle connections are kept for `IDLE_KEEPALIVE_S`, well under the workers' own keep-alive (aiohttp's
75 s), so the router does not pick a connection the worker is closing. A request is never sent twice
by this client: a worker that closes a connection without answering may have read the request and
started on it (one that crashed does exactly that), so the router's retry policy decides, as a failure.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import cast
from urllib.parse import urlsplit

import httptools

IDLE_KEEPALIVE_S = 15.0
# A stream's unread bytes above this pause reading from the worker (TCP backpressure) until the
# handler has sent them on: a slow client must not make the router buffer a whole generation.
PAUSE_READING_BYTES = 256 * 1024


class UpstreamError(Exception):
    """The worker could not be reached, or broke the exchange off."""


def worker_address(base_url: str) -> tuple[str, int, str, str]:
    """(host, port, Host header, path prefix) of a worker's base URL (urlsplit caches its parses)."""
    try:
        parts = urlsplit(base_url)
        port = parts.port or 80
    except ValueError as exc:  # a port out of range or not a number
        raise UpstreamError(f"worker URL {base_url!r} is not valid: {exc}") from exc
    if parts.scheme != "http" or not parts.hostname:
        raise UpstreamError(f"worker URL {base_url!r} is not an http://HOST[:PORT] URL")
    return parts.hostname, port, parts.netloc, parts.path.rstrip("/")


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a worker, answering one request at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._response: UpstreamResponse | None = None

    # ---- asyncio.Protocol ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        response = self._response
        if response is None:
            # Bytes while no request is out (a worker answering twice): the connection is unusable.
            self.close()
            return
        try:
            response.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            response.fail(UpstreamError(f"unparsable answer from the worker: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        response = self._response
        if response is not None and not response.complete:
            if response.headers_done and response.until_eof:
                response.complete = True  # a body delimited by the close itself
                response._wake()
            else:
                response.fail(UpstreamError(f"the worker closed the connection{f': {exc}' if exc else ''}"))

    # ---- used by the pool -------------------------------------------------------------------------
    def send(self, response: UpstreamResponse, request: bytes) -> None:
        assert self.transport is not None
        self._response = response
        self.transport.write(request)

    def detach(self) -> None:
        self._response = None

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class UpstreamResponse:
    """A worker's answer: status and headers once `UpstreamPool.request` returns, the body as it comes."""

    def __init__(self, connection: _Connection) -> None:
        self._connection = connection
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: dict[str, str] = {}
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.until_eof = True  # no Content-Length and not chunked: the body ends with the connection
        self.content_length: int | None = None
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    # ---- llhttp callbacks -------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        # httptools joins a header split across reads before calling this.
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        length = self.headers.get("content-length")
        if length is not None and length.isdigit():
            self.content_length = int(length)
        chunked = "chunked" in self.headers.get("transfer-encoding", "").lower()
        self.until_eof = self.content_length is None and not chunked
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > PAUSE_READING_BYTES and not self._paused:
            transport = self._connection.transport
            if transport is not None:
                self._paused = True
                transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        # Asked now: once the message is over llhttp resets and no longer knows.
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()

    # ---- failure and waiting ----------------------------------------------------------------------
    def fail(self, error: BaseException) -> None:
        if self._error is None and not self.complete:
            self._error = error
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        self._waiter = self._connection.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self._error is not None:
            raise self._error

    async def wait_headers(self) -> None:
        while not self.headers_done:
            await self._wait()

    # ---- the body ---------------------------------------------------------------------------------
    def _take(self) -> bytes:
        data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        if self._paused:
            self._paused = False
            transport = self._connection.transport
            if transport is not None and not self._connection.closed:
                transport.resume_reading()
        return data

    async def read(self) -> bytes:
        """The whole body."""
        parts: list[bytes] = []
        while True:
            if self._chunks:
                parts.append(self._take())  # taken as it comes, so reading never stays paused
            if self.complete:
                return parts[0] if len(parts) == 1 else b"".join(parts)
            await self._wait()

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, every byte received so far in one piece."""
        while True:
            if self._chunks:
                yield self._take()
            elif self.complete:
                return
            else:
                await self._wait()


class UpstreamPool:
    """Keep-alive connections to workers, by address; unbounded, as aiohttp's `limit=0` was."""

    def __init__(self, connect_timeout_s: float, request_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._closed = False

    def forget(self, base_url: str) -> None:
        """A worker left the pool: close its idle connections (nothing would ask for them again)."""
        host, port, _, _ = worker_address(base_url)
        self._close_idle((host, port))

    def _close_idle(self, key: tuple[str, int]) -> None:
        for connection in self._idle.pop(key, []):
            connection.close()

    async def _connect(self, host: str, port: int) -> _Connection:
        loop = asyncio.get_running_loop()
        idle = self._idle.get((host, port))
        now = loop.time()
        while idle:
            connection = idle.pop()
            if not connection.closed and now - connection.idle_since < IDLE_KEEPALIVE_S:
                return connection
            connection.close()
        connection = _Connection(loop)
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await loop.create_connection(lambda: connection, host, port)
        except TimeoutError:
            connection.close()
            raise
        except OSError as exc:
            raise UpstreamError(f"cannot connect to {host}:{port}: {exc}") from exc
        return connection

    def _release(self, connection: _Connection, response: UpstreamResponse, key: tuple[str, int]) -> None:
        connection.detach()
        reusable = (
            response.complete
            and not response.until_eof
            and not connection.closed
            and not self._closed
            and response.keep_alive
        )
        if not reusable:
            connection.close()
            return
        connection.idle_since = connection.loop.time()
        self._idle.setdefault(key, []).append(connection)

    @contextlib.asynccontextmanager
    async def request(
        self,
        method: str,
        base_url: str,
        path: str,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[UpstreamResponse]:
        """Send one request; inside the block the answer's headers are in and its body can be read.
        The deadline (`request_timeout_s` unless `timeout_s`) covers the whole block."""
        if self._closed:
            raise UpstreamError("the router is shutting down")
        host, port, host_header, prefix = worker_address(base_url)
        head = [f"{method} {prefix}{path} HTTP/1.1\r\nHost: {host_header}\r\nContent-Length: {len(body)}\r\n"]
        if headers:
            head.extend(f"{name}: {value}\r\n" for name, value in headers.items())
        head.append("\r\n")
        request = "".join(head).encode("utf-8") + body
        response: UpstreamResponse | None = None
        connection: _Connection | None = None
        try:
            async with asyncio.timeout(self.request_timeout_s if timeout_s is None else timeout_s):
                connection = await self._connect(host, port)
                response = UpstreamResponse(connection)
                connection.send(response, request)
                await response.wait_headers()
                yield response
        finally:
            if connection is not None:
                if response is None:
                    connection.close()
                else:
                    self._release(connection, response, (host, port))

    async def close(self) -> None:
        self._closed = True
        for key in list(self._idle):
            self._close_idle(key)
