"""When the output self-test runs: once before ready, then every ``interval_s`` in the background, skipped
while real requests saturate the engine (the self-test never starves them). Torch-free: the test itself is
a coroutine the loader builds (``LoadedRuntime.self_test``, see sovereign_runtime.engine.selftest)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from .state import ServerState

log = logging.getLogger("sovereign_runtime.server")

SelfTestFn = Callable[[], Awaitable[dict[str, Any]]]


class OutputHealthMonitor:
    def __init__(
        self,
        state: ServerState,
        run: SelfTestFn,
        saturated: Callable[[], bool],
        interval_s: float,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if interval_s < 0:
            raise ValueError(
                f"self-test interval must be >= 0 seconds (0: only at startup), got {interval_s}"
            )
        self.state = state
        self._run = run
        self._saturated = saturated
        self.interval_s = interval_s
        self._sleep = sleep
        self._lock = asyncio.Lock()  # one self-test at a time

    async def run_once(self) -> dict[str, Any]:
        async with self._lock:
            try:
                report = await self._run()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the self-test itself broke: that is a failed check too
                log.exception("output self-test raised")
                reason = f"self_test: {type(exc).__name__}: {exc}"
                report = {"passed": False, "failing_check": "self_test", "reason": reason, "checks": []}
            self.state.record_self_test(report)
            return report

    async def periodic(self) -> None:
        """Run until cancelled; returns at once when the interval is 0 (startup only)."""
        if self.interval_s == 0:
            return
        while True:
            await self._sleep(self.interval_s)
            if self.state.draining:
                return
            if self._saturated():
                self.state.self_test_skipped += 1
                log.info("periodic self-test skipped: the engine is saturated by real requests")
                continue
            await self.run_once()
