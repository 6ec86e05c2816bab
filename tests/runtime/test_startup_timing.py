"""Each startup phase's duration on /health/startup and as metrics: what the operator learns budgets from."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
from server_support import FakeEngine, LiveServer, write_byte_tokenizer
from sovereign_runtime.server import LoadedRuntime, ServerConfig, create_app
from sovereign_runtime.server.state import ServerState, process_start_time
from sovereign_runtime.tokenizer import Tokenizer

MODEL = "tiny-test"


def test_phases_are_timed_from_the_process_start_to_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr("sovereign_runtime.server.state.time.time", lambda: clock[0])
    monkeypatch.setattr("sovereign_runtime.server.state.process_start_time", lambda: 990.0)
    state = ServerState()
    assert state.startup_timing() == {"phase_seconds": {}}
    state.report("loading_weights", 0.0, "starting")  # 10 s after the process started
    clock[0] = 1100.0
    state.report("loading_weights", 0.5, "half")  # same phase: nothing closes
    clock[0] = 1200.0
    state.report("compiling", 0.0, "")
    clock[0] = 1260.0
    state.report("warming_up", 0.0, "")
    clock[0] = 1265.0
    state.report("self_test", 0.0, "")
    clock[0] = 1266.0
    state.report("ready", 1.0, "")
    timing = state.startup_timing()
    assert timing == {
        "phase_seconds": {
            "process": 10.0,
            "loading_weights": 200.0,
            "compiling": 60.0,
            "warming_up": 5.0,
            "self_test": 1.0,
        },
        "startup_seconds": 276.0,
    }
    clock[0] = 5000.0
    state.report("ready", 1.0, "")
    assert state.startup_timing() == timing  # a start is timed once


def test_the_process_start_comes_from_proc() -> None:
    started = process_start_time()
    assert started <= time.time()
    if os.path.exists("/proc/self/stat"):
        # A process started now reports now: its own start, not the boot's, the epoch's or this
        # (possibly hours-long) test session's.
        before = time.time()
        out = subprocess.run(
            [sys.executable, "-c", "from sovereign_runtime.server.state import process_start_time as t; print(t())"],
            capture_output=True, text=True, check=True, timeout=120,
        )  # fmt: skip
        child_started = float(out.stdout)
        assert before - 1 <= child_started <= time.time() + 1, (before, child_started)


def test_health_startup_and_metrics_report_the_durations(tmp_path_factory: pytest.TempPathFactory) -> None:
    tokenizer = Tokenizer.from_dir(write_byte_tokenizer(tmp_path_factory.mktemp("tok")))
    assert tokenizer.eos_token_id is not None
    engine = FakeEngine(script=[65, 66], eos_token_id=tokenizer.eos_token_id)

    def loader(progress: Callable[[str, float, str], None]) -> LoadedRuntime:
        time.sleep(0.2)
        progress("loading_weights", 1.0, "weights loaded")
        return LoadedRuntime(engine=engine, tokenizer=tokenizer, max_model_len=64)

    srv = LiveServer(create_app(ServerConfig(served_model_name=MODEL), loader=loader))
    try:
        deadline = time.monotonic() + 30
        while srv.request("GET", "/health/startup")[0] != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        body = srv.request("GET", "/health/startup")[1]
        phases = body["phase_seconds"]
        assert list(phases) == ["process", "loading_weights", "compiling", "warming_up"]
        assert phases["loading_weights"] >= 0.2
        assert body["startup_seconds"] >= sum(phases.values()) - 0.01
        _, metrics = srv.request("GET", "/metrics")
        assert (
            f'sovereign:startup_phase_duration_seconds{{model_name="{MODEL}",phase="compiling"}}' in metrics
        )
        line = next(x for x in metrics.splitlines() if x.startswith("sovereign:startup_duration_seconds{"))
        assert float(line.rsplit(" ", 1)[1]) == pytest.approx(body["startup_seconds"], abs=0.01)
    finally:
        srv.close()
