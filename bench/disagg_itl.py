"""The case for disaggregation, measured: steady decode streams while long prompts arrive.

    python bench/disagg_itl.py [--seconds 20] [--streams 4] [--lengths 512,1024,2048] [--step-budget 512]

Two setups on the same two cores, each behind the router, run one after the other in this process:

- unified: two `serve --role unified` instances (one pinned per core with `taskset -c`), router
  `--worker` least-load: long prompts are chunk-prefilled next to the running streams;
- disaggregated: `serve --role prefill` on core 0, `serve --role decode` on core 1 (TCP KV transfer),
  router `--prefill/--decode` with `--disaggregation-threshold 0`.

The load is the same: `--streams` streaming requests that each decode `--stream-tokens` tokens (a new
one starts when one ends) plus, every `--interval` s, one long prompt of each length in turn (2 new
tokens). Reported: inter-token latency p50/p99 of the steady streams (gaps between SSE events at the
client) and time to first token of the long prompts per length, with the disaggregated/unified ratio.
The model is a random DeepSeek-V3-shaped checkpoint (4 layers, hidden 256, latent 64+8, 4k context)
with a byte tokenizer (one token per character), written to a temporary directory. The router and
this client are not pinned (there are only two cores): they share the cores with the instances.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "runtime"))
BIN = Path(sys.executable).parent / "sovereign-runtime"
MODEL = "bench"


def write_checkpoint(directory: Path) -> Path:
    from checkpoints import write_tiny_checkpoint  # the tests' tiny random checkpoint writer
    from server_support import write_byte_tokenizer

    write_tiny_checkpoint(
        directory,
        vocab_size=262,
        bos_token_id=256,
        eos_token_id=257,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_attention_heads=8,
        num_key_value_heads=8,
        kv_lora_rank=64,
        num_hidden_layers=4,
        max_position_embeddings=4096,
    )
    write_byte_tokenizer(directory)
    return directory


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not become ready")
        time.sleep(0.3)


class Setup:
    def __init__(self, kind: str, checkpoint: Path, step_budget: int) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        serve = [
            str(BIN),
            "serve",
            "--model",
            str(checkpoint),
            "--served-model-name",
            MODEL,
            "--host",
            "127.0.0.1",
        ]
        serve += ["--max-model-len", "4096", "--num-kv-blocks", "1024", "--max-num-seqs", "16"]
        serve += ["--max-num-batched-tokens", str(step_budget)]
        urls = []
        roles = ["unified", "unified"] if kind == "unified" else ["prefill", "decode"]
        for core, role in enumerate(roles):
            port = free_port()
            cmd = ["taskset", "-c", str(core), *serve, "--port", str(port), "--role", role]
            cmd += ["--kv-port", str(free_port())]
            self.procs.append(
                subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
            urls.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(urls, self.procs, strict=True):
            wait_ready(url + "/health/ready", proc)
        rport = free_port()
        router = [str(BIN), "router", "--host", "127.0.0.1", "--port", str(rport), "--health-interval", "60"]
        if kind == "unified":
            router += ["--policy", "least-load", "--worker", *urls]
        else:
            router += ["--prefill", urls[0], "--decode", urls[1], "--disaggregation-threshold", "0"]
        self.procs.append(
            subprocess.Popen(router, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )
        self.url = f"http://127.0.0.1:{rport}"
        wait_ready(self.url + "/health", self.procs[-1])

    def close(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


async def stream_times(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int) -> list[float]:
    """Arrival times (perf_counter) of the token events of one streamed completion; [0] is the send time."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    times = [time.perf_counter()]
    async with session.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if line.startswith(b"data: {") and b'"choices": [{' in line:
                times.append(time.perf_counter())
    return times


async def run_load(url: str, args: argparse.Namespace) -> tuple[list[float], dict[int, list[float]]]:
    gaps: list[float] = []
    ttft: dict[int, list[float]] = {n: [] for n in args.lengths}
    end = time.perf_counter() + args.seconds
    timeout = aiohttp.ClientTimeout(total=args.seconds + 120)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def steady(i: int) -> None:
            k = 0
            while time.perf_counter() < end:
                times = await stream_times(session, url, f"stream {i}.{k}: tell me more ", args.stream_tokens)
                gaps.extend(b - a for a, b in itertools.pairwise(times[1:]))
                k += 1

        async def long_prompts() -> None:
            k = 0
            await asyncio.sleep(1.0)  # streams are running first
            while time.perf_counter() < end - args.interval:
                n = args.lengths[k % len(args.lengths)]
                prompt = (f"document {k}: " + "lorem ipsum dolor sit amet " * (n // 27 + 1))[:n]
                times = await stream_times(session, url, prompt, 2)
                ttft[n].append(times[1] - times[0])
                k += 1
                await asyncio.sleep(args.interval)

        await asyncio.gather(*(steady(i) for i in range(args.streams)), long_prompts())
    return gaps, ttft


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--stream-tokens", type=int, default=64)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[512, 1024, 2048])
    # 512: what the first figures in docs/BENCHMARKS.md were measured with (serve's default until
    # 2026-12-07, now 2048); a larger budget prefills in fewer, longer steps beside the unified streams.
    parser.add_argument("--step-budget", type=int, default=512, help="serve --max-num-batched-tokens")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = write_checkpoint(Path(tmp) / "ckpt")
        for kind in ("unified", "disaggregated"):
            setup = Setup(kind, checkpoint, args.step_budget)
            try:
                results[kind] = asyncio.run(run_load(setup.url, args))
            finally:
                setup.close()
    u_gaps, u_ttft = results["unified"]
    d_gaps, d_ttft = results["disaggregated"]
    print(f"{args.streams} steady streams x {args.stream_tokens} tokens, long prompts {args.lengths} every "
          f"{args.interval:g} s, {args.seconds:g} s per setup")  # fmt: skip
    print("| metric | unified pool (2 x unified) | disaggregated (prefill + decode) | disagg / unified |")
    print("| --- | --- | --- | --- |")
    for name, q in (("ITL p50 ms", 0.5), ("ITL p99 ms", 0.99)):
        u, d = pct(u_gaps, q) * 1e3, pct(d_gaps, q) * 1e3
        print(f"| {name} ({len(u_gaps)} / {len(d_gaps)} gaps) | {u:.1f} | {d:.1f} | {d / u:.2f} |")
    for n in args.lengths:
        u, d = statistics.median(u_ttft[n]) * 1e3, statistics.median(d_ttft[n]) * 1e3
        print(
            f"| TTFT median ms, {n}-token prompt ({len(u_ttft[n])} / {len(d_ttft[n])}) | {u:.0f} | {d:.0f} | {d / u:.2f} |"
        )
    print(json.dumps({"unified_gaps": len(u_gaps), "disagg_gaps": len(d_gaps)}))


if __name__ == "__main__":
    main()
