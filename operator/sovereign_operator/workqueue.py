"""A queue of keys served by a fixed number of workers: client-go's workqueue semantics on asyncio.

- one worker at a time processes a key;
- adding a key that is already waiting does nothing, so events coalesce (a burst of pod events for
  one deployment costs one status refresh, however long the queue is);
- adding a key while it is being processed runs it once more afterwards (no change is lost);
- `process` returns a delay to have the key come back after it (retries with backoff), unless
  something adds it sooner;
- keys are served in the order they were first added;
- with `min_interval_s`, a key processed less than that long ago waits out the rest (a status
  refresh per deployment at most once a second, however fast its pods change);
- with `yield_to`, a key waits while that predicate holds, up to `max_yield_s` after it was
  queued: status refreshes give way to the children's applies under a burst (the apiserver's
  writes go to what users are waiting for first), events meanwhile coalesce into one write, and
  status never trails by more than `max_yield_s`.

The watches' handlers only add keys and return, so a watch never waits behind a reconcile, and
the number of requests in flight is the number of workers, not of events.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
# How often a key giving way looks again: a few checks per second cost nothing beside a request.
YIELD_POLL_S = 0.05


class WorkQueue(Generic[K]):
    def __init__(
        self,
        process: Callable[[K], Awaitable[float | None]],
        workers: int,
        name: str,
        logger: logging.Logger | None = None,
        min_interval_s: float = 0.0,
        yield_to: Callable[[], bool] | None = None,
        max_yield_s: float = 0.0,
    ) -> None:
        if workers < 1:
            raise ValueError(f"a work queue needs at least one worker, got {workers}")
        self.process = process
        self.workers = workers
        self.name = name
        self.min_interval_s = min_interval_s
        self.yield_to = yield_to
        self.max_yield_s = max_yield_s
        self._done_at: dict[K, float] = {}
        # When each waiting key was queued: how long it may still give way (yield_to).
        self._queued_at: dict[K, float] = {}
        self.log = logger or logging.getLogger(__name__)
        self._queue: asyncio.Queue[K] = asyncio.Queue()
        self._waiting: set[K] = set()
        self._active: set[K] = set()
        self._dirty: set[K] = set()
        self._timers: dict[K, asyncio.TimerHandle] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False

    def __len__(self) -> int:
        """Keys waiting or being processed."""
        return len(self._waiting | self._active)

    def add(self, key: K) -> None:
        if key in self._waiting:
            return
        if key in self._active:
            self._dirty.add(key)
            return
        done_at = self._done_at.get(key)
        if done_at is not None:
            loop = asyncio.get_running_loop()
            due = done_at + self.min_interval_s
            if due > loop.time():
                timer = self._timers.get(key)
                if timer is None or timer.when() > due:
                    if timer is not None:
                        timer.cancel()
                    self._timers[key] = loop.call_at(due, self._due, key)
                return
            del self._done_at[key]
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        self._waiting.add(key)
        self._queued_at[key] = asyncio.get_running_loop().time()
        self._queue.put_nowait(key)

    def add_after(self, key: K, delay: float) -> None:
        if self._closing or key in self._waiting or key in self._dirty:
            return  # stopping, or it runs sooner anyway
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        self._timers[key] = asyncio.get_running_loop().call_later(max(0.0, delay), self._due, key)

    def _due(self, key: K) -> None:
        self._timers.pop(key, None)
        self.add(key)

    def start(self) -> None:
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(self._work(), name=f"{self.name} worker {i}") for i in range(self.workers)
            ]

    async def close(self, grace_s: float = 0.0) -> None:
        """Stop: keys being processed get up to `grace_s` to finish (graceful shutdown finishes
        in-flight reconciles), waiting and delayed keys are dropped."""
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        self._closing = True
        if grace_s > 0 and self._active:
            deadline = asyncio.get_running_loop().time() + grace_s
            while self._active and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def join(self) -> None:
        """Until nothing waits and nothing is being processed (delayed keys not counted)."""
        while self._waiting or self._active:
            await asyncio.sleep(0.005)

    async def _give_way(self, key: K) -> None:
        """While `yield_to` holds, wait (the key stays waiting, so adding it again coalesces),
        but not past `max_yield_s` after it was queued."""
        if self.yield_to is None or self.max_yield_s <= 0:
            return
        loop = asyncio.get_running_loop()
        until = self._queued_at.get(key, loop.time()) + self.max_yield_s
        while not self._closing and self.yield_to() and loop.time() < until:
            await asyncio.sleep(min(YIELD_POLL_S, max(0.0, until - loop.time())))

    async def _work(self) -> None:
        while not self._closing:
            key = await self._queue.get()
            if self._closing:
                return
            await self._give_way(key)
            if self._closing:
                return
            self._waiting.discard(key)
            self._queued_at.pop(key, None)
            self._active.add(key)
            delay: float | None = None
            try:
                delay = await self.process(key)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # isolation: one key's failure never stops a worker
                self.log.warning("%s: processing %s failed: %s", self.name, key, error)
            finally:
                self._active.discard(key)
                if self.min_interval_s > 0:
                    self._done_at[key] = asyncio.get_running_loop().time()
            if key in self._dirty:
                self._dirty.discard(key)
                self.add(key)
            elif delay is not None:
                self.add_after(key, delay)
