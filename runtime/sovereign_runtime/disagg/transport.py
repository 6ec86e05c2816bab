"""KV-cache transport between a prefill and a decode instance.

The decode instance *expects* a room (a request id the router minted) before it asks a prefill
instance for work, with a callback that writes each received layer into the blocks it pre-allocated,
and hands the prefill instance the room's `ticket` (how to reach it). The prefill instance opens a
stream from the ticket and sends each layer's latent KV as soon as it exists, so the transfer overlaps
the rest of the prefill.

Failure handling is the point of this module: the receiver fails a room when no frame (heartbeats
included) arrives for `idle_timeout_s` or the peer disconnects before `done`; the sender fails when the
connection breaks. Neither side ever waits forever. `TcpKVReceiver`/`TcpKVSender` are the TCP
implementation; `nixl_transport` provides the RDMA one behind the same interfaces.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .protocol import (
    PREFIX_BYTES,
    Frame,
    ProtocolError,
    decode_prefix,
    encode_frame,
    payload_tensor,
    tensor_payload,
)

LayerCallback = Callable[[int, int, torch.Tensor], None]  # (layer, first token index, [tokens, kv_dim])


class KVTransferError(Exception):
    pass


@dataclass(frozen=True)
class KVLayout:
    """What one room receives: up to `num_tokens` rows of `kv_dim` values for each of `num_layers` layers."""

    num_layers: int
    num_tokens: int
    kv_dim: int
    dtype: torch.dtype = torch.float32


@dataclass
class TransferResult:
    room: str
    layers: int
    bytes: int
    seconds: float
    done: dict[str, Any]


@dataclass
class TransferStats:
    """Counters the server exports as metrics and on its KV-health endpoint."""

    bytes_sent: int = 0
    bytes_received: int = 0
    transfers_ok: int = 0
    transfers_failed: int = 0
    last_error: str | None = None
    last_error_time: float | None = None
    seconds: list[float] = field(default_factory=list)  # recent transfer durations

    def record_ok(self, seconds: float) -> None:
        self.transfers_ok += 1
        self.seconds = [*self.seconds[-255:], seconds]

    def record_failure(self, message: str) -> None:
        self.transfers_failed += 1
        self.last_error, self.last_error_time = message, time.time()


class KVReceiver(Protocol):
    stats: TransferStats

    def expect(
        self, room: str, on_layer: LayerCallback, layout: KVLayout, idle_timeout_s: float = 10.0
    ) -> asyncio.Future[TransferResult]: ...

    def ticket(self, room: str) -> dict[str, Any]:
        """How the prefill side reaches the room (JSON-serialisable; sent in the PD handshake)."""
        ...

    def cancel(self, room: str, reason: str = "cancelled") -> None: ...


class KVStream(Protocol):
    def send_layer(self, layer: int, first_token: int, kv: torch.Tensor) -> None: ...

    def finish(self, done: dict[str, Any], timeout_s: float = 30.0) -> None: ...

    def fail(self, message: str) -> None: ...


class KVSender(Protocol):
    stats: TransferStats

    def open(self, ticket: dict[str, Any]) -> KVStream: ...


# ---- receiving rooms, whatever the wire --------------------------------------------------------------


@dataclass
class _Expectation:
    room: str
    on_layer: LayerCallback
    layout: KVLayout
    idle_timeout_s: float
    future: asyncio.Future[TransferResult]
    started: float = field(default_factory=time.perf_counter)
    last_seen: float = field(default_factory=time.monotonic)
    connected: bool = False
    watchdog: asyncio.TimerHandle | None = None
    layers: int = 0
    bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # transport-specific state (registrations, peer)


class ReceiverBase:
    """Room bookkeeping shared by the transports: expectations, the connect watchdog, outcomes."""

    def __init__(self) -> None:
        self.stats = TransferStats()
        self._rooms: dict[str, _Expectation] = {}

    def expect(
        self, room: str, on_layer: LayerCallback, layout: KVLayout, idle_timeout_s: float = 10.0
    ) -> asyncio.Future[TransferResult]:
        loop = asyncio.get_running_loop()
        if room in self._rooms:
            raise KVTransferError(f"room {room} is already expected")
        expectation = _Expectation(room, on_layer, layout, idle_timeout_s, loop.create_future())
        # The prefill side must show up within the idle timeout too, or the room fails.
        expectation.watchdog = loop.call_later(idle_timeout_s, self._expire_unconnected, room)
        self._rooms[room] = expectation
        self._opened(expectation)
        return expectation.future

    def cancel(self, room: str, reason: str = "cancelled") -> None:
        expectation = self._rooms.get(room)
        if expectation is not None:
            self._fail(expectation, reason, count=False)

    def _opened(self, expectation: _Expectation) -> None:
        """Hook: a transport prepares what the room needs (memory registration, ...)."""

    def _closed(self, expectation: _Expectation) -> None:
        """Hook: a transport releases what `_opened` took."""

    def _expire_unconnected(self, room: str) -> None:
        expectation = self._rooms.get(room)
        if expectation is not None and not expectation.connected:
            message = f"room {room}: no prefill connection within {expectation.idle_timeout_s:g} s"
            self._fail(expectation, message)

    def _fail(self, expectation: _Expectation, message: str, count: bool = True) -> None:
        if self._rooms.get(expectation.room) is expectation:
            del self._rooms[expectation.room]
        if expectation.watchdog is not None:
            expectation.watchdog.cancel()
        self._closed(expectation)
        if count:
            self.stats.record_failure(message)
        if not expectation.future.done():
            expectation.future.set_exception(KVTransferError(message))

    def _succeed(self, expectation: _Expectation, done: dict[str, Any]) -> None:
        if self._rooms.get(expectation.room) is expectation:
            del self._rooms[expectation.room]
        if expectation.watchdog is not None:
            expectation.watchdog.cancel()
        self._closed(expectation)
        seconds = time.perf_counter() - expectation.started
        self.stats.record_ok(seconds)
        if not expectation.future.done():
            result = TransferResult(expectation.room, expectation.layers, expectation.bytes, seconds, done)
            expectation.future.set_result(result)


# ---- TCP ---------------------------------------------------------------------------------------------


class TcpKVReceiver(ReceiverBase):
    """The decode side: a TCP listener that accepts one stream per expected room.

    Each connection is read on its own thread with `recv_into` straight into the tensor a layer will
    occupy (one copy from the kernel), because an asyncio stream reader copies every byte several
    times and throttled transfers to a fifth of what the socket can do. Outcomes are handed back to
    the event loop that awaits the room.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None) -> None:
        super().__init__()
        self.host, self.port = host, port
        self.advertise_host = advertise_host
        self._listener: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._closing = False

    @property
    def address(self) -> str:
        return f"{self.advertise_host or self.host}:{self.port}"

    def ticket(self, room: str) -> dict[str, Any]:
        return {"transport": "tcp", "address": self.address, "room": room}

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._listener = socket.create_server((self.host, self.port), reuse_port=False)
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept_loop, name="kv-accept", daemon=True).start()

    async def stop(self) -> None:
        self._closing = True
        for room in list(self._rooms):
            self.cancel(room, "receiver stopped")
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._closing:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="kv-recv", daemon=True).start()

    def _on_loop(self, callback: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is waiting any more
            self._loop.call_soon_threadsafe(callback, *args)

    def _serve(self, conn: socket.socket) -> None:
        expectation: _Expectation | None = None
        try:
            conn.settimeout(10.0)
            hello = _read_frame_blocking(conn)
            room = str(hello.header.get("room"))
            expectation = self._rooms.get(room)
            if hello.kind != "hello" or expectation is None:
                conn.sendall(
                    _join(encode_frame({"kind": "error", "message": f"room {room} is not expected here"}))
                )
                return
            expectation.connected = True
            conn.settimeout(expectation.idle_timeout_s)
            while True:
                header_len, payload_len = decode_prefix(_read_exact(conn, PREFIX_BYTES))
                header = json.loads(_read_exact(conn, header_len))
                kind = header.get("kind")
                self.stats.bytes_received += PREFIX_BYTES + header_len + payload_len
                if kind == "layer":
                    kv = payload_tensor(header, _read_exact(conn, payload_len))
                    expectation.on_layer(int(header["layer"]), int(header["first_token"]), kv)
                    expectation.layers += 1
                    expectation.bytes += payload_len
                elif kind == "heartbeat":
                    continue
                elif kind == "done":
                    self._on_loop(self._succeed, expectation, header)
                    conn.sendall(_join(encode_frame({"kind": "ack", "room": room})))
                    return
                elif kind == "error":
                    raise KVTransferError(f"prefill reported: {header.get('message')}")
                else:
                    raise ProtocolError(f"unexpected frame {kind!r}")
        except TimeoutError:
            if expectation is not None:
                message = (
                    f"room {expectation.room}: no data from prefill for {expectation.idle_timeout_s:g} s"
                )
                self._on_loop(self._fail, expectation, message)
        except (ProtocolError, ConnectionError) as exc:
            if expectation is not None:
                message = f"room {expectation.room}: prefill disconnected ({exc.__class__.__name__}: {exc})"
                self._on_loop(self._fail, expectation, message)
        except Exception as exc:  # a callback or protocol failure fails the room, never the listener
            if expectation is not None:
                self._on_loop(self._fail, expectation, f"room {expectation.room}: {exc}")
        finally:
            with contextlib.suppress(OSError):
                conn.close()


def _join(parts: list[bytes | memoryview]) -> bytes:
    return b"".join(bytes(p) for p in parts)


_STOP = object()


class TcpKVStream:
    """The prefill side of one room: frames are queued and written by a thread, so sending a layer
    returns at once and the transfer overlaps the computation of the next layers."""

    def __init__(
        self,
        address: str,
        room: str,
        stats: TransferStats,
        connect_timeout_s: float = 5.0,
        heartbeat_interval_s: float = 1.0,
        send_timeout_s: float = 30.0,
    ) -> None:
        host, _, port = address.rpartition(":")
        self.room = room
        self.stats = stats
        self._error: str | None = None
        self._queue: queue.Queue[object] = queue.Queue()
        self._heartbeat_interval_s = heartbeat_interval_s
        try:
            self._sock = socket.create_connection((host.strip("[]"), int(port)), timeout=connect_timeout_s)
        except OSError as exc:
            stats.record_failure(f"room {room}: cannot reach decode at {address}: {exc}")
            raise KVTransferError(f"cannot reach decode at {address}: {exc}") from exc
        self._sock.settimeout(send_timeout_s)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._started = time.perf_counter()
        self._queue.put(encode_frame({"kind": "hello", "room": room}))
        self._writer = threading.Thread(target=self._write_loop, name=f"kv-send-{room}", daemon=True)
        self._writer.start()

    def send_layer(self, layer: int, first_token: int, kv: torch.Tensor) -> None:
        self._raise_if_failed()
        meta, payload = tensor_payload(kv)
        self._queue.put(
            encode_frame({"kind": "layer", "layer": layer, "first_token": first_token, **meta}, payload)
        )

    def finish(self, done: dict[str, Any], timeout_s: float = 30.0) -> None:
        """Send `done` and wait until the receiver acknowledged it."""
        self._raise_if_failed()
        self._queue.put(encode_frame({"kind": "done", "room": self.room, **done}))
        self._queue.put(_STOP)
        self._writer.join(timeout_s)
        if self._writer.is_alive():
            self._error = self._error or f"room {self.room}: transfer did not finish within {timeout_s:g} s"
            self._close()
        self._raise_if_failed()
        try:
            self._sock.settimeout(timeout_s)
            ack = _read_frame_blocking(self._sock)
            if ack.kind != "ack":
                raise KVTransferError(f"room {self.room}: decode answered {ack.header}")
        except (OSError, ProtocolError) as exc:
            self._error = f"room {self.room}: no acknowledgement from decode ({exc})"
            raise KVTransferError(self._error) from exc
        finally:
            self._close()
        self.stats.record_ok(time.perf_counter() - self._started)

    def fail(self, message: str) -> None:
        if self._error is None:
            self._queue.put(encode_frame({"kind": "error", "room": self.room, "message": message}))
        self._queue.put(_STOP)
        self._writer.join(5.0)
        self._close()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise KVTransferError(self._error)

    def _write_loop(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self._heartbeat_interval_s)
            except queue.Empty:
                item = encode_frame({"kind": "heartbeat"})
            if item is _STOP:
                return
            try:
                for part in item:  # type: ignore[attr-defined]
                    self._sock.sendall(part)
                    self.stats.bytes_sent += len(part)
            except OSError as exc:
                self._error = f"room {self.room}: decode connection broke ({exc.__class__.__name__}: {exc})"
                self.stats.record_failure(self._error)
                return

    def _close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()


class TcpKVSender:
    def __init__(self, connect_timeout_s: float = 5.0, heartbeat_interval_s: float = 1.0) -> None:
        self.stats = TransferStats()
        self.connect_timeout_s = connect_timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s

    def open(self, ticket: dict[str, Any]) -> TcpKVStream:
        return TcpKVStream(
            ticket["address"], ticket["room"], self.stats, self.connect_timeout_s, self.heartbeat_interval_s
        )


def _read_exact(sock: socket.socket, n: int) -> bytearray:
    buffer = bytearray(n)
    view = memoryview(buffer)
    received = 0
    while received < n:
        got = sock.recv_into(view[received:], n - received)
        if not got:
            raise ProtocolError("connection closed")
        received += got
    return buffer


def _read_frame_blocking(sock: socket.socket) -> Frame:
    header_len, payload_len = decode_prefix(_read_exact(sock, PREFIX_BYTES))
    header = json.loads(_read_exact(sock, header_len))
    payload = _read_exact(sock, payload_len) if payload_len else b""
    return Frame(header, payload)
