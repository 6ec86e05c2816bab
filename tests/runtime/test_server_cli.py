"""`sovereign-runtime serve`: flag errors as one line, and a real process that starts, serves, drains on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from server_support import byte_tokenizer_checkpoint, free_port
from sovereign_runtime.assembly import load_runtime
from sovereign_runtime.cli import engine_options, resolve_model
from sovereign_runtime.engine import SamplingParams
from sovereign_runtime.engine.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS
from sovereign_runtime.program import build_parser, main


@pytest.fixture(scope="module")
def checkpoint(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    return byte_tokenizer_checkpoint(tiny_checkpoint_factory, tmp_path_factory.mktemp("cli") / "ckpt")


def _run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["serve"], "--model"),
        (["serve", "--model", "x", "--role", "mixed"], "--role"),
        (["serve", "--model", "x", "--port", "99999"], "--port"),
        (["serve", "--model", "x", "--max-num-seqs", "0"], "--max-num-seqs"),
        (["serve", "--model", "x", "--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
        (["serve", "--model", "x", "--kv-cache-gib", "1", "--num-kv-blocks", "4"], "--num-kv-blocks"),
        (["serve", "--model", "x", "--device", "tpu"], "--device"),
        (["serve", "--model", "x", "--bogus"], "--bogus"),
        (["serve", "--model", "/nonexistent/model"], "not a checkpoint directory"),
        (["serve", "--model", "builtin:no-such-model"], "builtin:no-such-model"),
        (["frobnicate"], "frobnicate"),
        ([], "serve,router"),
    ],
)
def test_bad_flags_exit_nonzero_with_one_line(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _run_main(argv, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], err


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--role", "decode", "--kv-transport", "quic"], "--kv-transport"),
        (["--role", "decode", "--kv-port", "70000"], "--kv-port"),
        (["--role", "prefill", "--kv-transfer-timeout", "0"], "--kv-transfer-timeout"),
    ],
)
def test_disaggregation_flags_are_checked(
    flags: list[str], needle: str, checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _run_main(["serve", "--model", str(checkpoint), *flags], capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and needle in err, err


def test_builtin_model_resolves_through_the_builtin_package() -> None:
    from sovereign_runtime.builtin import resolve_builtin

    assert resolve_model("builtin:sovereign-tiny") == resolve_builtin("sovereign-tiny")


def test_api_key_file_errors(checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _run_main(
        ["serve", "--model", str(checkpoint), "--api-key-file", str(tmp_path / "none")], capsys
    )
    assert code == 2 and "--api-key-file" in err and len(err.strip().splitlines()) == 1
    empty = tmp_path / "empty"
    empty.write_text("\n")
    code, err = _run_main(["serve", "--model", str(checkpoint), "--api-key-file", str(empty)], capsys)
    assert code == 2 and "empty" in err


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--debug-hold-compiling-s", "5"], "--debug-hold-compiling-s is for tests and drills only"),
        (["--inject-fault", "nan_layer=1"], "--inject-fault is for tests and drills only"),
        (["--enable-fault-injection"], "--enable-fault-injection needs --inject-fault SPEC or --debug-hold"),
        (["--enable-fault-injection", "--debug-hold-compiling-s", "0"], "--debug-hold-compiling-s"),
        (["--debug-hold-compiling-cached-s", "1"], "--debug-hold-compiling-cached-s is for tests and drills"),
        (
            ["--enable-fault-injection", "--debug-hold-compiling-cached-s", "1"],
            "--debug-hold-compiling-cached-s shortens the hold of --debug-hold-compiling-s; give both",
        ),
    ],
)
def test_test_only_flags_need_the_explicit_opt_in(
    checkpoint: Path, flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _run_main(["serve", "--model", str(checkpoint), *flags], capsys)
    assert code == 2 and named in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (
            ["--speculative-num-draft-tokens", "2"],
            "--speculative-num-draft-tokens needs --speculative-algorithm",
        ),
        (["--speculative-max-batch-size", "4"], "--speculative-max-batch-size needs --speculative-algorithm"),
        (["--speculative-algorithm", "mtp", "--speculative-num-draft-tokens", "5"], "[1, 4]"),
        (["--speculative-algorithm", "eagle"], "--speculative-algorithm"),
        (["--speculative-algorithm", "mtp", "--speculative-max-batch-size", "-1"], ">= 0"),
        (["--speculative-algorithm", "mtp", "--role", "prefill"], "a prefill instance never decodes"),
    ],
)
def test_bad_speculative_flags_exit_2_naming_the_flag(
    checkpoint: Path, flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _run_main(["serve", "--model", str(checkpoint), *flags], capsys)
    assert code == 2 and named in err and len(err.strip().splitlines()) == 1, err


def test_a_step_token_budget_below_the_batch_is_refused_naming_both_flags(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["serve", "--model", str(checkpoint), "--max-num-seqs", "8", "--max-num-batched-tokens", "4"]
    code, err = _run_main(argv, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--max-num-batched-tokens 4 is below --max-num-seqs 8" in err


def test_the_step_token_budget_reaches_the_scheduler(checkpoint: Path) -> None:
    parse = build_parser(load={"serve"}).parse_args
    default = engine_options(parse(["serve", "--model", str(checkpoint)]), checkpoint, None)
    assert default.max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS
    args = parse(
        ["serve", "--model", str(checkpoint), "--max-num-seqs", "4", "--max-num-batched-tokens", "24"]
    )
    options = engine_options(args, checkpoint, None)
    options.device, options.num_kv_blocks, options.self_test = "cpu", 32, False
    runtime = load_runtime(options, lambda *_: None)
    try:
        core = runtime.engine.engine  # type: ignore[attr-defined]
        assert core.scheduler.config.max_num_batched_tokens == 24
        # A 60-token prompt prefills in chunks of 24, 24 and 12: three steps to its first token.
        core.add_request(list(range(3, 63)), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        steps = 0
        while core.has_unfinished():
            core.step()
            steps += 1
        assert steps == 3
    finally:
        if runtime.close is not None:
            runtime.close()


def _get(url: str, headers: dict[str, str] | None = None, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_serve_process_phases_requests_and_sigterm_drain(checkpoint: Path, tmp_path: Path) -> None:
    port = free_port()
    key = tmp_path / "key"
    key.write_text("k-123\n")
    cmd = [
        sys.executable, "-m", "sovereign_runtime", "serve",
        "--model", str(checkpoint), "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", "tiny", "--device", "cpu", "--max-model-len", "128",
        "--num-kv-blocks", "32", "--max-num-seqs", "4", "--api-key-file", str(key),
        # The test-only hook a real node's startup-probe tests use: 1.5 s in phase compiling.
        "--enable-fault-injection", "--debug-hold-compiling-s", "1.5",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    env.pop("SOVEREIGN_API_KEY", None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        phases: list[str] = []
        held: list[dict[str, Any]] = []
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "never became ready"
            try:
                status, body = _get(base + "/health/startup")
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.05)
                continue
            phases.append(body["phase"])
            if body.get("detail") == "held by --debug-hold-compiling-s (test only)":
                held.append(body)
            if status == 200:
                break
            assert status == 503 and 0.0 <= body["progress"] <= 1.0
            time.sleep(0.02)
        assert phases[-1] == "ready"
        assert set(phases) <= {"loading_weights", "compiling", "warming_up", "self_test", "ready"}
        # Held in compiling with 503 and a progress that rises with the time held.
        assert held and all(b["phase"] == "compiling" for b in held)
        assert held[-1]["progress"] > held[0]["progress"] and held[-1]["elapsed_s"] >= 1.0
        assert _get(base + "/health/ready")[0] == 200
        auth = {"Authorization": "Bearer k-123"}
        assert _get(base + "/v1/models")[0] == 401
        status, body = _get(base + "/v1/models", headers=auth)
        assert status == 200 and body["data"][0]["id"] == "tiny"
        status, body = _get(base + "/v1/completions", headers=auth, body={"prompt": "hi", "max_tokens": 4})
        assert status == 200 and body["usage"]["completion_tokens"] >= 1
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        # kubectl logs shows the drain: who started it, what was in flight, how it ended.
        assert "drain started (SIGTERM): 0 request(s) in flight" in out, out
        assert "drain finished in" in out and "startup held in phase compiling for 1.5 s" in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_generation_config_flag_reads_or_ignores_the_models_file(tmp_path: Path) -> None:
    from sovereign_runtime.cli import sampling_defaults
    from sovereign_runtime.engine.sampling import SamplingDefaults
    from sovereign_runtime.program import UsageError

    parse = build_parser(load={"serve"}).parse_args
    assert parse(["serve", "--model", "m"]).generation_config == "auto"
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "top_p": 0.95}')
    assert sampling_defaults("auto", tmp_path) == SamplingDefaults(temperature=0.6, top_p=0.95)
    assert sampling_defaults("none", tmp_path) == SamplingDefaults()
    (tmp_path / "generation_config.json").write_text('{"top_p": 0}')
    with pytest.raises(UsageError, match=r"top_p.*--generation-config none ignores the file"):
        sampling_defaults("auto", tmp_path)
    assert sampling_defaults("none", tmp_path) == SamplingDefaults()
