"""Deadlines for reading a request, so a slow client (slowloris) cannot hold connections forever.

aiohttp times out neither a request's headers nor its body, and keeps an idle keep-alive connection
for an hour: a client that opens connections and sends a byte now and then holds each one (and a file
descriptor) for as long as it likes. Both the runtime's server and the router listen through
`DeadlineSite`, which wraps every connection in a watchdog:

- headers: from the connection's first byte (or its opening), and from the first byte of each later
  request on it, the request line and headers must be in within `header_timeout_s`; past it a
  partial request gets a 408 and the connection closes; a connection that sent nothing just closes.
- body: `deadline_middleware` reads a request's body within `body_timeout_s` before the handler runs
  (the handlers read bodies whole anyway): past it, a 408 in OpenAI's error format and a close.
- idle: a keep-alive connection without a request closes after `idle_timeout_s` (aiohttp's own
  keep-alive timer, set from here).

The watchdog knows a request's headers are in when the middleware sees the request, and that the
connection is idle again when the middleware has answered: no HTTP parsing of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

from aiohttp import web

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
TIMEOUT_KINDS = ("header", "body")


@dataclass(frozen=True)
class ReadDeadlines:
    header_timeout_s: float = 15.0
    body_timeout_s: float = 60.0
    idle_timeout_s: float = 75.0

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "idle_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")

    def runner_kwargs(self) -> dict[str, Any]:
        """What `web.AppRunner` passes on to aiohttp's request handler."""
        return {"keepalive_timeout": self.idle_timeout_s}


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


_FLAGS = (
    (
        "--header-timeout",
        "header_timeout_s",
        "a request's line and headers must arrive within this (else 408 and close)",
    ),
    (
        "--body-timeout",
        "body_timeout_s",
        "a request's body must arrive within this once its headers are in (else 408)",
    ),
    ("--idle-timeout", "idle_timeout_s", "a kept-alive connection with no request closes after this"),
)


def add_read_deadline_flags(parser: argparse.ArgumentParser) -> None:
    defaults = ReadDeadlines()
    for flag, name, help_text in _FLAGS:
        parser.add_argument(
            flag, type=_seconds, default=getattr(defaults, name), metavar="SECONDS", help=help_text
        )


def read_deadlines(args: argparse.Namespace) -> ReadDeadlines:
    return ReadDeadlines(args.header_timeout, args.body_timeout, args.idle_timeout)


def timeout_body(message: str) -> bytes:
    return json.dumps(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": "request_timeout",
            }
        }
    ).encode()


class _Watched(asyncio.Protocol):
    """One connection: aiohttp's protocol inside, a header timer around it."""

    def __init__(self, inner: asyncio.Protocol, guard: DeadlineGuard) -> None:
        self.inner = inner
        self.guard = guard
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.in_request = False
        self.received_since_idle = 0

    # asyncio.Protocol, forwarded
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Not an isinstance check: uvloop's transports are not asyncio.Transport subclasses.
        self.transport = cast(asyncio.Transport, transport)
        self.guard.connections[id(self.inner)] = self
        self._arm()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self.in_request:
            self.received_since_idle += len(data)
            if self.timer is None:
                self._arm()  # the first byte of the next request on a kept-alive connection
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.guard.connections.pop(id(self.inner), None)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    # the header timer
    def _arm(self) -> None:
        loop = asyncio.get_running_loop()
        self.timer = loop.call_later(self.guard.deadlines.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _headers_late(self) -> None:
        self.timer = None
        transport = self.transport
        if transport is None or transport.is_closing() or self.in_request:
            return
        self.guard.count("header")
        if self.received_since_idle:
            limit = self.guard.deadlines.header_timeout_s
            body = timeout_body(f"the request's headers did not arrive within {limit:g} s")
            transport.write(
                b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nConnection: close\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
        transport.close()

    # called by the middleware
    def request_started(self) -> None:
        self.in_request = True
        self._disarm()

    def request_finished(self) -> None:
        self.in_request = False
        self.received_since_idle = 0


class DeadlineGuard:
    """The deadlines of one server: the protocol factory its site listens with, and its middleware."""

    def __init__(self, deadlines: ReadDeadlines, on_timeout: Callable[[str], None] | None = None) -> None:
        self.deadlines = deadlines
        self.on_timeout = on_timeout
        self.connections: dict[int, _Watched] = {}  # id(aiohttp's protocol) -> its watchdog

    def count(self, kind: str) -> None:
        if self.on_timeout is not None:
            self.on_timeout(kind)

    def protocol_factory(self, inner: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        return lambda: _Watched(inner(), self)

    def middleware(self) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
        guard = self

        @web.middleware
        async def deadline_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
            watched = guard.connections.get(id(request.protocol))
            if watched is not None:
                watched.request_started()
            try:
                if request.body_exists:
                    limit = guard.deadlines.body_timeout_s
                    try:
                        # Read (and cache) the whole body now: the handler's read returns it at once.
                        # asyncio.timeout, not wait_for: no task per request.
                        async with asyncio.timeout(limit):
                            await request.read()
                    except TimeoutError:
                        guard.count("body")
                        response = web.Response(
                            status=408,
                            body=timeout_body(f"the request body did not arrive within {limit:g} s"),
                            content_type="application/json",
                            headers={"Connection": "close"},
                        )
                        response.force_close()
                        transport = request.transport
                        if transport is not None:
                            # Send it and close now: aiohttp would otherwise linger up to 10 s
                            # reading the rest of a body that is not coming.
                            await response.prepare(request)
                            await response.write_eof()
                            transport.close()
                        return response
                return await handler(request)
            finally:
                if watched is not None:
                    watched.request_finished()

        return deadline_middleware


class DeadlineSite(web.BaseSite):
    """A TCP site whose connections `guard` watches (aiohttp's TCPSite otherwise)."""

    __slots__ = ("_guard", "_host", "_port")

    def __init__(self, runner: web.BaseRunner, host: str, port: int, guard: DeadlineGuard) -> None:
        super().__init__(runner)  # the shutdown timeout is the runner's
        self._host = host
        self._port = port
        self._guard = guard

    @property
    def name(self) -> str:
        sockets = self._server.sockets if self._server is not None else ()
        port = sockets[0].getsockname()[1] if sockets else self._port
        return f"http://{self._host}:{port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            self._guard.protocol_factory(server), self._host, self._port, backlog=self._backlog
        )
