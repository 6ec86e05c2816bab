"""Kubernetes Events about LLMDeployments, posted from any task of the operator.

Not `kopf.event()`/`kopf.warn()`: they put the Event on a queue that kopf binds (a context variable)
only inside its own per-object handler tasks, and the operator's loop (loop.py) runs outside them:
it is deliberately not a kopf timer (a timer puts a finalizer on every object). Borrowing kopf's
queue means importing kopf's private modules, so the operator posts its own core/v1 Events, the
same kind kopf writes. `post` is synchronous, because the reconciler and the autoscaler report in
the middle of a round; it queues the Event and one worker writes it. A failed write is logged,
never raised: an Event is never worth failing a reconcile for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from sovereign_operator.api.crd import API_VERSION, KIND
from sovereign_operator.vocabulary import MANAGED_BY, now_rfc3339

log = logging.getLogger(__name__)
# kopf's limit too: an Event message is for reading, the details are in status and the logs.
MAX_MESSAGE = 1000


def event_object(body: Mapping[str, Any], type_: str, reason: str, message: str, now: str) -> dict[str, Any]:
    """A core/v1 Event about the LLMDeployment `body`, at RFC 3339 time `now`."""
    meta = body["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid"),
        },
        "type": type_,
        "reason": reason,
        "message": message[:MAX_MESSAGE],
        "source": {"component": MANAGED_BY},
        "reportingComponent": MANAGED_BY,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


class EventPoster:
    def __init__(
        self, create: Callable[[dict[str, Any]], Awaitable[Any]], clock: Callable[[], str] = now_rfc3339
    ) -> None:
        self.create = create
        self.clock = clock
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._worker: asyncio.Task[None] | None = None

    def post(self, body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        """Queue an Event (type Normal or Warning); written in the background, in order."""
        self._queue.put_nowait(event_object(body, type_, reason, message, self.clock()))

    def start(self) -> None:
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._write_all(), name="event poster")

    async def flush(self) -> None:
        """Wait until every queued Event was written (or failed)."""
        await self._queue.join()

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
            self._worker = None

    async def _write_all(self) -> None:
        while True:
            event = await self._queue.get()
            try:
                await self.create(event)
            except Exception as error:  # see the module docstring: logged, never raised
                log.warning(
                    "posting Event %s on %s failed: %s", event["reason"], event["involvedObject"], error
                )
            finally:
                self._queue.task_done()
