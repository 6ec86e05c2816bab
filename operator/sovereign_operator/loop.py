"""The operator's periodic loop: autoscaling, KV health and output health for every LLMDeployment it serves.

Every TICK_SECONDS the loop takes the LLMDeployments in the watch cache (handlers.py: the informers
of exactly the namespaces `run --namespace` serves, so the loop lists nothing itself) and runs a round
for each, as its own task: a slow or failing object never delays another, and an object whose
previous round is still running is skipped. The autoscaler skips rounds until the deployment's
`spec.autoscaling.intervalSeconds` has passed, so the interval is per object; the KV-health monitor
reads the prefill and decode pods' `/health/kv` every KV_INTERVAL_S and keeps `KVTransferHealthy`;
the output-health monitor reads every worker pod's `/health/startup` (its self-test) every
OUTPUT_INTERVAL_S, keeps `OutputHealthy` and, when the spec allows, restarts a failing pod; the
download monitor reconciles a huggingFace source every DOWNLOAD_INTERVAL_S while its download runs;
the startup monitor reads the phase of pods still starting every round (startupmonitor.py).
A part that reads the object and finds it gone (gone.py) ends its rounds and every part's memory of it.

While children wait to be applied (`yield_to`: a burst of new deployments), ticks give way for up
to `max_yield_s` at a time, as status refreshes do: the rounds' reads (pods, nodes) and writes (the
first `OutputHealthy` of each new deployment) would otherwise compete with the child applies for the
apiserver, and a deployment whose children are not applied yet has nothing to monitor.

Not a `@kopf.timer`: kopf puts a finalizer on every object a timer serves, and a namespace-restricted
kopf stops serving a namespace marked for deletion before releasing those finalizers, so deleting
the namespace hung. This loop needs no finalizer; children go by their owner references. It is
free of kopf: handlers.py builds it at startup and closes it at cleanup.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from sovereign_operator.autoscale import AutoscalerConfig
from sovereign_operator.autoscale.controller import AutoscaleController
from sovereign_operator.downloadmonitor import DownloadMonitor
from sovereign_operator.gone import DeploymentGone
from sovereign_operator.kvmonitor import KVHealthMonitor
from sovereign_operator.outputmonitor import OutputHealthMonitor
from sovereign_operator.startupmonitor import StartupMonitor

TICK_SECONDS = 5.0
# What a spec without `autoscaling.intervalSeconds` gets: the CRD's default, as the policy's.
DEFAULT_INTERVAL_S = AutoscalerConfig().interval_s

Key = tuple[str, str]


def _interval_s(body: Mapping[str, Any]) -> float:
    # The watched spec is enough to know the interval: no apiserver read between rounds.
    autoscaling = (body.get("spec") or {}).get("autoscaling") or {}
    return float(autoscaling.get("intervalSeconds", DEFAULT_INTERVAL_S))


class OperatorLoop:
    """Rounds for the LLMDeployments `served()` returns (plain bodies as the apiserver has them)."""

    def __init__(
        self,
        served: Callable[[], Iterable[Mapping[str, Any]]],
        autoscaler: AutoscaleController,
        kv_monitor: KVHealthMonitor,
        *,
        output_monitor: OutputHealthMonitor | None = None,
        download_monitor: DownloadMonitor | None = None,
        startup_monitor: StartupMonitor | None = None,
        forget_also: Callable[[str, str], None] | None = None,
        tick_s: float = TICK_SECONDS,
        logger: logging.Logger | None = None,
        ready: Callable[[], bool] = lambda: True,
        yield_to: Callable[[], bool] = lambda: False,
        max_yield_s: float = 0.0,  # handlers.py gives STATUS_MAX_YIELD_S, as to status refreshes
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.served = served
        self.yield_to = yield_to
        self.max_yield_s = max_yield_s
        self.clock = clock
        # When the ticks began giving way (None: they are not).
        self._yielding_since: float | None = None
        # False until the watch cache holds every object: rounds before that would read the
        # apiserver for every deployment (and see children still being listed as missing).
        self.ready = ready
        self.autoscaler = autoscaler
        self.kv_monitor = kv_monitor
        self.output_monitor = output_monitor
        self.download_monitor = download_monitor
        self.startup_monitor = startup_monitor
        # What else keeps memory per deployment (the reconciler): dropped with the monitors'.
        self.forget_also = forget_also
        self.tick_s = tick_s
        self.log = logger or logging.getLogger(__name__)
        self.rounds: dict[Key, asyncio.Task[None]] = {}
        # Objects a round found gone while the cache still serves their last body: key -> that
        # body's uid, skipped until the cache drops or replaces it.
        self.gone: dict[Key, str | None] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="operator loop")

    async def close(self) -> None:
        """Stop the loop and every round in flight, then close the autoscaler's HTTP session."""
        tasks = [t for t in (self._task, *self.rounds.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None
        self.rounds.clear()
        await self.autoscaler.close()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            self.tick()

    def tick(self) -> None:
        """Start a round for every served LLMDeployment whose previous round has finished; forget
        the ones no longer served."""
        if not self.ready() or self._gives_way():
            return
        present: set[Key] = set()
        indexed: set[Key] = set()
        for body in list(self.served()):
            meta = body["metadata"]
            key = (meta["namespace"], meta["name"])
            indexed.add(key)
            if meta.get("deletionTimestamp"):
                continue  # going away: owner references take the children, nothing to scale
            if key in self.gone and self.gone[key] == meta.get("uid"):
                continue  # found gone: its body is stale
            present.add(key)
            running = self.rounds.get(key)
            if running is not None and not running.done():
                continue
            self.rounds[key] = asyncio.create_task(self._isolated(key, body), name=f"round {key[0]}/{key[1]}")
        for key in [k for k, task in self.rounds.items() if k not in present and task.done()]:
            # Deleted (or no longer served): drop its memory and its gauges.
            del self.rounds[key]
            self.forget(*key)
        for key in [k for k in self.gone if k not in indexed]:
            del self.gone[key]

    def _gives_way(self) -> bool:
        """Whether this tick skips its rounds for pending child applies: yes while they last, but
        never for longer than max_yield_s at a stretch (a long burst still gets a round that often)."""
        if not self.yield_to():
            self._yielding_since = None
            return False
        now = self.clock()
        if self._yielding_since is None:
            self._yielding_since = now
        if now - self._yielding_since < self.max_yield_s:
            return True
        self._yielding_since = now
        return False

    def forget(self, namespace: str, name: str) -> None:
        """Drop everything every part keeps for one deployment."""
        self.autoscaler.forget(namespace, name)
        self.kv_monitor.forget(namespace, name)
        for part in (self.output_monitor, self.download_monitor, self.startup_monitor):
            if part is not None:
                part.forget(namespace, name)
        if self.forget_also is not None:
            self.forget_also(namespace, name)

    async def _isolated(self, key: Key, body: Mapping[str, Any]) -> None:
        try:
            await self.round(key[0], key[1], body)
        except DeploymentGone:
            uid = (body.get("metadata") or {}).get("uid")
            self.log.info("%s/%s is gone (deleted, or its namespace is): its rounds end", *key)
            self.gone[key] = uid
            self.forget(*key)
        except Exception as error:  # isolation: one object's failure never stops the loop or another
            self.log.warning("round for %s/%s failed: %s", key[0], key[1], error)

    async def round(self, namespace: str, name: str, body: Mapping[str, Any]) -> None:
        """One object's round: output health and KV health when due, autoscaling when its interval
        has passed (after output health, so it sees which pods fail their self-test). A failed part
        is skipped until the next round, never retried in a hot loop; a part that finds the object
        gone ends the round (DeploymentGone). Starting pods are read every round (a short startup
        budget must not run out between two reads)."""
        if self.download_monitor is not None and self.download_monitor.due(namespace, name, body):
            await self._part(
                "model download", namespace, name, self.download_monitor.tick(namespace, name, body)
            )
        if self.startup_monitor is not None:
            await self._part("startup", namespace, name, self.startup_monitor.tick(namespace, name, body))
        if self.output_monitor is not None and self.output_monitor.due(namespace, name):
            await self._part(
                "output health", namespace, name, self.output_monitor.tick(namespace, name, body)
            )
        if self.autoscaler.due(namespace, name, _interval_s(body)):
            await self._part("autoscaling", namespace, name, self.autoscaler.tick(namespace, name))
        if self.kv_monitor.due(namespace, name, body):
            await self._part("KV health", namespace, name, self.kv_monitor.tick(namespace, name, body))

    async def _part(self, what: str, namespace: str, name: str, work: Awaitable[Any]) -> None:
        try:
            await work
        except DeploymentGone:
            raise
        except Exception as error:
            self.log.warning("%s round for %s/%s failed: %s", what, namespace, name, error)
