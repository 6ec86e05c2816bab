"""Router overhead: latency and CPU that `sovereign-runtime router` adds, against `sglang-router` (Rust)
in front of the same instant stub workers, and against calling the workers directly, in the same run.

    python bench/router_overhead.py [--rates 100 200 500] [--seconds 5] [--rounds 3] [--modes plain stream]

The stub workers and both routers run as separate processes (as in a cluster); one client sends
open-loop Poisson arrivals at each rate. In every round each path (direct, ours, sglang-router) gets one
phase per rate and mode, in a rotating order, so all see the same machine load. Latency is the whole
response (the last SSE event for `stream`); "added" is the routed percentile minus the direct one. CPU per
request is the router process tree's user + system time over a phase (/proc), divided by its requests.

The peer is installed on first use into a virtualenv of its own, `.cache/bench/sglang-router-venv`
(`pip install sglang-router`), never into the project's. Bounded: rates × seconds × modes × 3 paths ×
rounds requests in all, on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
PEER_VENV = ROOT / ".cache" / "bench" / "sglang-router-venv"
PEER_PACKAGE = "sglang-router==0.3.2"

# An instant OpenAI-ish worker: the answer (or `tokens` SSE events) written as soon as the body is read.
# It answers the health and info endpoints both routers ask for.
STUB = r"""
import json, sys
from aiohttp import web
tokens = int(sys.argv[2])
body = {"id": "cmpl-stub", "object": "text_completion", "model": "stub",
        "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}}
def event(i):
    chunk = {"id": "cmpl-stub", "object": "text_completion", "model": "stub",
             "choices": [{"index": 0, "text": f" tok{i}", "finish_reason": "stop" if i == tokens - 1 else None}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"
EVENTS = [event(i) for i in range(tokens)]
async def complete(request):
    payload = json.loads(await request.read())
    if not payload.get("stream"):
        return web.json_response(body)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    for e in EVENTS:
        await response.write(e)
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
async def ok(request):
    return web.json_response({"status": "ok"})
async def models(request):
    return web.json_response({"object": "list", "data": [{"id": "stub", "object": "model"}]})
app = web.Application()
app.router.add_post("/v1/completions", complete)
for path in ("/health", "/health/ready", "/health_generate", "/server_info", "/model_info", "/get_server_info",
             "/get_model_info"):
    app.router.add_get(path, ok)
app.router.add_get("/v1/models", models)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""

# Our policies and the peer's closest: with two workers, power-of-two is least-load.
PEER_POLICY = {"cache-aware": "cache_aware", "least-load": "power_of_two", "round-robin": "round_robin"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_peer() -> Path:
    python = PEER_VENV / "bin" / "python"
    if not python.exists():
        print(f"installing {PEER_PACKAGE} into {PEER_VENV}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(PEER_VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", PEER_PACKAGE], check=True)
    return python


def process_tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` and its live descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    total, stack = 0.0, [pid]
    ticks = os.sysconf("SC_CLK_TCK")
    while stack:
        current = stack.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
        stack.extend(children.get(current, []))
    return total


async def wait_ready(url: str, timeout: float = 60) -> None:
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


def prompt(rng: random.Random) -> str:
    """A chat-like prompt: one of 8 shared system prefixes (~200 characters) and a unique question."""
    prefix = f"system {rng.randrange(8)}: you are a helpful assistant who answers briefly. " * 3
    return prefix + f"user: question {rng.getrandbits(48):x} about item {rng.randrange(10_000)}?"


@dataclass
class Phase:
    latencies: list[float]
    cpu_s: float
    requests: int


@dataclass
class Path_:
    name: str
    urls: list[str]
    pid: int | None = None  # the router process whose CPU is counted
    # (rate, mode) -> one phase per round
    phases: dict[tuple[float, str], list[Phase]] = field(default_factory=dict)


async def phase(path: Path_, rate: float, seconds: float, stream: bool, rng: random.Random) -> None:
    latencies: list[float] = []
    failures: list[str] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(url: str, payload: bytes) -> None:
            started = time.perf_counter()
            try:
                async with session.post(
                    url, data=payload, headers={"Content-Type": "application/json"}
                ) as resp:
                    body = await resp.read()
                    if resp.status != 200 or (stream and not body.endswith(b"data: [DONE]\n\n")):
                        failures.append(f"{resp.status} {body[:200]!r}")
                        return
            except aiohttp.ClientError as exc:
                failures.append(repr(exc))
                return
            latencies.append(time.perf_counter() - started)

        count = int(rate * seconds)
        cpu_before = process_tree_cpu_s(path.pid) if path.pid else 0.0
        tasks = []
        due = time.perf_counter()
        for i in range(count):
            due += rng.expovariate(rate)
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            payload = json.dumps(
                {"model": "stub", "prompt": prompt(rng), "max_tokens": 16, "stream": stream}
            ).encode()
            tasks.append(asyncio.create_task(one(path.urls[i % len(path.urls)], payload)))
        await asyncio.gather(*tasks)
        cpu = process_tree_cpu_s(path.pid) - cpu_before if path.pid else 0.0
    if failures:
        raise RuntimeError(f"{path.name}: {len(failures)} of {count} requests failed, e.g. {failures[0]}")
    key = (rate, "stream" if stream else "plain")
    path.phases.setdefault(key, []).append(Phase(latencies, cpu, count))


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) >= 100 else max(values)


def report(direct: Path_, ours: Path_, peer: Path_, args: argparse.Namespace) -> None:
    """Per round, each router's added p50 and p99 (its phase against the direct phase of the same round)
    and CPU per request; printed as medians over rounds, and ours / peer as the median of the per-round
    ratios with their range."""
    print(
        f"\n{ours.name} against {peer.name}: {args.rounds} rounds × {args.seconds:g} s per path, rate and mode; "
        f"{args.workers} stub workers; policy {args.policy} (peer: {PEER_POLICY[args.policy]}); Poisson "
        "arrivals; medians over rounds"
    )
    print(
        f"| rate/s | mode | direct p50 / p99 ms | added p50 ms: {ours.name} / {peer.name} (ratio, range) "
        f"| added p99 ms: same | CPU ms/request: same |"
    )
    print("| --- | --- | --- | --- | --- | --- |")

    def cell(mine: list[float], theirs: list[float], digits: int) -> str:
        ratios = sorted(m / t for m, t in zip(mine, theirs, strict=True) if t > 0)
        spread = f"{statistics.median(ratios):.2f}×, {ratios[0]:.2f}–{ratios[-1]:.2f}" if ratios else "n/a"
        return f"{statistics.median(mine):.{digits}f} / {statistics.median(theirs):.{digits}f} ({spread})"

    for key, direct_phases in direct.phases.items():
        d50 = [statistics.median(ph.latencies) * 1e3 for ph in direct_phases]
        d99 = [pct(ph.latencies, 99) * 1e3 for ph in direct_phases]
        added: dict[str, tuple[list[float], list[float], list[float]]] = {}
        for p in (ours, peer):
            phases = p.phases[key]
            added[p.name] = (
                [statistics.median(ph.latencies) * 1e3 - d for ph, d in zip(phases, d50, strict=True)],
                [pct(ph.latencies, 99) * 1e3 - d for ph, d in zip(phases, d99, strict=True)],
                [ph.cpu_s / ph.requests * 1e3 for ph in phases],
            )
        o, s_ = added[ours.name], added[peer.name]
        print(
            f"| {key[0]:g} | {key[1]} | {statistics.median(d50):.2f} / {statistics.median(d99):.2f} "
            f"| {cell(o[0], s_[0], 2)} | {cell(o[1], s_[1], 2)} | {cell(o[2], s_[2], 3)} |"
        )


async def main_async(args: argparse.Namespace) -> None:
    peer_python = ensure_peer()
    procs: list[subprocess.Popen] = []
    logs = contextlib.ExitStack()
    log_dir = ROOT / ".cache" / "bench"

    def log_file(name: str) -> IO[str]:
        return logs.enter_context(open(log_dir / name, "w"))

    try:
        worker_urls = []
        for i in range(args.workers):
            port = free_port()
            stub = [sys.executable, "-c", STUB, str(port), str(args.stream_tokens)]
            # The peer probes for gRPC (an HTTP/2 preface) before it settles on HTTP: the stub's log says so.
            procs.append(subprocess.Popen(stub, stderr=log_file(f"stub-{i}.log")))
            worker_urls.append(f"http://127.0.0.1:{port}")
        for url in worker_urls:
            await wait_ready(url + "/health")
        ours_port, peer_port, baseline_port = free_port(), free_port(), free_port()

        def start_ours(port: int, log_name: str, source: str | None) -> subprocess.Popen:
            env = dict(os.environ)
            if source:  # another checkout's runtime/ first on the path: its router, not this one
                env["PYTHONPATH"] = os.pathsep.join(filter(None, [source, env.get("PYTHONPATH")]))
            command = [
                sys.executable, "-m", "sovereign_runtime", "router", "--host", "127.0.0.1",
                "--port", str(port), "--policy", args.policy, "--worker", *worker_urls,
            ]  # fmt: skip
            return subprocess.Popen(command, stdout=log_file(log_name), stderr=subprocess.STDOUT, env=env)

        ours = start_ours(ours_port, "router-ours.log", None)
        procs.append(ours)
        baseline = None
        if args.baseline_source:
            baseline = start_ours(baseline_port, "router-baseline.log", args.baseline_source)
            procs.append(baseline)
        peer = subprocess.Popen(
            [
                str(peer_python), "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                "--port", str(peer_port), "--policy", PEER_POLICY[args.policy], "--log-level", "warn",
                "--prometheus-port", str(free_port()), "--worker-urls", *worker_urls,
            ],
            stdout=log_file("router-sglang.log"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        procs.append(peer)
        await wait_ready(f"http://127.0.0.1:{ours_port}/health/ready")
        await wait_ready(f"http://127.0.0.1:{peer_port}/health")
        paths = [
            Path_("direct", [u + "/v1/completions" for u in worker_urls]),
            Path_("ours", [f"http://127.0.0.1:{ours_port}/v1/completions"], ours.pid),
            Path_("sglang-router", [f"http://127.0.0.1:{peer_port}/v1/completions"], peer.pid),
        ]
        if baseline is not None:
            await wait_ready(f"http://127.0.0.1:{baseline_port}/health/ready")
            paths.append(
                Path_("baseline", [f"http://127.0.0.1:{baseline_port}/v1/completions"], baseline.pid)
            )
        rng = random.Random(args.seed)
        modes = [m == "stream" for m in args.modes]
        for p in paths:  # warm-up: connection pools, the routers' first health checks
            for stream in modes:
                await phase(p, min(args.rates), 1, stream, rng)
            p.phases.clear()
        for round_index in range(args.rounds):
            for rate in args.rates:
                for stream in modes:
                    shift = round_index % len(paths)
                    for p in paths[shift:] + paths[:shift]:
                        await phase(p, rate, args.seconds, stream, rng)
            print(f"round {round_index + 1} of {args.rounds} done", flush=True)
        report(paths[0], paths[1], paths[2], args)
        if baseline is not None:
            report(paths[0], paths[3], paths[2], args)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        logs.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rates", type=float, nargs="+", default=[100, 200, 500], metavar="PER_S")
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--modes", nargs="+", choices=["plain", "stream"], default=["plain", "stream"])
    parser.add_argument("--stream-tokens", type=int, default=16, help="SSE events per streamed answer")
    parser.add_argument("--policy", choices=sorted(PEER_POLICY), default="cache-aware")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--baseline-source",
        metavar="DIR",
        help="also measure the router of another checkout (its runtime/ folder, e.g. one made with"
        " `git archive main runtime | tar -x -C DIR`), interleaved as a fourth path, as 'baseline'",
    )
    args = parser.parse_args()
    if args.rounds < 1 or args.seconds <= 0 or any(r <= 0 for r in args.rates):
        parser.error("--rounds, --seconds and --rates must be positive")
    if args.baseline_source:
        # Either the runtime/ folder itself or the folder holding it; anything else would silently
        # measure this checkout's router (installed in the virtualenv) under the baseline's name.
        source = Path(args.baseline_source)
        if (
            not (source / "sovereign_runtime").is_dir()
            and (source / "runtime" / "sovereign_runtime").is_dir()
        ):
            source = source / "runtime"
        if not (source / "sovereign_runtime").is_dir():
            parser.error(
                f"--baseline-source {args.baseline_source}: no sovereign_runtime package in it or in its runtime/"
            )
        args.baseline_source = str(source.resolve())
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
