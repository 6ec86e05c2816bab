"""The output guard's figures: its decode cost, false positives on clean traffic, the self-test's duration.

    nice -n 10 .venv/bin/python bench/output_guard.py cost [--repeats 10] [--tokens 128]
    nice -n 10 .venv/bin/python bench/output_guard.py cost --interleave step [--repeats 40] [--tokens 128]
    nice -n 10 .venv/bin/python bench/output_guard.py false-positives [--requests 10000] [--self-test-interval 2]
    nice -n 10 .venv/bin/python bench/output_guard.py self-test [--repeats 5]

``cost``: decode tokens/s of one engine with the guard on (finite check on the sampler's sync, per-sequence
isolation in the step) and off (``LLMEngine.set_output_guard(False)``: the same build without them),
single stream and 16 streams, interleaved run by run (alternating which goes first) so load on a shared
host hits both alike; best and median of ``--repeats``. With ``--interleave step`` the guard is switched
every decode step instead, in ABBA order (on, off, off, on, ...), so each pair of neighbouring steps has
the same batch, nearly the same context and the same moment's load: tokens/s of each side from the
summed step times (wall and the thread's CPU time), and the median of the pairs' cost with a bootstrap
95 % interval over ``--repeats`` decodes of ``--tokens`` steps. Load that comes and goes over seconds
(which made two run-level runs disagree by more than 2 %) falls on both sides of every pair.

``false-positives``: clean requests with mixed sampling (greedy, temperature, top-k, top-p, seeds,
logprobs) at batch sizes cycling 1..64, split evenly over five paths:

- unified, in process, on the built-in fp32 model, a random FP8 block-quantised checkpoint and the
  built-in model in bf16: ``max_num_seqs`` cycles through 1..64 and each wave fills the batch; the
  self-test runs on the same engine every 16 waves;
- PD: ``serve --role prefill`` and ``serve --role decode`` processes (built-in model), each request sent
  to the decode with ``kv_transfer_params`` as the router adds them, so the prompt is prefilled on the
  prefill process and its KV sent over TCP; every answer must come from a transfer (``/health/kv``);
- TP 2: one ``serve --tensor-parallel-size 2`` process (a leader and a gloo worker rank).

On the served paths a wave is N concurrent ``/v1/completions`` requests (``--max-num-seqs 64``, so the
wave shares the decode batch) and the servers' own periodic self-test runs every ``--self-test-interval``
seconds meanwhile, as in production (skipped while the engine is saturated; the counts come from
``/metrics``). A request that ends with ``finish_reason == "error"`` or a non-200 answer is a false
positive; so is a self-test that did not pass.

``self-test``: the startup self-test's wall time on ``builtin:sovereign-tiny`` (after warm-up).

Prints Markdown rows; asserts nothing. One torch thread (see bench/runtime_throughput.py for why).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))

from sovereign_runtime.builtin import resolve_builtin  # noqa: E402
from sovereign_runtime.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from sovereign_runtime.engine.sampling import SamplingParams  # noqa: E402
from sovereign_runtime.engine.selftest import SelfTest, SelfTestConfig, SelfTestReport, tiny_known_answers  # noqa: E402

TINY = resolve_builtin("sovereign-tiny")


def _decode_rate(engine: LLMEngine, streams: int, tokens: int, seed: int) -> float:
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompts = [[rng.randrange(2, 100) for _ in range(8)] for _ in range(streams)]
    for p in prompts:
        engine.add_request(p, params)
    # Prefill first (not timed): the figure is decode tokens/s.
    while any(s.num_output_tokens == 0 for s in engine.scheduler.requests.values()):
        engine.step()
    t0 = time.perf_counter()
    produced = 0
    while engine.has_unfinished():
        produced += len(engine.step())
    return produced / (time.perf_counter() - t0)


def _step_pairs(engine: LLMEngine, streams: int, tokens: int, seed: int) -> list[tuple[float, ...]]:
    """One decode of `tokens` steps with the guard switched every step (ABBA): per pair of
    neighbouring steps (on wall, off wall, on CPU, off CPU), seconds."""
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for _ in range(streams):
        engine.add_request([rng.randrange(2, 100) for _ in range(8)], params)
    engine.set_output_guard(True)
    while any(s.num_output_tokens == 0 for s in engine.scheduler.requests.values()):
        engine.step()
    timed: list[tuple[bool, float, float]] = []
    step = 0
    while engine.has_unfinished():
        on = step % 4 in (0, 3)
        engine.set_output_guard(on)
        wall, cpu = time.perf_counter(), time.thread_time()
        produced = len(engine.step())
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        if produced == streams:  # a full batch: the last steps, as sequences finish, are left out
            timed.append((on, wall, cpu))
        step += 1
    engine.set_output_guard(True)
    pairs = []
    for a, b in zip(timed[0::2], timed[1::2], strict=False):
        if a[0] != b[0]:
            on, off = (a, b) if a[0] else (b, a)
            pairs.append((on[1], off[1], on[2], off[2]))
    return pairs


def _bootstrap_median(values: list[float], rounds: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(rounds))
    return medians[int(0.025 * rounds)], medians[int(0.975 * rounds) - 1]


def cost_by_step(engine: LLMEngine, args: argparse.Namespace) -> None:
    print(
        "| streams | steps paired | guard on, tokens/s (wall / CPU) | guard off (wall / CPU) |"
        " cost, wall: summed; median pair [95 % CI] | cost, CPU: summed; median pair [95 % CI] |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for streams in (1, 16):
        pairs: list[tuple[float, ...]] = []
        for r in range(args.repeats):
            pairs += _step_pairs(engine, streams, args.tokens, r)
        cells = []
        for on_i, off_i in ((0, 1), (2, 3)):
            on_s, off_s = sum(p[on_i] for p in pairs), sum(p[off_i] for p in pairs)
            costs = [p[on_i] / p[off_i] - 1 for p in pairs if p[off_i] > 0]
            low, high = _bootstrap_median(costs)
            cells.append(
                (
                    streams * len(pairs) / on_s,
                    streams * len(pairs) / off_s,
                    f"{100 * (on_s / off_s - 1):+.2f} %; {100 * statistics.median(costs):+.2f} %"
                    f" [{100 * low:+.2f}, {100 * high:+.2f}]",
                )
            )
        (wall_on, wall_off, wall_cost), (cpu_on, cpu_off, cpu_cost) = cells
        print(
            f"| {streams} | {len(pairs)} | {wall_on:.1f} / {cpu_on:.1f} | {wall_off:.1f} / {cpu_off:.1f} |"
            f" {wall_cost} | {cpu_cost} |"
        )


def cost(args: argparse.Namespace) -> None:
    engine = LLMEngine.from_pretrained(TINY, EngineConfig(max_num_seqs=16))
    if args.interleave == "step":
        _decode_rate(engine, 4, 16, 0)  # warm
        cost_by_step(engine, args)
        return
    _decode_rate(engine, 4, 16, 0)  # warm
    print(
        "| streams | guard on, tokens/s (best / median) | guard off (best / median) | on / off (best, median) |"
    )
    print("| --- | --- | --- | --- |")
    for streams in (1, 16):
        rates: dict[bool, list[float]] = {True: [], False: []}
        for r in range(args.repeats):
            order = (True, False) if r % 2 == 0 else (False, True)
            for on in order:
                engine.set_output_guard(on)
                rates[on].append(_decode_rate(engine, streams, args.tokens, r))
        engine.set_output_guard(True)
        best = {k: max(v) for k, v in rates.items()}
        med = {k: statistics.median(v) for k, v in rates.items()}
        print(
            f"| {streams} | {best[True]:.1f} / {med[True]:.1f} | {best[False]:.1f} / {med[False]:.1f} |"
            f" {best[True] / best[False]:.4f} / {med[True] / med[False]:.4f} |"
        )


def _mixed_params(rng: random.Random) -> SamplingParams:
    kind = rng.randrange(5)
    tokens = rng.randint(1, 6)
    if kind == 0:
        return SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    if kind == 1:
        return SamplingParams(temperature=0.9, max_tokens=tokens, seed=rng.randrange(1 << 30))
    if kind == 2:
        return SamplingParams(temperature=0.7, top_k=rng.randint(1, 40), max_tokens=tokens)
    if kind == 3:
        return SamplingParams(temperature=1.0, top_p=rng.uniform(0.3, 1.0), max_tokens=tokens, logprobs=2)
    return SamplingParams(temperature=0.0, max_tokens=tokens, logprobs=0, min_tokens=1)


def _params_json(params: SamplingParams) -> dict[str, Any]:
    """The same sampling as ``/v1/completions`` fields."""
    body: dict[str, Any] = {"temperature": params.temperature, "max_tokens": params.max_tokens}
    if params.ignore_eos:
        body["ignore_eos"] = True
    if params.seed is not None:
        body["seed"] = params.seed
    if params.top_k not in (None, 0, -1):
        body["top_k"] = params.top_k
    if params.top_p != 1.0:
        body["top_p"] = params.top_p
    if params.logprobs is not None:
        body["logprobs"] = params.logprobs
    if params.min_tokens:
        body["min_tokens"] = params.min_tokens
    return body


def _in_process_paths() -> list[tuple[str, Path, torch.dtype | None]]:
    sys.path.insert(0, str(ROOT / "tests" / "runtime"))
    from checkpoints import write_tiny_checkpoint

    fp8 = write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "fp8", fp8=True)
    return [
        ("unified fp32 (builtin)", TINY, None),
        ("unified FP8 (random)", fp8, None),
        ("unified bf16 (builtin)", TINY, torch.bfloat16),
    ]


SERVED_PATHS = ("PD: prefill + decode, KV over TCP (builtin)", "TP 2: leader + gloo worker rank (builtin)")


def false_positives(args: argparse.Namespace) -> None:
    from sovereign_runtime.engine.async_engine import AsyncEngine

    print(
        "| path | requests | batch sizes | errors (false positives) | self-tests run / failed (skipped while"
        " saturated) | time, s |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    notes: list[str] = []
    paths = _in_process_paths()
    per_path = args.requests // (len(paths) + len(SERVED_PATHS))
    for label, path, dtype in paths:
        started = time.perf_counter()
        rng = random.Random(14)
        errors = done = 0
        tests = failed = 0
        sizes = list(range(1, 65))
        wave = 0
        while done < per_path:
            size = sizes[wave % len(sizes)]
            wave += 1
            engine = _engine_for(path, dtype, size)
            vocab = engine.vocab_size
            n = min(size, per_path - done)
            for _ in range(n):
                prompt = [rng.randrange(2, vocab) for _ in range(rng.randint(1, 24))]
                engine.add_request(prompt, _mixed_params(rng))
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        done += 1
                        errors += out.finish_reason == "error"
            if wave % 16 == 0:  # the self-test on the same engine, as the periodic one runs
                async_engine = AsyncEngine(engine)
                try:
                    report = asyncio.run(_self_test(SelfTest(async_engine)))
                finally:
                    async_engine.shutdown()
                tests += 1
                failed += not report.ok
        elapsed = time.perf_counter() - started
        print(f"| {label} | {done} | 1..64 | {errors} | {tests} / {failed} | {elapsed:.0f} |")
    for label in SERVED_PATHS:
        with ExitStack() as stack:
            if label.startswith("PD"):
                prefill = stack.enter_context(_serve(args, "--role", "prefill"))
                decode = stack.enter_context(_serve(args, "--role", "decode", "--kv-port", str(_free_port())))
                servers, target, prefill_url = [prefill, decode], decode, prefill
            else:
                target = stack.enter_context(_serve(args, "--tensor-parallel-size", "2"))
                servers, prefill_url = [target], None
            started = time.perf_counter()
            done, errors, samples = asyncio.run(_served_waves(target, prefill_url, per_path))
            elapsed = time.perf_counter() - started
            health = [_self_test_counts(url) for url in servers]
            kv = _get_json(target + "/health/kv") if prefill_url is not None else None
        runs = sum(h["runs"] for h in health)
        failures = sum(h["failures"] for h in health)
        skipped = sum(h["skipped"] for h in health)
        print(
            f"| {label} | {done} | 1..64 | {errors} | {runs} / {failures} ({skipped} skipped) | {elapsed:.0f} |"
        )
        if kv is not None:  # every answer decoded from transferred KV, none prefilled locally
            notes.append(
                f"{label}: decode's /health/kv transfers_ok {kv.get('transfers_ok')}, fallbacks {kv.get('fallbacks')}"
            )
        notes += [f"{label}: error {sample}" for sample in samples]
    print()
    for note in notes:
        print(f"- {note}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get_json(url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return dict(json.loads(resp.read()))
    except urllib.error.HTTPError as err:
        return dict(json.loads(err.read()))


@contextmanager
def _serve(args: argparse.Namespace, *flags: str) -> Iterator[str]:
    """A ``serve`` process (built-in model, one torch thread per rank) until the block ends; its URL."""
    port = _free_port()
    command = [
        sys.executable, "-m", "sovereign_runtime", "serve", "--model", "builtin:sovereign-tiny",
        "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--max-num-seqs", "64",
        "--self-test-interval", str(args.self_test_interval), "--log-level", "WARNING", *flags,
    ]  # fmt: skip
    scratch = tempfile.mkdtemp(prefix="sovereign-guard-bench-")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": scratch, "PYTHONPATH": str(ROOT / "runtime")}
    log = open(Path(scratch) / "serve.log", "wb")  # noqa: SIM115  (closed below, after the process)
    proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(flags)}: serve exited {proc.returncode}: {_tail(scratch)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{' '.join(flags)}: serve not ready in 180 s: {_tail(scratch)}")
            try:
                with urllib.request.urlopen(url + "/health/ready", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.2)
        yield url
    finally:
        os.killpg(proc.pid, 15)  # the serve process and its worker ranks (their own session)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(10)
        log.close()
        shutil.rmtree(scratch, ignore_errors=True)


def _tail(scratch: str) -> str:
    return (Path(scratch) / "serve.log").read_text(errors="replace")[-3000:]


def _self_test_counts(url: str) -> dict[str, int]:
    """Self-tests run (startup and periodic), skipped while saturated, and failed checks, from /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()

    def total(name: str) -> int:
        return int(sum(float(v) for v in re.findall(rf"^{name}_total\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)))

    return {
        "runs": total("sovereign:self_test_runs"),
        "skipped": total("sovereign:self_test_skipped"),
        "failures": total("sovereign:self_test_failures"),
    }


async def _served_waves(url: str, prefill_url: str | None, total: int) -> tuple[int, int, list[str]]:
    """``total`` requests in waves of 1..64 concurrent ones; (finished, errors, the first error texts)."""
    import aiohttp

    rng = random.Random(14)
    vocab = json.loads((TINY / "config.json").read_text())["vocab_size"]
    done = errors = 0
    samples: list[str] = []
    wave = 0
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=128)) as session:

        async def one(body: dict[str, Any]) -> str | None:
            async with session.post(url + "/v1/completions", json=body) as resp:
                answer = await resp.json(content_type=None)
            if resp.status != 200:
                return f"HTTP {resp.status}: {json.dumps(answer)[:300]}"
            reasons = [c.get("finish_reason") for c in answer["choices"]]
            return None if "error" not in reasons else f"finish_reason error: {json.dumps(answer)[:300]}"

        while done < total:
            size = wave % 64 + 1
            wave += 1
            bodies = []
            for _ in range(min(size, total - done)):
                prompt = [rng.randrange(2, vocab) for _ in range(rng.randint(1, 24))]
                body = {
                    "model": "builtin:sovereign-tiny",
                    "prompt": prompt,
                    **_params_json(_mixed_params(rng)),
                }
                if prefill_url is not None:  # what the router adds for a pair
                    body["kv_transfer_params"] = {
                        "prefill_url": prefill_url,
                        "room": f"fp{done + len(bodies)}",
                    }
                bodies.append(body)
            for problem in await asyncio.gather(*(one(b) for b in bodies)):
                done += 1
                if problem is not None:
                    errors += 1
                    if len(samples) < 3:
                        samples.append(problem)
    return done, errors, samples


_ENGINES: dict[tuple[str, str, int], LLMEngine] = {}


def _engine_for(path: Path, dtype: torch.dtype | None, size: int) -> LLMEngine:
    # One model per path; the batch size is the scheduler's max_num_seqs, so each wave fills it.
    key = (str(path), str(dtype), 0)
    if key not in _ENGINES:
        _ENGINES[key] = LLMEngine.from_pretrained(path, EngineConfig(max_num_seqs=64, dtype=dtype))
    engine = _ENGINES[key]
    engine.scheduler.config.max_num_seqs = size
    return engine


async def _self_test(test: SelfTest) -> SelfTestReport:
    return await test.run()


def self_test(args: argparse.Namespace) -> None:
    from sovereign_runtime.engine.async_engine import AsyncEngine
    from sovereign_runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(TINY)
    durations = []
    for _ in range(args.repeats):
        engine = AsyncEngine(LLMEngine.from_pretrained(TINY, EngineConfig()))
        try:
            test = SelfTest(engine, SelfTestConfig(known_answers=tiny_known_answers(tokenizer)))
            test.take_fingerprint()
            report = asyncio.run(_self_test(test))
            assert report.ok, report.to_json()
            durations.append(report.duration_s)
        finally:
            engine.shutdown()
    print("| figure | median | min | max |")
    print("| --- | --- | --- | --- |")
    print(
        f"| startup self-test, s (builtin:sovereign-tiny, {args.repeats} runs) | {statistics.median(durations):.3f}"
        f" | {min(durations):.3f} | {max(durations):.3f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="figure", required=True)
    c = sub.add_parser("cost")
    c.add_argument("--repeats", type=int, default=10)
    c.add_argument("--tokens", type=int, default=128)
    c.add_argument(
        "--interleave",
        choices=("run", "step"),
        default="run",
        help="switch the guard between whole decodes (run) or every decode step (step, ABBA)",
    )
    f = sub.add_parser("false-positives")
    f.add_argument("--requests", type=int, default=10_000, help="over all five paths, split evenly")
    f.add_argument(
        "--self-test-interval", type=float, default=2.0, help="the served paths' periodic self-test, seconds"
    )
    s = sub.add_parser("self-test")
    s.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    {"cost": cost, "false-positives": false_positives, "self-test": self_test}[args.figure](args)


if __name__ == "__main__":
    main()
