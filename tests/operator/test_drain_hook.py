"""The rendered preStop hook, run as the kubelet runs it, against stub runtimes on loopback.

Whatever the runtime does (drains, stays busy, hangs, refuses the drain), the hook must end within
`PRESTOP_OVERRUN_SECONDS` of the budget it is given, so the pod's `terminationGracePeriodSeconds`
(budget + EXIT_GRACE_SECONDS) always leaves the runtime time to exit after SIGTERM.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from operator_specs import TINY_SPEC, with_changes
from sovereign_operator.api import LLMDeploymentSpec
from sovereign_operator.render import DeploymentRef, render
from sovereign_operator.render.children import EXIT_GRACE_SECONDS, PRESTOP_OVERRUN_SECONDS

POD_BASE = "http://127.0.0.1:8000"  # the address the rendered hook talks to inside the pod


def _pod(drain_seconds: int) -> dict[str, Any]:
    spec = LLMDeploymentSpec.model_validate(
        with_changes(TINY_SPEC, runtime={"drainTimeoutSeconds": drain_seconds})
    )
    rendered = render(DeploymentRef("llm", "ns", "uid"), spec)
    (sts,) = [c for c in rendered.children if c["kind"] == "StatefulSet"]
    return sts["spec"]["template"]["spec"]  # type: ignore[no-any-return]


class StubRuntime:
    """/drain and /metrics as the runtime serves them; `mode` picks the behaviour."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.drain_calls = 0
        self.metrics_calls = 0

    def handler(self) -> type[BaseHTTPRequestHandler]:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self, code: int, body: str) -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

            def do_POST(self) -> None:
                stub.drain_calls += 1
                if stub.mode == "hangs":
                    time.sleep(30)
                if stub.mode == "refuses":
                    self._answer(401, '{"error": {"message": "invalid or missing API key"}}')
                    return
                self._answer(202, '{"status": "draining"}')

            def do_GET(self) -> None:
                stub.metrics_calls += 1
                running = 0 if stub.mode == "drains" and stub.metrics_calls > 1 else 1
                self._answer(
                    200,
                    f'vllm:num_requests_running{{model_name="m"}} {running}.0\n'
                    'vllm:num_requests_waiting{model_name="m"} 0.0\n',
                )

        return Handler


@contextmanager
def stub_runtime(mode: str) -> Iterator[tuple[str, StubRuntime]]:
    stub = StubRuntime(mode)
    server = ThreadingHTTPServer(("127.0.0.1", 0), stub.handler())
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", stub
    finally:
        server.shutdown()
        server.server_close()


def _run_hook(pod: dict[str, Any], url: str) -> tuple[int, str, float]:
    command = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["python3", "-c"] and command[2].count(POD_BASE) == 1
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", command[2].replace(POD_BASE, url), *command[3:]],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - started


@pytest.mark.parametrize("mode", ["busy", "hangs"])
def test_the_hook_ends_within_its_budget_whatever_the_runtime_does(mode: str) -> None:
    budget = 2
    pod = _pod(budget)
    assert pod["terminationGracePeriodSeconds"] == budget + EXIT_GRACE_SECONDS
    assert PRESTOP_OVERRUN_SECONDS < EXIT_GRACE_SECONDS
    with stub_runtime(mode) as (url, stub):
        code, output, took = _run_hook(pod, url)
    assert code == 0, output
    assert stub.drain_calls == 1
    # Busy all along: it waited the whole budget, and not past it by more than the overrun.
    assert budget - 0.2 <= took < budget + PRESTOP_OVERRUN_SECONDS, took
    if mode == "busy":
        assert stub.metrics_calls >= 2


def test_the_hook_returns_as_soon_as_nothing_runs() -> None:
    with stub_runtime("drains") as (url, stub):
        code, output, took = _run_hook(_pod(60), url)
    assert code == 0, output
    assert stub.metrics_calls == 2 and took < 10


def test_a_refused_drain_fails_the_hook_with_the_runtimes_answer() -> None:
    # The kubelet turns a failing hook into a FailedPreStopHook event carrying this output.
    with stub_runtime("refuses") as (url, _):
        code, output, took = _run_hook(_pod(60), url)
    assert code == 1 and "POST /drain answered 401" in output and "API key" in output
    assert took < 10


def test_nothing_listening_means_nothing_to_drain() -> None:
    with stub_runtime("busy") as (url, _):
        pass  # the server is gone: the port refuses connections
    code, output, took = _run_hook(_pod(60), url)
    assert code == 0 and took < 10, output
