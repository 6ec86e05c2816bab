"""Run the app: listen first, then load in the background; drain on SIGTERM or ``POST /drain``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from dataclasses import dataclass

from aiohttp import web

from ..read_deadlines import DeadlineSite
from .app import CONFIG, DEADLINE_GUARD, STATE, start_loading

log = logging.getLogger("sovereign_runtime.server")


@dataclass
class RunningServer:
    runner: web.AppRunner
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def close(self) -> None:
        await self.runner.cleanup()


async def start_server(app: web.Application, host: str = "127.0.0.1", port: int = 0) -> RunningServer:
    """Listen on host:port (0 picks a free port), then start loading the model."""
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its request.
    guard = app[DEADLINE_GUARD]
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=2.0,
        **guard.deadlines.runner_kwargs(),
    )
    await runner.setup()
    site = DeadlineSite(runner, host, port, guard)
    await site.start()
    bound = int(runner.addresses[0][1]) if runner.addresses else port
    start_loading(app)
    return RunningServer(runner, host, bound)


async def serve(app: web.Application, host: str, port: int) -> int:
    """Serve until drained (SIGTERM/SIGINT/``POST /drain``) or startup fails; return the exit code."""
    state = app[STATE]
    server = await start_server(app, host, port)
    log.info("listening on %s", server.url)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, state.begin_drain, sig.name)
    try:
        drain = asyncio.create_task(state.drain_requested.wait())
        failed = asyncio.create_task(state.stop_requested.wait())
        await asyncio.wait({drain, failed}, return_when=asyncio.FIRST_COMPLETED)
        drain.cancel()
        failed.cancel()
        if state.stop_requested.is_set():
            log.error("startup failed: %s", state.error)
            return 1
        await wait_drained(app)
        log.info("shutting down")
        return 0
    finally:
        await server.close()


async def wait_drained(app: web.Application) -> bool:
    """Wait until in-flight requests finish after a drain, bounded by the drain timeout; log the end."""
    state, config = app[STATE], app[CONFIG]
    started = state.drain_started_at if state.drain_started_at is not None else time.monotonic()
    # The timeout counts from the drain's start (the preStop hook's POST /drain), not from this call.
    remaining = max(0.0, config.drain_timeout_s - (time.monotonic() - started))
    try:
        await asyncio.wait_for(state.drained.wait(), timeout=remaining)
    except TimeoutError:
        log.warning(
            "drain timed out after %.1f s: %d of %d request(s) completed, %d still in flight are aborted",
            time.monotonic() - started,
            max(0, state.in_flight_at_drain - state.in_flight),
            state.in_flight_at_drain,
            state.in_flight,
        )
        return False
    log.info(
        "drain finished in %.1f s: all %d in-flight request(s) completed",
        time.monotonic() - started,
        state.in_flight_at_drain,
    )
    return True
