"""Leader election on a `coordination.k8s.io/v1` Lease: one operator replica acts, the others wait.

The convention client-go's `leaderelection` (and so every controller-runtime operator) follows:
the holder renews the Lease every `retry_period`; a candidate takes it once it has seen the same
record, unchanged, for `lease_duration` by its own clock (never by the timestamps another process
wrote, so clock skew between nodes does not matter), or at once when the holder released it. Writes
to the Lease carry its resourceVersion, so two candidates racing for it cannot both win.

Fencing: a holder that has not renewed for `renew_deadline` (< `lease_duration`) stops writing at
once (`is_leader()` is checked before every write the operator makes) and its process exits, so a
partitioned or stalled leader is gone before any candidate can have seen its Lease expire.

kopf's own peering is not used: it coordinates handlers by priority but does not fence.

The decision is a pure function (`decide`); `LeaderElector` is the thin shell around the apiserver.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import Enum
from typing import Any

from lightkube import ApiError, Client
from lightkube.resources.coordination_v1 import Lease

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeaseTiming:
    """Seconds. Takeover after a holder's crash takes at most lease_duration + retry_period."""

    lease_duration: float = 10.0
    renew_deadline: float = 6.0
    retry_period: float = 1.5

    def __post_init__(self) -> None:
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError(
                "leader election timing needs 0 < retry period < renew deadline < lease duration, got "
                f"{self.retry_period} / {self.renew_deadline} / {self.lease_duration} s"
            )


@dataclass(frozen=True)
class LeaseRecord:
    """What the Lease says, as far as the decision needs it."""

    holder: str
    duration_s: int
    transitions: int
    acquire_time: str | None
    resource_version: str | None


class Action(Enum):
    CREATE = "create"  # no Lease yet
    RENEW = "renew"  # we hold it
    TAKE = "take"  # free (released) or expired
    WAIT = "wait"  # another holder, still valid


def decide(me: str, record: LeaseRecord | None, observed_since: float | None, now: float) -> Action:
    """What a candidate does with the Lease it just read.

    `observed_since` is when (by this process's monotonic clock) the record was first seen in its
    current form; a holder is presumed alive until its record has stood unchanged for its duration.
    """
    if record is None:
        return Action.CREATE
    if record.holder == me:
        return Action.RENEW
    if not record.holder:
        return Action.TAKE
    if observed_since is not None and now - observed_since >= record.duration_s:
        return Action.TAKE
    return Action.WAIT


def default_identity() -> str:
    """The pod's name in a cluster (downward API), else host and pid: unique per process."""
    pod = os.environ.get("POD_NAME")
    if pod:
        return pod
    return f"{socket.gethostname()}-{os.getpid()}-{random.randrange(16**6):06x}"


def _now_micro() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _record(lease: Any) -> LeaseRecord:
    spec = lease.spec
    return LeaseRecord(
        holder=(spec.holderIdentity if spec else None) or "",
        duration_s=int((spec.leaseDurationSeconds if spec else None) or 0),
        transitions=int((spec.leaseTransitions if spec else None) or 0),
        acquire_time=_iso(spec.acquireTime) if spec else None,
        resource_version=lease.metadata.resourceVersion,
    )


def _iso(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return str(value)


class LeaderElector:
    """Acquire, renew and release one Lease for this process (sync client: it runs beside kopf's
    event loop in threads of its own, so a busy loop never delays a renewal)."""

    def __init__(
        self,
        client: Client,
        namespace: str,
        name: str,
        identity: str,
        timing: LeaseTiming | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.timing = timing or LeaseTiming()
        self._clock = clock
        self._last_renew: float | None = None
        self._observed: tuple[LeaseRecord, float] | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()

    # --- state ---------------------------------------------------------------------------------

    def is_leader(self) -> bool:
        """True while the last successful renewal is younger than the renew deadline."""
        with self._lock:
            last = self._last_renew
        return last is not None and self._clock() - last < self.timing.renew_deadline

    # --- one attempt ---------------------------------------------------------------------------

    def try_acquire_or_renew(self) -> bool:
        """Read the Lease and act on it once; True when this process holds it afterwards."""
        try:
            lease = self.client.get(Lease, self.name, namespace=self.namespace)
        except ApiError as error:
            if error.status.code != 404:
                log.warning("leader election: cannot read Lease %s/%s: %s", self.namespace, self.name, error)
                return False
            lease = None
        record = _record(lease) if lease is not None else None
        now = self._clock()
        if record is not None and (self._observed is None or self._observed[0] != record):
            self._observed = (record, now)
        observed_since = self._observed[1] if self._observed is not None and record is not None else None
        action = decide(self.identity, record, observed_since, now)
        if action is Action.WAIT:
            return False
        stamp = _now_micro()
        spec: dict[str, Any] = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": round(self.timing.lease_duration),
            "renewTime": stamp,
        }
        if action is Action.RENEW and record is not None:
            spec["acquireTime"] = record.acquire_time or stamp
            spec["leaseTransitions"] = record.transitions
        else:
            spec["acquireTime"] = stamp
            spec["leaseTransitions"] = (record.transitions + 1) if record is not None else 0
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": spec,
        }
        try:
            if action is Action.CREATE:
                self.client.create(Lease.from_dict(body))
            else:
                assert record is not None
                body["metadata"]["resourceVersion"] = record.resource_version
                self.client.replace(Lease.from_dict(body))
        except ApiError as error:
            # 409: someone else wrote it first (a racing candidate, or the holder renewing).
            if error.status.code not in (409, 422):
                log.warning("leader election: cannot write Lease %s/%s: %s", self.namespace, self.name, error)
            return False
        except Exception as error:  # network errors: the next attempt retries
            log.warning("leader election: cannot write Lease %s/%s: %s", self.namespace, self.name, error)
            return False
        with self._lock:
            self._last_renew = now
        if action is not Action.RENEW:
            log.info("leader election: %s acquired Lease %s/%s", self.identity, self.namespace, self.name)
        return True

    # --- loops ---------------------------------------------------------------------------------

    def acquire(self) -> None:
        """Block until this process holds the Lease (a standby waits here)."""
        log.info("leader election: %s waiting for Lease %s/%s", self.identity, self.namespace, self.name)
        while not self._stop.is_set():
            try:
                if self.try_acquire_or_renew():
                    return
            except Exception as error:
                log.warning("leader election: attempt failed: %s", error)
            self._stop.wait(self.timing.retry_period * random.uniform(1.0, 1.2))
        raise RuntimeError("leader election stopped before the Lease was acquired")

    def keep_renewing(self, on_lost: Callable[[], None]) -> threading.Thread:
        """Renew every retry period in one thread; a second thread watches the deadline, so a
        renewal stuck in a slow request cannot hide that leadership is gone."""

        def renew() -> None:
            while not self._stop.wait(self.timing.retry_period):
                try:
                    self.try_acquire_or_renew()
                except Exception as error:
                    log.warning("leader election: renewal failed: %s", error)

        def watch() -> None:
            while not self._stop.wait(min(0.25, self.timing.retry_period / 4)):
                if not self.is_leader():
                    log.error(
                        "leader election: Lease %s/%s not renewed for %.1f s: leadership lost",
                        self.namespace,
                        self.name,
                        self.timing.renew_deadline,
                    )
                    on_lost()
                    return

        threads = [
            threading.Thread(target=renew, name="lease-renew", daemon=True),
            threading.Thread(target=watch, name="lease-watch", daemon=True),
        ]
        for thread in threads:
            thread.start()
        return threads[1]

    def release(self) -> None:
        """Give the Lease up at once (graceful shutdown), so a standby need not wait for expiry."""
        self._stop.set()
        if not self.is_leader():
            return
        with self._lock:
            self._last_renew = None
        try:
            lease = self.client.get(Lease, self.name, namespace=self.namespace)
            if _record(lease).holder != self.identity:
                return
            body = lease.to_dict()
            body["spec"].update({"holderIdentity": "", "leaseDurationSeconds": 1, "renewTime": _now_micro()})
            self.client.replace(Lease.from_dict(body))
            log.info("leader election: %s released Lease %s/%s", self.identity, self.namespace, self.name)
        except Exception as error:  # the Lease then expires on its own
            log.warning("leader election: cannot release Lease %s/%s: %s", self.namespace, self.name, error)


class NotLeader(RuntimeError):
    """A write was attempted by a process that no longer (or not yet) holds the Lease."""
