"""When a worker leaves rotation: a circuit breaker per worker and the router's own lateness.

Only a worker's own failures count (refused or dropped connections, timeouts, failed health checks).
Anything the worker answered with proves it alive: a 4xx, a 500 caused by one bad request, a client that
hung up. After `failure_threshold` failures in a row the breaker opens (no traffic); after a cooldown it
half-opens and lets one trial request through, whose outcome closes it again or re-opens it for a
longer cooldown. A health check that gets an answer closes it at once: the worker's own readiness
endpoint is the better trial (a trial request may take minutes, and holds every other request off). A timeout measured while the router itself was late (a CPU-starved event loop) says
nothing about the worker and is not counted.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


class FailureKind(StrEnum):
    CONNECT = "connect"  # refused, reset or dropped connection: the worker's process or network
    TIMEOUT = "timeout"  # no answer in time: the worker, or a router too late to notice the answer


@dataclass
class CircuitBreaker:
    failure_threshold: int = 3
    cooldown_s: float = 5.0
    max_cooldown_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    consecutive_failures: int = 0
    # True while every failure of the current run was a timeout (see `may_open` in record_failure).
    only_timeouts: bool = True
    _opened_at: float | None = None
    _cooldown: float = field(default=0.0, init=False)
    _trial_in_flight: bool = False

    def __post_init__(self) -> None:
        self._cooldown = self.cooldown_s

    @property
    def state(self) -> BreakerState:
        if self._opened_at is None:
            return BreakerState.CLOSED
        if self.clock() - self._opened_at >= self._cooldown:
            return BreakerState.HALF_OPEN
        return BreakerState.OPEN

    def admits(self) -> bool:
        """Whether a new request may go to this worker now (a half-open breaker admits one at a time)."""
        state = self.state
        return state is BreakerState.CLOSED or (state is BreakerState.HALF_OPEN and not self._trial_in_flight)

    def begin_attempt(self) -> None:
        if self.state is BreakerState.HALF_OPEN:
            self._trial_in_flight = True

    def end_attempt(self) -> None:
        """The attempt ended without a verdict on the worker (e.g. the client hung up first)."""
        self._trial_in_flight = False

    def record_success(self) -> None:
        self.consecutive_failures = 0
        self.only_timeouts = True
        self._opened_at = None
        self._cooldown = self.cooldown_s
        self._trial_in_flight = False

    def record_failure(self, kind: FailureKind, may_open: bool = True) -> None:
        """Count one failure; `may_open=False` counts it without taking the worker out (the pool's call)."""
        self.consecutive_failures += 1
        self.only_timeouts = self.only_timeouts and kind is FailureKind.TIMEOUT
        state = self.state
        self._trial_in_flight = False
        if state is BreakerState.HALF_OPEN:
            self._cooldown = min(self._cooldown * 2, self.max_cooldown_s)
            self._opened_at = self.clock()
        elif (
            state is BreakerState.CLOSED and self.consecutive_failures >= self.failure_threshold and may_open
        ):
            self._opened_at = self.clock()


class LoopLagMonitor:
    """How late this event loop runs its timers: a ticker whose oversleep is the router's own lateness.

    A health check that timed out while the loop was late by a good part of its timeout cannot blame the
    worker: the answer may have been waiting in the socket while the router was busy elsewhere.
    """

    # A tick of 0.1 s resolves lateness well below the 25 % of a health check's timeout that matters, at
    # 10 wake-ups a second (an idle router's only CPU use besides its health checks).
    def __init__(self, tick_s: float = 0.1, keep_s: float = 120.0) -> None:
        self.tick_s = tick_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max(1, int(keep_s / tick_s)))
        self._tick_started: float | None = None

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._tick_started = loop.time()
            await asyncio.sleep(self.tick_s)
            now = loop.time()
            self._samples.append((now, now - self._tick_started - self.tick_s))

    def lag_since(self, since: float, now: float) -> float:
        """Seconds the loop ran late since `since` (loop time): the oversleep of the ticks in that window,
        the one in progress included. A loop that keeps up scores near zero however long the window."""
        lag = sum(overslept for at, overslept in self._samples if at >= since)
        if self._tick_started is not None:
            lag += max(0.0, now - max(self._tick_started, since) - self.tick_s)
        return lag


def timer_lateness(started: float, now: float, timeout_s: float) -> float:
    """How much later than `timeout_s` after `started` a timeout was noticed."""
    return max(0.0, now - started - timeout_s)
