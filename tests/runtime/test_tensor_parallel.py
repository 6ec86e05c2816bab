"""Parallel serving on one node (CPU, gloo): sharded and staged logits equal one rank's, the server's greedy
answers equal the single-process server's (unified, and as a prefill/decode pair), KV rows written through
the leader land in every rank's cache, bad sizes are refused, and no rank outlives the node's first.
tests/runtime/test_multinode.py runs groups over several "hosts"."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from server_support import free_port, write_byte_tokenizer
from sovereign_runtime.builtin.tasks import check_answer, make_questions
from sovereign_runtime.model import Fp8Linear, load_model
from sovereign_runtime.model.config import ModelConfig
from sovereign_runtime.model.parallel import TensorParallel, tensor_parallel_problem
from sovereign_runtime.program import main
from tp_support import ROW_CACHE_SHAPE, ROW_DTYPES, ROW_WRITES, run_scenario

HERE = Path(__file__).parent
BUILTIN = "builtin:sovereign-tiny"
# One thread per process: the tests start several processes on a small shared machine.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


# ---- refusals ---------------------------------------------------------------------------------------


def test_problem_names_the_dims_that_must_divide_and_the_valid_sizes(tiny_checkpoint: Path) -> None:
    config = ModelConfig.from_pretrained(tiny_checkpoint)  # 4 heads, intermediate 128, experts 32 wide
    assert tensor_parallel_problem(config, 1) is None
    assert tensor_parallel_problem(config, 2) is None
    assert tensor_parallel_problem(config, 4) is None
    problem = tensor_parallel_problem(config, 3)
    assert problem is not None
    assert "--tensor-parallel-size 3" in problem
    assert "num_attention_heads (4)" in problem and "moe_intermediate_size (32)" in problem
    assert problem.endswith("valid sizes for this model: 1, 2, 4")
    assert "valid sizes for this model: 1, 2, 4" in (tensor_parallel_problem(config, 8) or "")


@pytest.mark.parametrize(
    ("flags", "env", "needle"),
    [
        (["--tensor-parallel-size", "3"], {}, "valid sizes for this model: 1, 2, 4"),
        (["--tensor-parallel-size", "8"], {}, "must divide num_attention_heads (4)"),
        (["--tensor-parallel-size", "2", "--device", "cuda"], {}, "need 2 CUDA devices"),
        (["--tensor-parallel-size", "0"], {}, "--tensor-parallel-size"),
        (["--pipeline-parallel-size", "4"], {}, "--pipeline-parallel-size 4: the model has 3 decoder layers"),
        (["--tensor-parallel-size", "2", "--nnodes", "3"], {}, "cannot be split evenly over --nnodes 3"),
        (["--pipeline-parallel-size", "2", "--nnodes", "2"], {}, "needs --leader-address HOST[:PORT]"),
        (["--nnodes", "2", "--node-rank", "2", "--leader-address", "h"], {}, "--node-rank 2 must be below"),
        (["--pipeline-parallel-size", "2", "--leader-address", "h:x"], {}, "the port must be a number"),
        (
            ["--nnodes", "2", "--pipeline-parallel-size", "2"],
            {"LWS_GROUP_SIZE": "3"},
            "contradicts $LWS_GROUP_SIZE",
        ),
        (["--pipeline-parallel-size", "2"], {"LWS_GROUP_SIZE": "two"}, "$LWS_GROUP_SIZE='two'"),
    ],
)
def test_serve_refuses_a_layout_it_cannot_run_with_exit_2(
    flags: list[str],
    env: dict[str, str],
    needle: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if "cuda" in flags and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has 2 CUDA devices, so TP 2 on CUDA is valid here")
    for name in ("LWS_GROUP_SIZE", "LWS_WORKER_INDEX", "LWS_LEADER_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code = main(["serve", "--model", BUILTIN, *flags])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], err


# ---- sharded loading --------------------------------------------------------------------------------


def test_fp8_shards_of_whole_blocks_stay_e4m3_and_others_are_split_dense(
    tiny_checkpoint_factory: Callable[..., Path],
) -> None:
    # 256-wide MLPs split into 128-row slices (whole FP8 blocks) at TP 2; the 4 heads' 96 query rows
    # split into 48 rows, which are not, so attention falls back to dequantise-then-split.
    path = tiny_checkpoint_factory(fp8=True, intermediate_size=256, moe_intermediate_size=256, mtp=False)
    whole, _ = load_model(path, "cpu", keep_fp8=True)
    ranks = [load_model(path, "cpu", keep_fp8=True, tensor_parallel=TensorParallel(r, 2))[0] for r in (0, 1)]

    def dense(model: torch.nn.Module, name: str) -> torch.Tensor:
        module = model.get_submodule(name)
        return module.dense_weight(torch.float32) if isinstance(module, Fp8Linear) else module.weight

    cases = {
        "model.layers.0.mlp.gate_proj": (0, True),
        "model.layers.0.mlp.down_proj": (1, True),
        "model.layers.1.mlp.experts.3.up_proj": (0, True),
        "model.layers.1.mlp.shared_experts.down_proj": (1, True),
        "model.layers.1.self_attn.q_b_proj": (0, False),
        "model.layers.1.self_attn.kv_b_proj": (0, False),
        "model.layers.1.self_attn.o_proj": (1, False),
    }
    for name, (dim, stays_fp8) in cases.items():
        assert isinstance(whole.get_submodule(name), Fp8Linear), name
        for model in ranks:
            assert isinstance(model.get_submodule(name), Fp8Linear) == stays_fp8, name
        joined = torch.cat([dense(model, name) for model in ranks], dim=dim)
        assert torch.equal(joined, dense(whole, name)), name
    # Replicated FP8 weights stay whole and e4m3 on every rank.
    for model in ranks:
        replicated = model.get_submodule("model.layers.1.self_attn.kv_a_proj_with_mqa")
        assert isinstance(replicated, Fp8Linear)
        assert torch.equal(replicated.weight, whole.model.layers[1].self_attn.kv_a_proj_with_mqa.weight)


# ---- sharded forward: every step's logits against one rank ------------------------------------------


@pytest.mark.parametrize(
    ("variant", "tp", "pp"),
    [("q_lora", 2, 1), ("q_lora", 4, 1), ("no_q_lora", 2, 1), ("fp8", 2, 1), ("q_lora", 1, 3), ("fp8", 2, 2)],
)
def test_sharded_logits_and_greedy_tokens_equal_one_rank(
    variant: str,
    tp: int,
    pp: int,
    tiny_checkpoint_factory: Callable[..., Path],
    tmp_path: Path,
) -> None:
    # Pipeline stages run the step as micro-batches of whole sequences (one per stage): the logits of
    # every row still equal one rank's.
    options = {"q_lora": {}, "no_q_lora": {"q_lora_rank": None}, "fp8": {"fp8": True}}[variant]
    # Workers resolve --model as serve does, which wants a tokenizer next to the weights.
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint_factory(**options), checkpoint)
    write_byte_tokenizer(checkpoint)
    expected = run_scenario(load_model(checkpoint, "cpu")[0])

    out = tmp_path / "tp.pt"
    script = [sys.executable, str(HERE / "tp_support.py"), str(checkpoint), str(tp), str(pp), str(out)]
    done = subprocess.run(script, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    got = torch.load(out)
    for step in ("prefill", "decode", "mixed"):
        torch.testing.assert_close(got[step], expected[step], rtol=1e-5, atol=1e-4, msg=step)
    assert got["greedy"] == expected["greedy"]


# ---- KV rows written outside a forward (the decode role's received rows) ----------------------------


def test_rows_written_through_the_leader_land_identically_in_the_worker_cache(tmp_path: Path) -> None:
    port = free_port()
    outs = [tmp_path / f"rank{rank}.pt" for rank in (0, 1)]
    ranks = [
        subprocess.Popen(
            [sys.executable, str(HERE / "tp_support.py"), "rows", str(rank), str(port), str(out)],
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank, out in enumerate(outs)
    ]
    try:
        for proc in ranks:
            output, _ = proc.communicate(timeout=60)
            assert proc.returncode == 0, output[-4000:]
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    leader, worker = (torch.load(out) for out in outs)
    assert [c.dtype for c in worker["caches"]] == list(ROW_DTYPES)
    written = iter(leader["written"])
    for dtype, leader_cache, worker_cache in zip(ROW_DTYPES, leader["caches"], worker["caches"], strict=True):
        # Built on the bytes: float8 has no indexed assignment on the CPU.
        expected = torch.zeros(ROW_CACHE_SHAPE, dtype=dtype)
        _, blocks, block_size, width = ROW_CACHE_SHAPE
        for layer, slot_list in ROW_WRITES:
            rows = next(written).view(torch.uint8)
            expected[layer].view(blocks * block_size, width).view(torch.uint8)[list(slot_list)] = rows
        assert expected.view(torch.uint8).count_nonzero() > 0
        # Bit for bit (float8 has no equality kernels everywhere: compare the bytes).
        assert torch.equal(leader_cache.view(torch.uint8), expected.view(torch.uint8)), dtype
        assert torch.equal(worker_cache.view(torch.uint8), expected.view(torch.uint8)), dtype


# ---- the server -------------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # Field 4 (after the parenthesised command, which may hold spaces) is the parent pid.
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


@contextmanager
def _server(tensor_parallel_size: int, *flags: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    port = free_port()
    cmd = [
        sys.executable, "-m", "sovereign_runtime", "serve", "--model", BUILTIN,
        "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--num-kv-blocks", "64",
        "--max-num-seqs", "4", "--tensor-parallel-size", str(tensor_parallel_size), *flags,
    ]  # fmt: skip
    # A scratch TMPDIR of the server's own (torch's and the ranks' temporary files), removed after.
    scratch = tempfile.mkdtemp(prefix="sovereign-tp-test-")
    env = {**ENV, "TMPDIR": scratch}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    workers: list[int] = []
    try:
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        workers = _children(proc.pid)
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)
        for pid in _wait_gone(workers, 10):  # never leave a stray process behind, even on failure
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(scratch, ignore_errors=True)


def _wait_ready(proc: subprocess.Popen[str], base: str) -> None:
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        assert time.monotonic() < deadline, "never became ready"
        try:
            with urllib.request.urlopen(base + "/health/ready", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.1)


def _chat(base: str, prompt: str, **extra: object) -> str:
    body = {
        "model": BUILTIN,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": 64,
        **extra,
    }
    request = urllib.request.Request(
        base + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        return str(json.loads(resp.read())["choices"][0]["message"]["content"])


def _wait_workers(proc: subprocess.Popen[str], count: int) -> list[int]:
    deadline = time.monotonic() + 10
    while len(workers := _children(proc.pid)) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    return workers


_NUMBER_SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["n"],
    "additionalProperties": False,
}


def test_tp2_server_answers_as_tp1_does_and_sigterm_stops_its_worker() -> None:
    # The built-in model splits by 2: 4 heads, intermediate 384, experts 128 wide.
    questions = make_questions(4, seed=11)
    with _server(1) as (single, single_url), _server(2) as (sharded, sharded_url):
        _wait_ready(single, single_url)
        _wait_ready(sharded, sharded_url)
        workers = _wait_workers(sharded, 1)
        assert len(workers) == 1, workers
        for q in questions:
            answer = _chat(sharded_url, q.prompt)
            assert answer == _chat(single_url, q.prompt), q.prompt
            assert check_answer(q, answer), (q.prompt, answer)
        # The leader samples, so its grammar masks hold for the whole group.
        fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": _NUMBER_SCHEMA}}
        constrained = _chat(sharded_url, questions[0].prompt, response_format=fmt, max_tokens=120)
        assert constrained == _chat(single_url, questions[0].prompt, response_format=fmt, max_tokens=120)
        assert isinstance(json.loads(constrained)["n"], int), constrained
        sharded.send_signal(signal.SIGTERM)
        out, _ = sharded.communicate(timeout=30)
        assert sharded.returncode == 0, out[-4000:]
        assert _wait_gone(workers, 5) == []


def _kv_health(base: str) -> dict[str, object]:
    with urllib.request.urlopen(base + "/health/kv", timeout=10) as resp:
        return dict(json.loads(resp.read()))


def test_tp2_prefill_and_decode_pair_answers_as_tp1_unified_does() -> None:
    questions = make_questions(3, seed=5)
    decode_flags = ["--role", "decode", "--kv-port", str(free_port())]
    with (
        _server(1) as (single, single_url),
        _server(2, "--role", "prefill") as (prefill, prefill_url),
        _server(2, *decode_flags) as (decode, decode_url),
    ):
        for proc, url in ((single, single_url), (prefill, prefill_url), (decode, decode_url)):
            _wait_ready(proc, url)
        workers = _wait_workers(prefill, 1) + _wait_workers(decode, 1)
        assert len(workers) == 2, workers
        for number, q in enumerate(questions):
            # What the router adds: the decode fetches the prompt's KV from the prefill, then decodes.
            params = {"prefill_url": prefill_url, "room": f"tp2room{number}"}
            answer = _chat(decode_url, q.prompt, kv_transfer_params=params)
            assert answer == _chat(single_url, q.prompt), q.prompt
            assert check_answer(q, answer), (q.prompt, answer)
        # Every answer decoded from transferred KV (none prefilled locally after a failed transfer).
        decode_health, prefill_health = _kv_health(decode_url), _kv_health(prefill_url)
        assert decode_health["transfers_ok"] == len(questions) and decode_health["fallbacks"] == 0, (
            decode_health
        )
        assert decode_health["tokens"] > 0, decode_health  # type: ignore[operator]
        assert prefill_health["transfers_ok"] == len(questions), prefill_health
        for proc in (prefill, decode):
            proc.send_signal(signal.SIGTERM)
        for proc in (prefill, decode):
            out, _ = proc.communicate(timeout=30)
            assert proc.returncode == 0, out[-4000:]
        assert _wait_gone(workers, 5) == []


def test_killing_rank0_leaves_no_worker_behind() -> None:
    with _server(2) as (proc, base):
        _wait_ready(proc, base)
        workers = _wait_workers(proc, 1)
        assert len(workers) == 1, workers
        proc.kill()  # SIGKILL: no cleanup runs in rank 0
        proc.communicate(timeout=30)
        assert _wait_gone(workers, 10) == []


def test_a_worker_crash_makes_rank0_exit_nonzero() -> None:
    with _server(2) as (proc, base):
        _wait_ready(proc, base)
        workers = _wait_workers(proc, 1)
        assert len(workers) == 1, workers
        os.kill(workers[0], signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 1, out[-4000:]
        assert "parallel group failed: rank 1 (pid" in out and "exited with status -9" in out, out[-4000:]


def test_tp2_with_mtp_speculation_answers_as_tp1_without_it() -> None:
    # The MTP layer is sharded like a decoder layer: its forwards are broadcast to the worker too.
    questions = make_questions(3, seed=13)
    spec = ["--speculative-algorithm", "mtp", "--speculative-num-draft-tokens", "2"]
    with _server(1) as (single, single_url), _server(2, *spec) as (sharded, sharded_url):
        _wait_ready(single, single_url)
        _wait_ready(sharded, sharded_url)
        for q in questions:
            assert _chat(sharded_url, q.prompt) == _chat(single_url, q.prompt), q.prompt
        with urllib.request.urlopen(sharded_url + "/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        accepted = next(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("sovereign:spec_decode_num_accepted_tokens_total{")
        )
        assert accepted > 0, metrics
        sharded.send_signal(signal.SIGTERM)
        out, _ = sharded.communicate(timeout=30)
        assert sharded.returncode == 0, out[-4000:]
