"""The TCP KV transport on loopback: data integrity, and that no failure ever hangs a room."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import torch
from sovereign_runtime.disagg.protocol import encode_frame
from sovereign_runtime.disagg.transport import KVTransferError, TcpKVReceiver, TcpKVSender


def run(coro: object) -> object:
    return asyncio.run(asyncio.wait_for(coro, timeout=30))  # type: ignore[arg-type]


def _layers(
    num_layers: int = 4, tokens: int = 37, dim: int = 576, dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(tokens, dim, generator=generator).to(dtype) for _ in range(num_layers)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_arrive_intact_and_done_carries_the_first_token(dtype: torch.dtype) -> None:
    async def scenario() -> None:
        receiver = TcpKVReceiver()
        await receiver.start()
        received: dict[int, tuple[int, torch.Tensor]] = {}
        future = receiver.expect(
            "room-1", lambda layer, first, kv: received.__setitem__(layer, (first, kv.clone()))
        )
        layers = _layers(dtype=dtype)
        sender = TcpKVSender()

        def prefill() -> None:
            stream = sender.open(receiver.address, "room-1")
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


def test_unexpected_room_is_refused_cleanly() -> None:
    async def scenario() -> None:
        receiver = TcpKVReceiver()
        await receiver.start()
        sender = TcpKVSender()

        def prefill() -> None:
            stream = sender.open(receiver.address, "nobody-expects-me")
            stream.send_layer(0, 0, torch.zeros(2, 8))
            stream.finish({})

        with pytest.raises(KVTransferError):
            await asyncio.to_thread(prefill)
        await receiver.stop()

    run(scenario())


def test_prefill_dying_mid_transfer_fails_the_room_at_once() -> None:
    async def scenario() -> None:
        receiver = TcpKVReceiver()
        await receiver.start()
        future = receiver.expect("room", lambda *a: None, idle_timeout_s=20)
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


def test_silent_prefill_times_out_but_heartbeats_keep_a_slow_one_alive() -> None:
    async def scenario() -> None:
        receiver = TcpKVReceiver()
        await receiver.start()
        silent = receiver.expect("silent", lambda *a: None, idle_timeout_s=0.5)
        slow = receiver.expect("slow", lambda *a: None, idle_timeout_s=0.5)
        quiet_sender = TcpKVSender(heartbeat_interval_s=60)
        chatty_sender = TcpKVSender(heartbeat_interval_s=0.1)

        def stall() -> None:
            stream = quiet_sender.open(receiver.address, "silent")
            time.sleep(1.5)  # computing, and saying nothing
            with pytest.raises(KVTransferError):
                stream.finish({})

        def slow_but_alive() -> None:
            stream = chatty_sender.open(receiver.address, "slow")
            time.sleep(1.5)  # computing, with heartbeats flowing
            stream.send_layer(0, 0, torch.ones(3, 4))
            stream.finish({"first_token_id": 1})

        await asyncio.gather(asyncio.to_thread(stall), asyncio.to_thread(slow_but_alive))
        with pytest.raises(KVTransferError, match="no data from prefill"):
            await silent
        assert (await slow).layers == 1
        await receiver.stop()

    run(scenario())


def test_room_without_any_connection_expires() -> None:
    async def scenario() -> None:
        receiver = TcpKVReceiver()
        await receiver.start()
        future = receiver.expect("never", lambda *a: None, idle_timeout_s=0.3)
        with pytest.raises(KVTransferError, match="no prefill connection"):
            await future
        await receiver.stop()

    run(scenario())


def test_dead_decode_fails_the_sender_instead_of_hanging() -> None:
    async def scenario() -> None:
        receiver = TcpKVReceiver()
        await receiver.start()
        address = receiver.address
        await receiver.stop()  # decode instance is gone
        sender = TcpKVSender(connect_timeout_s=1)
        with pytest.raises(KVTransferError, match="cannot reach decode"):
            await asyncio.to_thread(sender.open, address, "room")
        assert sender.stats.transfers_failed == 1

    run(scenario())


def test_decode_crashing_mid_stream_surfaces_on_the_sender() -> None:
    async def scenario() -> None:
        receiver = TcpKVReceiver()
        await receiver.start()

        def explode(layer: int, first: int, kv: torch.Tensor) -> None:
            raise RuntimeError("decode ran out of blocks")

        future = receiver.expect("room", explode)
        sender = TcpKVSender()

        def prefill() -> None:
            stream = sender.open(receiver.address, "room")
            stream.send_layer(0, 0, torch.zeros(4, 4))
            time.sleep(0.3)
            with pytest.raises(KVTransferError):
                for layer in range(1, 50):
                    stream.send_layer(layer, 0, torch.zeros(4096, 64))
                stream.finish({})

        await asyncio.to_thread(prefill)
        with pytest.raises(KVTransferError, match="ran out of blocks"):
            await future
        await receiver.stop()

    run(scenario())


def test_cancel_fails_the_waiter() -> None:
    async def scenario() -> None:
        receiver = TcpKVReceiver()
        await receiver.start()
        future = receiver.expect("room", lambda *a: None)
        receiver.cancel("room", "client went away")
        with pytest.raises(KVTransferError, match="client went away"):
            await future
        with pytest.raises(KVTransferError, match="already expected"):
            receiver.expect("dup", lambda *a: None)
            receiver.expect("dup", lambda *a: None)
        await receiver.stop()

    run(scenario())
