"""The work queue: coalesced keys, one worker per key at a time, retries after a delay."""

from __future__ import annotations

import asyncio

import pytest
from sovereign_operator.workqueue import WorkQueue


def test_keys_coalesce_while_waiting_and_run_again_when_added_during_processing() -> None:
    async def scenario() -> None:
        runs: list[str] = []
        gate = asyncio.Event()

        async def process(key: str) -> None:
            runs.append(key)
            if key == "a" and runs.count("a") == 1:
                await gate.wait()

        queue: WorkQueue[str] = WorkQueue(process, workers=2, name="test")
        queue.start()
        queue.add("a")
        await asyncio.sleep(0.01)  # "a" is being processed
        for _ in range(5):
            queue.add("b")  # waiting: one run
            queue.add("a")  # processing: once more afterwards, however often it is added
        assert len(queue) == 2
        gate.set()
        await queue.join()
        assert sorted(runs) == ["a", "a", "b"]
        await queue.close()

    asyncio.run(scenario())


def test_one_key_is_never_processed_by_two_workers_at_once() -> None:
    async def scenario() -> None:
        active: set[int] = set()
        overlaps = 0

        async def process(key: int) -> None:
            nonlocal overlaps
            overlaps += key in active
            active.add(key)
            await asyncio.sleep(0.002)
            active.discard(key)

        queue: WorkQueue[int] = WorkQueue(process, workers=4, name="test")
        queue.start()
        for _ in range(20):
            for key in range(3):
                queue.add(key)
            await asyncio.sleep(0.001)
        await queue.join()
        assert overlaps == 0
        await queue.close()

    asyncio.run(scenario())


def test_a_returned_delay_brings_the_key_back_and_a_failure_does_not_stop_the_worker() -> None:
    async def scenario() -> None:
        attempts: list[str] = []

        async def process(key: str) -> float | None:
            attempts.append(key)
            if key == "boom":
                raise RuntimeError("broken")
            return 0.02 if attempts.count(key) < 3 else None

        queue: WorkQueue[str] = WorkQueue(process, workers=1, name="test")
        queue.start()
        queue.add("boom")
        queue.add("retry")
        await asyncio.sleep(0.2)
        assert attempts.count("boom") == 1 and attempts.count("retry") == 3
        await queue.close()

    asyncio.run(scenario())


def test_close_lets_the_key_in_flight_finish() -> None:
    async def scenario() -> None:
        finished: list[str] = []

        async def process(key: str) -> None:
            await asyncio.sleep(0.05)
            finished.append(key)

        queue: WorkQueue[str] = WorkQueue(process, workers=1, name="test")
        queue.start()
        queue.add("first")
        queue.add("second")
        await asyncio.sleep(0.01)
        await queue.close(grace_s=1.0)
        assert finished == ["first"]

    asyncio.run(scenario())


def test_a_key_waits_out_its_minimum_interval_and_the_triggers_meanwhile_coalesce() -> None:
    async def scenario() -> None:
        runs: list[float] = []
        loop = asyncio.get_running_loop()

        async def process(key: str) -> None:
            runs.append(loop.time())

        queue: WorkQueue[str] = WorkQueue(process, workers=1, name="test", min_interval_s=0.1)
        queue.start()
        queue.add("a")
        await queue.join()
        for _ in range(10):  # a burst of events right after the first run
            queue.add("a")
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.2)
        assert len(runs) == 2 and runs[1] - runs[0] >= 0.099
        await queue.close()

    asyncio.run(scenario())


def test_a_key_gives_way_while_asked_then_runs_once_for_every_add_meanwhile() -> None:
    async def scenario() -> None:
        runs: list[float] = []
        loop = asyncio.get_running_loop()
        busy = True

        async def process(key: str) -> None:
            runs.append(loop.time())

        queue: WorkQueue[str] = WorkQueue(
            process, workers=2, name="test", yield_to=lambda: busy, max_yield_s=5.0
        )
        queue.start()
        started = loop.time()
        for _ in range(10):  # a burst of status events while children are being applied
            queue.add("a")
            await asyncio.sleep(0.01)
        assert runs == [] and len(queue) == 1
        busy = False  # the applies are done
        await asyncio.sleep(0.2)
        assert len(runs) == 1 and runs[0] - started >= 0.1
        await queue.close()

    asyncio.run(scenario())


def test_a_key_gives_way_no_longer_than_its_bound() -> None:
    async def scenario() -> None:
        runs: list[float] = []
        loop = asyncio.get_running_loop()

        async def process(key: str) -> None:
            runs.append(loop.time())

        queue: WorkQueue[str] = WorkQueue(
            process, workers=1, name="test", yield_to=lambda: True, max_yield_s=0.15
        )
        queue.start()
        started = loop.time()
        queue.add("a")
        await asyncio.sleep(0.05)
        queue.add("b")
        await asyncio.sleep(0.4)
        # Each waited its own bound from when it was queued, then ran though the applies go on.
        assert len(runs) == 2
        assert 0.14 <= runs[0] - started < 0.3 and 0.19 <= runs[1] - started < 0.35
        await queue.close()

    asyncio.run(scenario())


def test_a_queue_needs_a_worker() -> None:
    async def process(key: str) -> None:
        return None

    with pytest.raises(ValueError, match="at least one worker"):
        WorkQueue(process, workers=0, name="test")
