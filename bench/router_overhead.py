"""Router overhead: latency added by `sovereign-runtime router` at a fixed request rate, against stub
workers, compared with calling the workers directly in the same run.

    python bench/router_overhead.py [--rate 100] [--seconds 10] [--workers 2]

The stub workers and the router run as separate processes (as in a cluster); the client paces
requests open-loop at `--rate` per second, alternating direct and routed phases so both see the same
machine load. Bounded: rate × seconds × 2 phases × `--rounds` requests in total, all on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import aiohttp

STUB = r"""
import sys
from aiohttp import web
body = {"id": "cmpl-stub", "object": "text_completion", "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}}
async def complete(request):
    await request.read()
    return web.json_response(body)
async def ready(request):
    return web.Response(text="ok")
app = web.Application()
app.router.add_post("/v1/completions", complete)
app.router.add_get("/health/ready", ready)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_ready(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(url) as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not become ready")


async def phase(urls: list[str], rate: float, seconds: float) -> list[float]:
    latencies: list[float] = []
    payload = json.dumps({"model": "stub", "prompt": "hello", "max_tokens": 1}).encode()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(url: str) -> None:
            started = time.perf_counter()
            async with session.post(url, data=payload, headers={"Content-Type": "application/json"}) as resp:
                await resp.read()
                assert resp.status == 200, resp.status
            latencies.append(time.perf_counter() - started)

        tasks = []
        start = time.perf_counter()
        for i in range(int(rate * seconds)):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(urls[i % len(urls)])))
        await asyncio.gather(*tasks)
    return latencies


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) >= 100 else max(values)


async def main_async(args: argparse.Namespace) -> None:
    procs = []
    try:
        worker_urls = []
        for _ in range(args.workers):
            port = free_port()
            procs.append(subprocess.Popen([sys.executable, "-c", STUB, str(port)]))
            worker_urls.append(f"http://127.0.0.1:{port}")
        router_port = free_port()
        router_cmd = [
            sys.executable, "-m", "sovereign_runtime", "router", "--host", "127.0.0.1", "--port", str(router_port),
            "--policy", args.policy, "--worker", *worker_urls,
        ]  # fmt: skip
        procs.append(subprocess.Popen(router_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for url in worker_urls:
            await wait_ready(url + "/health/ready")
        router_url = f"http://127.0.0.1:{router_port}"
        await wait_ready(router_url + "/health/ready")
        direct: list[float] = []
        routed: list[float] = []
        await phase([u + "/v1/completions" for u in worker_urls], args.rate, 1)  # warm-up
        await phase([router_url + "/v1/completions"], args.rate, 1)
        for _ in range(args.rounds):
            direct += await phase([u + "/v1/completions" for u in worker_urls], args.rate, args.seconds)
            routed += await phase([router_url + "/v1/completions"], args.rate, args.seconds)
        print(
            f"requests per path: {len(direct)} at {args.rate:g}/s, {args.workers} stub workers, policy {args.policy}"
        )
        print("| path | p50 ms | p99 ms |")
        print("| --- | --- | --- |")
        for name, values in (("direct", direct), ("through router", routed)):
            print(f"| {name} | {statistics.median(values) * 1e3:.2f} | {pct(values, 99) * 1e3:.2f} |")
        print(
            f"| added by the router | {(statistics.median(routed) - statistics.median(direct)) * 1e3:.2f} | "
            f"{(pct(routed, 99) - pct(direct, 99)) * 1e3:.2f} |"
        )
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rate", type=float, default=100)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--policy", default="cache-aware")
    args = parser.parse_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
