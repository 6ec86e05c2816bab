"""The KV transports on loopback: data integrity, and that no failure ever hangs a room.

Every case runs over TCP and over NIXL (UCX restricted to its TCP transport, so the code path that
drives RDMA hardware is the one exercised here).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import Any

import pytest
import torch
from sovereign_runtime.disagg.protocol import encode_frame
from sovereign_runtime.disagg.transport import KVLayout, KVTransferError, TcpKVReceiver, TcpKVSender

os.environ.setdefault("UCX_TLS", "tcp")  # before any NIXL agent starts: loopback TCP, no RDMA device


def run(coro: object) -> object:
    return asyncio.run(asyncio.wait_for(coro, timeout=60))  # type: ignore[arg-type]


def _make_receiver(kind: str) -> Any:
    if kind == "tcp":
        return TcpKVReceiver()
    from sovereign_runtime.disagg.nixl_transport import NixlKVReceiver

    return NixlKVReceiver()


def _make_sender(kind: str, **options: float) -> Any:
    if kind == "tcp":
        return TcpKVSender(**options)
    from sovereign_runtime.disagg.nixl_transport import NixlKVSender

    return NixlKVSender(**options)


TRANSPORTS = ["tcp", "nixl"]
LAYOUT = KVLayout(num_layers=4, num_tokens=64, kv_dim=576)


def _layers(dtype: torch.dtype = torch.float32, tokens: int = 37) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randn(tokens, LAYOUT.kv_dim, generator=generator).to(dtype) for _ in range(LAYOUT.num_layers)
    ]


@pytest.mark.parametrize("kind", TRANSPORTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_arrive_intact_and_done_carries_the_first_token(kind: str, dtype: torch.dtype) -> None:
    async def scenario() -> None:
        receiver = _make_receiver(kind)
        await receiver.start()
        received: dict[int, tuple[int, torch.Tensor]] = {}
        layout = KVLayout(LAYOUT.num_layers, LAYOUT.num_tokens, LAYOUT.kv_dim, dtype)
        future = receiver.expect(
            "room-1", lambda layer, first, kv: received.__setitem__(layer, (first, kv.clone())), layout
        )
        ticket = receiver.ticket("room-1")
        layers = _layers(dtype)
        sender = _make_sender(kind)

        def prefill() -> None:
            stream = sender.open(ticket)
            for index, kv in enumerate(layers):
                stream.send_layer(index, 5, kv)
            stream.finish({"first_token_id": 42})

        await asyncio.to_thread(prefill)
        result = await future
        assert result.layers == 4 and result.done["first_token_id"] == 42
        assert result.bytes == sum(kv.numel() * kv.element_size() for kv in layers)
        for index, kv in enumerate(layers):
            first, got = received[index]
            assert first == 5 and got.dtype == dtype and torch.equal(got, kv)
        assert receiver.stats.transfers_ok == 1 and sender.stats.transfers_ok == 1
        assert sender.stats.bytes_sent >= result.bytes
        await receiver.stop()

    run(scenario())


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_unexpected_room_is_refused_cleanly(kind: str) -> None:
    async def scenario() -> None:
        receiver = _make_receiver(kind)
        await receiver.start()
        receiver.expect("real", lambda *a: None, LAYOUT, idle_timeout_s=5)
        ticket = {**receiver.ticket("real"), "room": "nobody-expects-me"}
        receiver.cancel("real")
        sender = _make_sender(kind)

        def prefill() -> None:
            stream = sender.open(ticket)
            stream.send_layer(0, 0, torch.zeros(2, LAYOUT.kv_dim))
            stream.finish({}, timeout_s=2)

        with pytest.raises(KVTransferError):
            await asyncio.to_thread(prefill)
        await receiver.stop()

    run(scenario())


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_silent_prefill_times_out_but_heartbeats_keep_a_slow_one_alive(kind: str) -> None:
    async def scenario() -> None:
        receiver = _make_receiver(kind)
        await receiver.start()
        silent = receiver.expect("silent", lambda *a: None, LAYOUT, idle_timeout_s=1.5)
        slow = receiver.expect("slow", lambda *a: None, LAYOUT, idle_timeout_s=1.5)
        tickets = receiver.ticket("silent"), receiver.ticket("slow")
        quiet_sender = _make_sender(kind, heartbeat_interval_s=60)
        chatty_sender = _make_sender(kind, heartbeat_interval_s=0.2)

        def stall() -> None:
            stream = quiet_sender.open(tickets[0])
            time.sleep(3.5)  # computing, and saying nothing
            with pytest.raises(KVTransferError):
                stream.send_layer(0, 0, torch.ones(3, LAYOUT.kv_dim))
                stream.finish({}, timeout_s=2)

        def slow_but_alive() -> None:
            stream = chatty_sender.open(tickets[1])
            time.sleep(3.5)  # computing, with heartbeats flowing
            stream.send_layer(0, 0, torch.ones(3, LAYOUT.kv_dim))
            stream.finish({"first_token_id": 1})

        await asyncio.gather(asyncio.to_thread(stall), asyncio.to_thread(slow_but_alive))
        with pytest.raises(KVTransferError, match="no data from prefill"):
            await silent
        assert (await slow).layers == 1
        await receiver.stop()

    run(scenario())


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_room_without_any_connection_expires(kind: str) -> None:
    async def scenario() -> None:
        receiver = _make_receiver(kind)
        await receiver.start()
        future = receiver.expect("never", lambda *a: None, LAYOUT, idle_timeout_s=0.3)
        with pytest.raises(KVTransferError, match="no prefill connection"):
            await future
        await receiver.stop()

    run(scenario())


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_decode_failing_to_store_a_layer_surfaces_on_the_sender(kind: str) -> None:
    async def scenario() -> None:
        receiver = _make_receiver(kind)
        await receiver.start()

        def explode(layer: int, first: int, kv: torch.Tensor) -> None:
            raise RuntimeError("decode ran out of blocks")

        future = receiver.expect("room", explode, LAYOUT)
        ticket = receiver.ticket("room")
        sender = _make_sender(kind)

        def prefill() -> None:
            stream = sender.open(ticket)
            stream.send_layer(0, 0, torch.zeros(4, LAYOUT.kv_dim))
            time.sleep(0.3)
            with pytest.raises(KVTransferError):
                for layer in range(1, LAYOUT.num_layers):
                    stream.send_layer(layer, 0, torch.zeros(LAYOUT.num_tokens, LAYOUT.kv_dim))
                stream.finish({}, timeout_s=2)

        await asyncio.to_thread(prefill)
        with pytest.raises(KVTransferError, match="ran out of blocks"):
            await future
        await receiver.stop()

    run(scenario())


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_cancel_fails_the_waiter_and_rooms_are_unique(kind: str) -> None:
    async def scenario() -> None:
        receiver = _make_receiver(kind)
        await receiver.start()
        future = receiver.expect("room", lambda *a: None, LAYOUT)
        receiver.cancel("room", "client went away")
        with pytest.raises(KVTransferError, match="client went away"):
            await future
        receiver.expect("dup", lambda *a: None, LAYOUT)
        with pytest.raises(KVTransferError, match="already expected"):
            receiver.expect("dup", lambda *a: None, LAYOUT)
        await receiver.stop()

    run(scenario())


# ---- cases only a connection-oriented wire has --------------------------------------------------------


def test_tcp_prefill_dying_mid_transfer_fails_the_room_at_once() -> None:
    async def scenario() -> None:
        receiver = TcpKVReceiver()
        await receiver.start()
        future = receiver.expect("room", lambda *a: None, LAYOUT, idle_timeout_s=20)
        host, port = receiver.address.split(":")
        started = time.perf_counter()

        def half_transfer() -> None:
            with socket.create_connection((host, int(port))) as sock:
                for part in encode_frame({"kind": "hello", "room": "room"}):
                    sock.sendall(part)
                # then the process dies: the socket closes without `done`

        await asyncio.to_thread(half_transfer)
        with pytest.raises(KVTransferError, match="disconnected"):
            await future
        assert time.perf_counter() - started < 5  # not the 20 s idle timeout
        assert receiver.stats.transfers_failed == 1 and "disconnected" in (receiver.stats.last_error or "")
        await receiver.stop()

    run(scenario())


def test_tcp_dead_decode_fails_the_sender_instead_of_hanging() -> None:
    async def scenario() -> None:
        receiver = TcpKVReceiver()
        await receiver.start()
        receiver.expect("room", lambda *a: None, LAYOUT)
        ticket = receiver.ticket("room")
        await receiver.stop()  # decode instance is gone
        sender = TcpKVSender(connect_timeout_s=1)
        with pytest.raises(KVTransferError, match="cannot reach decode"):
            await asyncio.to_thread(sender.open, ticket)
        assert sender.stats.transfers_failed == 1

    run(scenario())


def test_nixl_stream_refuses_rows_outside_the_decode_region() -> None:
    async def scenario() -> None:
        receiver = _make_receiver("nixl")
        await receiver.start()
        receiver.expect("room", lambda *a: None, LAYOUT)
        sender = _make_sender("nixl")
        stream = sender.open(receiver.ticket("room"))
        with pytest.raises(KVTransferError, match="outside"):
            stream.send_layer(0, LAYOUT.num_tokens - 1, torch.zeros(2, LAYOUT.kv_dim))
        with pytest.raises(KVTransferError, match="do not match"):
            stream.send_layer(0, 0, torch.zeros(2, 8))
        stream.fail("giving up")
        await receiver.stop()

    run(scenario())
