"""KV transfer throughput on loopback: our TCP transport (and NIXL over UCX/TCP) against a plain socket
copy of the same bytes, measured in the same run.

    python bench/kv_transfer.py [--tokens 1024] [--repeats 5]

Reports GB/s and the time one request's KV adds to time-to-first-token per 1k prompt tokens, for the
DeepSeek-V3 layout (61 layers × 576 bf16 values per token = 70,272 B/token) and the built-in model's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import threading
import time

import torch
from sovereign_runtime.disagg.transport import KVLayout, TcpKVReceiver, TcpKVSender

os.environ.setdefault("UCX_TLS", "tcp")


def plain_socket_copy(total_bytes: int) -> float:
    """Seconds to push `total_bytes` through one loopback TCP connection with sendall/recv_into."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    payload = memoryview(bytearray(total_bytes))
    done = threading.Event()

    def receive() -> None:
        conn, _ = server.accept()
        buffer = bytearray(1 << 20)
        remaining = total_bytes
        while remaining:
            n = conn.recv_into(buffer, min(len(buffer), remaining))
            if not n:
                break
            remaining -= n
        conn.sendall(b"k")
        conn.close()
        done.set()

    thread = threading.Thread(target=receive)
    thread.start()
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(payload)
        sock.recv(1)
    elapsed = time.perf_counter() - started
    thread.join()
    server.close()
    return elapsed


async def transport_copy(kind: str, layout: KVLayout) -> float:
    """Seconds from opening a stream to the acknowledged `done`, one frame per layer."""
    if kind == "tcp":
        receiver, sender = TcpKVReceiver(), TcpKVSender()
    else:
        from sovereign_runtime.disagg.nixl_transport import NixlKVReceiver, NixlKVSender

        nbytes = layout.num_layers * layout.num_tokens * layout.kv_dim * 2
        receiver, sender = NixlKVReceiver(staging_bytes=nbytes + (1 << 20), quarantine_s=0), NixlKVSender()
    await receiver.start()
    sink = torch.empty(layout.num_tokens, layout.kv_dim, dtype=layout.dtype)
    future = receiver.expect("bench", lambda layer, first, kv: sink.copy_(kv), layout, idle_timeout_s=60)
    ticket = receiver.ticket("bench")
    layers = [
        torch.randn(layout.num_tokens, layout.kv_dim).to(layout.dtype) for _ in range(layout.num_layers)
    ]

    def send() -> float:
        started = time.perf_counter()
        stream = sender.open(ticket)
        for index, kv in enumerate(layers):
            stream.send_layer(index, 0, kv)
        stream.finish({"first_token_id": 0})
        return time.perf_counter() - started

    elapsed = await asyncio.to_thread(send)
    await future
    await receiver.stop()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--transports", default="tcp,nixl")
    args = parser.parse_args()
    torch.set_num_threads(1)
    layouts = {
        "DeepSeek-V3 (61 layers x 576, bf16)": KVLayout(61, args.tokens, 576, torch.bfloat16),
        "sovereign-tiny-like (4 layers x 96, fp32)": KVLayout(4, args.tokens, 96, torch.float32),
    }
    print(
        f"| layout | transport | bytes per {args.tokens} tokens | median s | GB/s | plain socket GB/s | ratio |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, layout in layouts.items():
        total = (
            layout.num_layers
            * layout.num_tokens
            * layout.kv_dim
            * torch.empty(0, dtype=layout.dtype).element_size()
        )
        for kind in args.transports.split(","):
            ours, plain = [], []
            for _ in range(args.repeats):  # interleaved so both see the same machine load
                plain.append(plain_socket_copy(total))
                ours.append(asyncio.run(transport_copy(kind, layout)))
            ours_s, plain_s = statistics.median(ours), statistics.median(plain)
            print(
                f"| {name} | {kind} | {total:,} | {ours_s:.4f} | {total / ours_s / 1e9:.2f} | "
                f"{total / plain_s / 1e9:.2f} | {plain_s / ours_s:.2f} |"
            )


if __name__ == "__main__":
    main()
