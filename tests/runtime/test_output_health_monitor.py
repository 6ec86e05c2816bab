"""When the self-test runs (server side, torch-free): once, periodically, skipped while saturated."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sovereign_runtime.server.output_health import OutputHealthMonitor
from sovereign_runtime.server.state import ServerState

PASS = {"passed": True, "failing_check": None, "reason": None, "checks": []}
FAIL = {
    "passed": False,
    "failing_check": "numerics",
    "reason": "numerics: layer 0 q_a_proj: 0.5 over 0.03",
    "checks": [],
}


def _monitor(
    reports: list[dict[str, Any]], saturated: list[bool], state: ServerState
) -> tuple[OutputHealthMonitor, list[float]]:
    slept: list[float] = []

    async def run() -> dict[str, Any]:
        return reports.pop(0)

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        if not reports:
            raise asyncio.CancelledError

    return OutputHealthMonitor(
        state, run, lambda: saturated.pop(0) if saturated else False, 5.0, sleep
    ), slept


def test_ready_follows_the_last_self_test_and_metrics_count_failures() -> None:
    async def main() -> None:
        state = ServerState()
        state.report("ready", 1.0)
        state.runtime = object()  # type: ignore[assignment]
        assert state.ready  # no self-test configured: ready as before
        monitor, slept = _monitor([FAIL, PASS, FAIL], [False, True, False, False], state)
        await monitor.run_once()
        assert not state.ready and state.started and state.output_failure == FAIL["reason"]
        assert state.snapshot()["self_test"]["failing_check"] == "numerics"
        with pytest.raises(asyncio.CancelledError):
            await monitor.periodic()
        # PASS (ready again), one round skipped (saturated), FAIL, then cancelled in the next sleep.
        assert slept == [5.0] * 4
        assert state.self_test_skipped == 1 and state.self_test_runs == 3
        assert state.self_test_failures == {"numerics": 2} and not state.ready
        health = state.self_test_health()
        assert health["runs"] == 3 and health["last"]["passed"] is False

    asyncio.run(main())


def test_a_self_test_that_raises_is_a_failed_check() -> None:
    async def main() -> None:
        state = ServerState()

        async def broken() -> dict[str, Any]:
            raise RuntimeError("engine is shut down")

        report = await OutputHealthMonitor(state, broken, lambda: False, 0.0).run_once()
        assert report["passed"] is False and "engine is shut down" in report["reason"]
        assert state.self_test_failures == {"self_test": 1}

    asyncio.run(main())


def test_interval_zero_runs_only_at_startup_and_negative_is_refused() -> None:
    async def main() -> None:
        state = ServerState()
        monitor = OutputHealthMonitor(state, lambda: asyncio.sleep(0), lambda: False, 0.0)  # type: ignore[arg-type, return-value]
        await monitor.periodic()  # returns at once

    asyncio.run(main())
    with pytest.raises(ValueError, match="self-test interval"):
        OutputHealthMonitor(ServerState(), lambda: asyncio.sleep(0), lambda: False, -1.0)  # type: ignore[arg-type, return-value]
