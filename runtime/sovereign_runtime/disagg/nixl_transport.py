"""The RDMA KV transport, through NVIDIA's NIXL transfer library.

The decode side registers a staging region for each room and gives the prefill side a ticket with
its agent metadata and the region's addresses; the prefill side WRITEs each layer's rows straight into
that region (one-sided: RDMA on InfiniBand/RoCE, UCX's TCP transport where there is none) and NIXL
delivers the notification `room|layer|i|first|count` after the data has landed. Heartbeats, `done`,
`error` and the acknowledgement travel as NIXL notifications too, so the failure semantics are those
of the TCP transport: a silent or vanished peer fails the room after `idle_timeout_s`, never hangs it.

`nixl` is optional (`pip install 'sovereign[rdma]'`); the operator selects this transport only when the
pool has RDMA devices.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import queue
import threading
import time
import uuid
from typing import Any

import torch

from .transport import (
    KVLayout,
    KVTransferError,
    LayerCallback,
    ReceiverBase,
    TransferResult,
    TransferStats,
    _Expectation,
)


def _nixl_api() -> Any:
    try:
        from nixl import _api
    except ImportError as exc:  # pragma: no cover - exercised where nixl is absent
        raise KVTransferError(
            "the RDMA KV transport needs the 'nixl' package (pip install 'sovereign[rdma]'); "
            "use --kv-transport tcp without it"
        ) from exc
    return _api


def _make_agent(prefix: str, backends: tuple[str, ...]) -> tuple[Any, str]:
    api = _nixl_api()
    name = f"{prefix}-{uuid.uuid4().hex[:12]}"
    return api.nixl_agent(name, api.nixl_agent_config(backends=list(backends))), name


def _mem_type(tensor: torch.Tensor) -> tuple[str, int]:
    return ("VRAM", tensor.get_device()) if tensor.is_cuda else ("DRAM", 0)


def _layout_bytes(layout: KVLayout) -> int:
    return (
        layout.num_layers
        * layout.num_tokens
        * layout.kv_dim
        * torch.empty(0, dtype=layout.dtype).element_size()
    )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class StagingArena:
    """Byte ranges of one buffer registered once for the process's life.

    Registering per room would let a late write from a slow prefill land in memory the decode has
    already freed. Here a released range is quarantined for `quarantine_s` before it is handed out
    again, so a straggler can only ever write into memory that is still ours and unused.
    """

    ALIGN = 256

    def __init__(self, size_bytes: int, quarantine_s: float, device: str = "cpu") -> None:
        self.buffer = torch.zeros(size_bytes, dtype=torch.uint8, device=device)
        self.quarantine_s = quarantine_s
        self._free: list[tuple[int, int]] = [(0, size_bytes)]  # (offset, length), sorted by offset
        self._quarantined: list[tuple[float, int, int]] = []  # (release time, offset, length)

    def allocate(self, nbytes: int) -> int | None:
        self._reclaim()
        nbytes = -(-nbytes // self.ALIGN) * self.ALIGN
        for index, (offset, length) in enumerate(self._free):
            if length >= nbytes:
                if length == nbytes:
                    del self._free[index]
                else:
                    self._free[index] = (offset + nbytes, length - nbytes)
                return offset
        return None

    def release(self, offset: int, nbytes: int) -> None:
        nbytes = -(-nbytes // self.ALIGN) * self.ALIGN
        self._quarantined.append((time.monotonic(), offset, nbytes))

    def view(self, offset: int, layout: KVLayout) -> torch.Tensor:
        nbytes = (
            layout.num_layers
            * layout.num_tokens
            * layout.kv_dim
            * torch.empty(0, dtype=layout.dtype).element_size()
        )
        raw = self.buffer[offset : offset + nbytes]
        return raw.view(layout.dtype).view(layout.num_layers, layout.num_tokens, layout.kv_dim)

    def _reclaim(self) -> None:
        now = time.monotonic()
        ready = [(o, n) for t, o, n in self._quarantined if now - t >= self.quarantine_s]
        if not ready:
            return
        self._quarantined = [q for q in self._quarantined if now - q[0] < self.quarantine_s]
        ranges = sorted(self._free + ready)
        merged: list[tuple[int, int]] = []
        for offset, length in ranges:
            if merged and merged[-1][0] + merged[-1][1] == offset:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((offset, length))
        self._free = merged


class NixlKVReceiver(ReceiverBase):
    """The decode side. Call `start()` inside the event loop that awaits the rooms."""

    def __init__(
        self,
        backends: tuple[str, ...] = ("UCX",),
        poll_interval_s: float = 0.002,
        device: str = "cpu",
        staging_bytes: int = 64 << 20,
        quarantine_s: float = 60.0,
    ) -> None:
        super().__init__()
        self.agent, self.name = _make_agent("sovereign-decode", backends)
        self.poll_interval_s = poll_interval_s
        self.arena = StagingArena(staging_bytes, quarantine_s, device)
        self.agent.register_memory(self.arena.buffer)
        self._poller: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._poller = asyncio.create_task(self._poll())

    async def stop(self) -> None:
        for room in list(self._rooms):
            self.cancel(room, "receiver stopped")
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller

    def ticket(self, room: str) -> dict[str, Any]:
        expectation = self._rooms.get(room)
        if expectation is None:
            raise KVTransferError(f"room {room} is not expected here")
        staging: torch.Tensor = expectation.extra["staging"]
        mem_type, device = _mem_type(staging)
        layout = expectation.layout
        row_bytes = layout.kv_dim * staging.element_size()
        return {
            "transport": "nixl",
            "room": room,
            "agent": self.name,
            # Taken now: an agent's metadata names its registered regions, this room's included.
            "metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
            "base": staging.data_ptr(),
            "mem_type": mem_type,
            "device": device,
            "row_bytes": row_bytes,
            "layer_stride": layout.num_tokens * row_bytes,
            "num_layers": layout.num_layers,
            "num_tokens": layout.num_tokens,
            "dtype": str(layout.dtype).removeprefix("torch."),
        }

    def expect(
        self, room: str, on_layer: LayerCallback, layout: KVLayout, idle_timeout_s: float = 10.0
    ) -> asyncio.Future[TransferResult]:
        nbytes = _layout_bytes(layout)
        offset = self.arena.allocate(nbytes)
        if offset is None:
            # The caller falls back to prefilling locally.
            raise KVTransferError(f"room {room}: no staging space for {nbytes} bytes of KV")
        try:
            future = super().expect(room, on_layer, layout, idle_timeout_s)
        except KVTransferError:
            self.arena.release(offset, nbytes)
            raise
        self._rooms[room].extra.update(offset=offset, nbytes=nbytes, staging=self.arena.view(offset, layout))
        return future

    def _closed(self, expectation: _Expectation) -> None:
        if "offset" in expectation.extra:
            self.arena.release(expectation.extra.pop("offset"), expectation.extra.pop("nbytes"))

    async def _poll(self) -> None:
        while True:
            for peer, messages in self.agent.get_new_notifs().items():
                for message in messages:
                    self._dispatch(_text(peer), _text(message))
            now = time.monotonic()
            for expectation in list(self._rooms.values()):
                if expectation.connected and now - expectation.last_seen > expectation.idle_timeout_s:
                    message = (
                        f"room {expectation.room}: no data from prefill for {expectation.idle_timeout_s:g} s"
                    )
                    self._fail(expectation, message)
            await asyncio.sleep(self.poll_interval_s)

    def _dispatch(self, peer: str, message: str) -> None:
        room, _, rest = message.partition("|")
        kind, _, body = rest.partition("|")
        expectation = self._rooms.get(room)
        if expectation is None:
            if kind == "hello":  # a prefill is about to write for a room we never expected or gave up
                with contextlib.suppress(Exception):
                    self.agent.add_remote_agent(base64.b64decode(body))
                    self.agent.send_notif(peer, f"{room}|error|room {room} is not expected here".encode())
            return  # late news about a room that already ended
        expectation.connected = True
        expectation.last_seen = time.monotonic()
        try:
            if kind == "hello":
                self.agent.add_remote_agent(base64.b64decode(body))
                expectation.extra["peer"] = peer
            elif kind == "layer":
                layer, first, count = (int(x) for x in body.split("|"))
                rows = expectation.extra["staging"][layer, first : first + count]
                expectation.on_layer(layer, first, rows)
                expectation.layers += 1
                expectation.bytes += rows.numel() * rows.element_size()
                self.stats.bytes_received += rows.numel() * rows.element_size()
            elif kind == "done":
                done = json.loads(body) if body else {}
                self.agent.send_notif(expectation.extra.get("peer", peer), f"{room}|ack".encode())
                self._succeed(expectation, done)
            elif kind == "error":
                self._fail(expectation, f"room {room}: prefill reported: {body}")
            # "hb" only refreshes last_seen
        except Exception as exc:  # a callback failure fails the room, never the poller
            self._fail(expectation, f"room {room}: {exc}")
            with contextlib.suppress(Exception):
                self.agent.send_notif(peer, f"{room}|error|{exc}".encode())


_STOP = object()


class NixlKVSender:
    """The prefill side: one agent for all rooms; calls into the agent are serialised."""

    def __init__(
        self,
        backends: tuple[str, ...] = ("UCX",),
        heartbeat_interval_s: float = 1.0,
        transfer_timeout_s: float = 30.0,
    ) -> None:
        self.agent, self.name = _make_agent("sovereign-prefill", backends)
        self.metadata = base64.b64encode(self.agent.get_agent_metadata()).decode()
        self.stats = TransferStats()
        self.heartbeat_interval_s = heartbeat_interval_s
        self.transfer_timeout_s = transfer_timeout_s
        self.lock = threading.Lock()
        self._inbox: dict[str, str] = {}  # room -> "ack" or an error message

    def open(self, ticket: dict[str, Any]) -> NixlKVStream:
        return NixlKVStream(self, ticket)

    def poll_replies(self) -> None:
        with self.lock:
            notifs = self.agent.get_new_notifs()
        for messages in notifs.values():
            for raw in messages:
                room, _, rest = _text(raw).partition("|")
                self._inbox[room] = rest

    def take_reply(self, room: str) -> str | None:
        return self._inbox.pop(room, None)


class NixlKVStream:
    def __init__(self, sender: NixlKVSender, ticket: dict[str, Any]) -> None:
        self.sender = sender
        self.ticket = ticket
        self.room = str(ticket["room"])
        self._error: str | None = None
        self._queue: queue.Queue[object] = queue.Queue()
        self._started = time.perf_counter()
        try:
            with sender.lock:
                self.remote = sender.agent.add_remote_agent(base64.b64decode(ticket["metadata"]))
                sender.agent.send_notif(self.remote, f"{self.room}|hello|{sender.metadata}".encode())
        except Exception as exc:
            message = f"room {self.room}: cannot reach decode agent {ticket.get('agent')}: {exc}"
            sender.stats.record_failure(message)
            raise KVTransferError(message) from exc
        self._writer = threading.Thread(target=self._write_loop, name=f"kv-nixl-{self.room}", daemon=True)
        self._writer.start()

    def send_layer(self, layer: int, first_token: int, kv: torch.Tensor) -> None:
        self._raise_if_failed()
        t = self.ticket
        if not 0 <= layer < t["num_layers"] or first_token < 0 or first_token + kv.shape[0] > t["num_tokens"]:
            raise KVTransferError(
                f"room {self.room}: layer {layer} rows [{first_token}, {first_token + kv.shape[0]}) are outside "
                f"the decode's region of {t['num_layers']} layers × {t['num_tokens']} tokens"
            )
        if kv.shape[-1] * kv.element_size() != t["row_bytes"]:
            raise KVTransferError(
                f"room {self.room}: rows of {kv.shape[-1]} {kv.dtype} do not match the decode's layout"
            )
        self._queue.put((layer, first_token, kv.detach().contiguous()))

    def finish(self, done: dict[str, Any], timeout_s: float = 30.0) -> None:
        self._raise_if_failed()
        self._queue.put(_STOP)
        self._writer.join(timeout_s)
        if self._writer.is_alive():
            self._error = self._error or f"room {self.room}: transfer did not finish within {timeout_s:g} s"
        self._raise_if_failed()
        self._notify(f"done|{json.dumps(done)}")
        self._raise_if_failed()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.sender.poll_replies()
            reply = self.sender.take_reply(self.room)
            if reply == "ack":
                self.sender.stats.record_ok(time.perf_counter() - self._started)
                return
            if reply is not None:
                self._error = f"room {self.room}: decode answered {reply}"
                break
            time.sleep(0.001)
        self._error = (
            self._error or f"room {self.room}: no acknowledgement from decode within {timeout_s:g} s"
        )
        self.sender.stats.record_failure(self._error)
        raise KVTransferError(self._error)

    def fail(self, message: str) -> None:
        self._queue.put(_STOP)
        self._writer.join(5.0)
        if self._error is None:
            self._notify(f"error|{message}")

    def _raise_if_failed(self) -> None:
        if self._error is None:
            self.sender.poll_replies()
            reply = self.sender.take_reply(self.room)
            if reply is not None and reply != "ack":
                self._error = f"room {self.room}: decode answered {reply}"
        if self._error is not None:
            raise KVTransferError(self._error)

    def _notify(self, body: str) -> None:
        try:
            with self.sender.lock:
                self.sender.agent.send_notif(self.remote, f"{self.room}|{body}".encode())
        except Exception as exc:
            self._set_error(f"room {self.room}: decode agent unreachable ({exc.__class__.__name__}: {exc})")

    def _set_error(self, message: str) -> None:
        if self._error is None:
            self._error = message
            self.sender.stats.record_failure(message)

    def _write_loop(self) -> None:
        while self._error is None:
            try:
                item = self._queue.get(timeout=self.sender.heartbeat_interval_s)
            except queue.Empty:
                self._notify("hb")
                continue
            if item is _STOP:
                return
            layer, first, kv = item  # type: ignore[misc]
            try:
                self._write(layer, first, kv)
            except Exception as exc:
                self._set_error(f"room {self.room}: RDMA write failed ({exc.__class__.__name__}: {exc})")

    def _write(self, layer: int, first: int, kv: torch.Tensor) -> None:
        agent, t = self.sender.agent, self.ticket
        nbytes = kv.numel() * kv.element_size()
        address = t["base"] + layer * t["layer_stride"] + first * t["row_bytes"]
        notif = f"{self.room}|layer|{layer}|{first}|{kv.shape[0]}".encode()
        with self.sender.lock:
            registration = agent.register_memory(kv)
            local = agent.get_xfer_descs(kv)
            remote = agent.get_xfer_descs([(address, nbytes, t["device"])], t["mem_type"])
            handle = agent.initialize_xfer("WRITE", local, remote, self.remote, notif)
            state = agent.transfer(handle)
        try:
            deadline = time.monotonic() + self.sender.transfer_timeout_s
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise KVTransferError(
                        f"write of layer {layer} took over {self.sender.transfer_timeout_s:g} s"
                    )
                time.sleep(0.0002)
                with self.sender.lock:
                    state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise KVTransferError(f"write of layer {layer} ended in state {state}")
            self.sender.stats.bytes_sent += nbytes
        finally:
            with self.sender.lock:
                handle.release()
                agent.deregister_memory(registration)
