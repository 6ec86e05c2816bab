"""Server lifecycle: startup phases, readiness, drain bookkeeping. No HTTP here."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..engine.api import EngineStats, RequestOutput
from ..engine.sampling import SamplingParams
from ..tokenizer import Tokenizer

log = logging.getLogger("sovereign_runtime.server")

ProgressFn = Callable[[str, float, str], None]
# Phases whose durations /health/startup and the metrics report, in order: "process" runs from the
# process's own start (interpreter, imports, binding the port) until loading begins.
TIMED_PHASES = ("process", "joining_group", "loading_weights", "compiling", "warming_up", "self_test")


def process_start_time() -> float:
    """When this process started (Unix seconds), from /proc; the import time of this module elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            # Field 22 (after the parenthesised command, which may contain spaces): start time in ticks.
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED_AT


_IMPORTED_AT = time.time()


class EngineLike(Protocol):
    """What the server needs from ``engine.async_engine.AsyncEngine`` (docs/CONTRACTS.md), in the engine's
    own torch-free types: closing the generator early aborts the request."""

    def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        raise NotImplementedError

    def stats(self) -> EngineStats:
        raise NotImplementedError


@dataclass
class LoadedRuntime:
    engine: EngineLike
    tokenizer: Tokenizer
    max_model_len: int
    # Optional coroutine function run on the event loop after loading (e.g. engine.start()).
    on_loop_start: Callable[[], Any] | None = None
    # Optional release hook called at shutdown (e.g. engine.shutdown()).
    close: Callable[[], Any] | None = None
    # Optional output self-test: a coroutine function returning a report's JSON (``passed``,
    # ``failing_check``, ``reason``, ``checks``), and whether real requests saturate the engine now.
    self_test: Callable[[], Awaitable[dict[str, Any]]] | None = None
    saturated: Callable[[], bool] | None = None
    # Speculative decoding as served, for /v1/models: ``enabled`` and, when asked for, the algorithm,
    # draft length and, where the checkpoint cannot, the ``reason``.
    speculative: dict[str, Any] | None = None
    # A parallel group's health beyond this process (None: one process): why the replica must not take
    # traffic now (a rank's heartbeat is late), or None.
    group_problem: Callable[[], str | None] | None = None


Loader = Callable[[ProgressFn], LoadedRuntime]


class ServerState:
    """Phase, progress and drain state shared by the handlers and the startup task."""

    def __init__(self, drain_timeout_s: float = 30.0) -> None:
        self._lock = threading.Lock()  # the loader thread reports progress
        self.phase = "loading_weights"
        self.progress = 0.0
        self.detail = "waiting to start"
        self.started_at = time.time()
        # Seconds spent in each finished startup phase (TIMED_PHASES), and the whole start once ready.
        self.process_started_at = process_start_time()
        self.phase_seconds: dict[str, float] = {}
        self.startup_seconds: float | None = None
        self._phase_since: float | None = None  # None: loading has not begun (still "process")
        self.runtime: LoadedRuntime | None = None
        self.error: str | None = None
        self.draining = False
        self.drain_timeout_s = drain_timeout_s
        # When the drain began (monotonic) and how many requests it found in flight: its log lines.
        self.drain_started_at: float | None = None
        self.in_flight_at_drain = 0
        self.in_flight = 0
        self.drained = asyncio.Event()
        self.drain_requested = asyncio.Event()
        self.startup_task: asyncio.Task[None] | None = None
        self.stop_requested = asyncio.Event()
        self.self_test_task: asyncio.Task[None] | None = None  # the periodic self-test
        # The output self-test (sovereign_runtime.engine.selftest): the last report's JSON (None until one
        # ran, or when the self-test is off), and counts for the metrics.
        self.self_test: dict[str, Any] | None = None
        self.self_test_runs = 0
        self.self_test_skipped = 0
        self.self_test_failures: dict[str, int] = {}

    def report(self, phase: str, progress: float, detail: str = "", *, quiet: bool = False) -> None:
        with self._lock:
            self._time_phases(phase, time.time())
            self.phase = phase
            self.progress = max(0.0, min(1.0, float(progress)))
            self.detail = detail
        if not quiet:
            log.info("startup phase %s %.0f%% %s", phase, 100 * self.progress, detail)

    def _time_phases(self, phase: str, now: float) -> None:
        """Close the phase being left; the first report closes "process". Called under the lock."""
        if self._phase_since is None:
            self.phase_seconds["process"] = max(0.0, now - self.process_started_at)
            self._phase_since = now
        elif phase != self.phase and self.phase in TIMED_PHASES:
            self.phase_seconds[self.phase] = self.phase_seconds.get(self.phase, 0.0) + now - self._phase_since
            self._phase_since = now
        elif phase != self.phase:
            self._phase_since = now
        if phase == "ready" and self.startup_seconds is None:
            self.startup_seconds = max(0.0, now - self.process_started_at)

    def startup_timing(self) -> dict[str, Any]:
        """Finished phases' seconds and, once ready, the whole start: for /health/startup and metrics."""
        with self._lock:
            timing: dict[str, Any] = {
                "phase_seconds": {p: round(s, 3) for p, s in self.phase_seconds.items()}
            }
            if self.startup_seconds is not None:
                timing["startup_seconds"] = round(self.startup_seconds, 3)
            return timing

    def snapshot(self) -> dict[str, Any]:
        timing = self.startup_timing()
        with self._lock:
            body: dict[str, Any] = {"phase": self.phase}
            if self.phase != "ready":
                body["progress"] = round(self.progress, 4)
                body["detail"] = self.detail
            body["elapsed_s"] = round(time.time() - self.started_at, 3)
            body.update(timing)
            if self.error:
                body["error"] = self.error
            if self.self_test is not None:
                body["self_test"] = self.self_test
            return body

    @property
    def started(self) -> bool:
        """Startup is over (weights loaded, kernels warm, first self-test run)."""
        return self.phase == "ready" and self.runtime is not None

    @property
    def output_healthy(self) -> bool:
        """The last self-test passed (or none is configured)."""
        return self.self_test is None or bool(self.self_test.get("passed"))

    @property
    def ready(self) -> bool:
        return self.started and self.output_healthy

    @property
    def output_failure(self) -> str | None:
        """The failing check and why, while the last self-test failed."""
        if self.output_healthy or self.self_test is None:
            return None
        return str(self.self_test.get("reason") or "self-test failed")

    def record_self_test(self, report: dict[str, Any]) -> None:
        was_healthy = self.output_healthy
        self.self_test = report
        self.self_test_runs += 1
        failing = report.get("failing_check")
        if failing:
            self.self_test_failures[failing] = self.self_test_failures.get(failing, 0) + 1
            log.error("output self-test failed: %s; /health/ready answers 503", report.get("reason"))
        elif not was_healthy:
            log.warning("output self-test passes again; /health/ready answers 200")

    def self_test_health(self) -> dict[str, Any]:
        """What the metrics report about the self-test."""
        return {
            "runs": self.self_test_runs,
            "skipped": self.self_test_skipped,
            "failures": dict(self.self_test_failures),
            "last": self.self_test,
        }

    def request_started(self) -> None:
        self.in_flight += 1

    def request_finished(self) -> None:
        self.in_flight -= 1
        if self.draining and self.in_flight <= 0:
            self.drained.set()

    def begin_drain(self, cause: str = "requested") -> None:
        """Refuse new requests from now on and let the in-flight ones finish (`cause`: who asked)."""
        if not self.draining:
            self.drain_started_at = time.monotonic()
            self.in_flight_at_drain = self.in_flight
            # One line `kubectl logs` shows for the preStop hook's POST /drain (or SIGTERM).
            log.info(
                "drain started (%s): %d request(s) in flight, new requests get 503; waiting up to %g s",
                cause,
                self.in_flight,
                self.drain_timeout_s,
            )
        self.draining = True
        self.drain_requested.set()
        if self.in_flight <= 0:
            self.drained.set()
