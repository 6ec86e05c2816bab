"""Keeping a huggingFace source's download in status while it runs: reconcile every few seconds.

A reconcile reads the watched Job (its pods' termination messages, the running pod's latest
progress line), writes `status.model`, and renders what the answer unlocks: the cache claim and
download Job once the commit is known, the pools once the download is complete. The Jobs are in
the watch cache, but shared objects carry no deployment's instance label, so their changes wake no
deployment: the loop polls them (memory reads), and only while a download is unsettled.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

DOWNLOAD_INTERVAL_S = 10.0

Key = tuple[str, str]


def unsettled(body: Mapping[str, Any]) -> bool:
    """A huggingFace source whose status does not yet say its pools read the resolved commit."""
    source = (((body.get("spec") or {}).get("model") or {}).get("source") or {}).get("huggingFace")
    if source is None:
        return False
    status = body.get("status") or {}
    model = status.get("model") or {}
    generation = (body.get("metadata") or {}).get("generation")
    if status.get("observedGeneration") != generation or model.get("phase") != "Complete":
        return True
    return (model.get("serving") or {}).get("commit") != model.get("commit")


class DownloadMonitor:
    def __init__(
        self,
        reconcile: Callable[[Mapping[str, Any]], Awaitable[None]],
        interval_s: float = DOWNLOAD_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.reconcile = reconcile
        self.interval_s = interval_s
        self.clock = clock
        self._last: dict[Key, float] = {}

    def due(self, namespace: str, name: str, body: Mapping[str, Any]) -> bool:
        if not unsettled(body):
            self._last.pop((namespace, name), None)
            return False
        last = self._last.get((namespace, name))
        return last is None or self.clock() - last >= self.interval_s

    async def tick(self, namespace: str, name: str, body: Mapping[str, Any]) -> None:
        self._last[(namespace, name)] = self.clock()
        await self.reconcile(body)

    def forget(self, namespace: str, name: str) -> None:
        self._last.pop((namespace, name), None)
