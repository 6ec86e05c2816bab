"""Leader election: the pure decision, the elector against an in-memory Lease store with the
apiserver's optimistic concurrency, the write fence, and the CLI's refusals."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx2 as httpx
import pytest
from lightkube import ApiError
from lightkube.resources.coordination_v1 import Lease
from sovereign_operator import cli
from sovereign_operator.kube import Kube
from sovereign_operator.leadership import (
    Action,
    LeaderElector,
    LeaseRecord,
    LeaseTiming,
    NotLeader,
    decide,
)

TIMING = LeaseTiming(lease_duration=10, renew_deadline=6, retry_period=1.5)


def api_error(code: int) -> ApiError:
    request = httpx.Request("PUT", "https://apiserver/leases")
    body = {"kind": "Status", "apiVersion": "v1", "code": code, "message": f"HTTP {code}"}
    return ApiError(request=request, response=httpx.Response(code, json=body, request=request))


class LeaseStore:
    """One Lease with the apiserver's rules: create fails if it exists, replace needs the current
    resourceVersion (else 409), every write bumps it."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0
        self.down = False
        self.lock = threading.Lock()

    def get(self, _kind: Any, name: str, namespace: str) -> Lease:
        with self.lock:
            if self.down:
                raise httpx.ConnectError("apiserver unreachable")
            if self.lease is None:
                raise api_error(404)
            return Lease.from_dict(self.lease)

    def create(self, lease: Lease) -> None:
        with self.lock:
            if self.down:
                raise httpx.ConnectError("apiserver unreachable")
            if self.lease is not None:
                raise api_error(409)
            self._store(lease.to_dict())

    def replace(self, lease: Lease) -> None:
        with self.lock:
            if self.down:
                raise httpx.ConnectError("apiserver unreachable")
            body = lease.to_dict()
            assert self.lease is not None
            if body["metadata"].get("resourceVersion") != self.lease["metadata"]["resourceVersion"]:
                raise api_error(409)
            self._store(body)

    def _store(self, body: dict[str, Any]) -> None:
        self.version += 1
        body["metadata"]["resourceVersion"] = str(self.version)
        self.lease = body

    @property
    def holder(self) -> str | None:
        return None if self.lease is None else self.lease["spec"].get("holderIdentity")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def elector(store: LeaseStore, identity: str, clock: Clock, timing: LeaseTiming = TIMING) -> LeaderElector:
    return LeaderElector(store, "ops", "sovereign-operator", identity, timing, clock=clock)  # type: ignore[arg-type]


def record(holder: str, version: str = "1") -> LeaseRecord:
    return LeaseRecord(
        holder=holder, duration_s=10, transitions=0, acquire_time=None, resource_version=version
    )


def test_decide_covers_every_case() -> None:
    assert decide("a", None, None, 0) is Action.CREATE
    assert decide("a", record("a"), 0, 5) is Action.RENEW
    assert decide("a", record(""), 0, 0) is Action.TAKE  # released
    assert decide("a", record("b"), 100, 105) is Action.WAIT
    assert decide("a", record("b"), 100, 110) is Action.TAKE  # unchanged for its whole duration


def test_timing_must_order_retry_deadline_and_duration() -> None:
    with pytest.raises(ValueError, match="retry period < renew deadline < lease duration"):
        LeaseTiming(lease_duration=5, renew_deadline=6, retry_period=1)


def test_one_leader_and_a_standby_that_waits_while_the_holder_renews() -> None:
    store, clock = LeaseStore(), Clock()
    a, b = elector(store, "a", clock), elector(store, "b", clock)
    assert a.try_acquire_or_renew() and store.holder == "a"
    assert not b.try_acquire_or_renew()
    # Far longer than a lease in total, but a renews every retry period: b never takes over.
    for _ in range(20):
        clock.now += TIMING.retry_period
        assert a.try_acquire_or_renew()
        assert not b.try_acquire_or_renew()
    assert store.holder == "a" and a.is_leader() and not b.is_leader()


def test_standby_takes_over_a_holder_that_stopped_renewing_only_after_the_lease_duration() -> None:
    store, clock = LeaseStore(), Clock()
    a, b = elector(store, "a", clock), elector(store, "b", clock)
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()  # b first sees the record now
    clock.now += TIMING.renew_deadline
    assert not a.is_leader(), "the holder must stop writing at its renew deadline"
    assert not b.try_acquire_or_renew()
    clock.now += TIMING.lease_duration - TIMING.renew_deadline
    assert b.try_acquire_or_renew() and store.holder == "b"
    assert store.lease is not None and store.lease["spec"]["leaseTransitions"] == 1
    # The fenced old holder never was leader at the same time as the new one.
    assert not a.is_leader() and b.is_leader()


def test_racing_candidates_cannot_both_win() -> None:
    store, clock = LeaseStore(), Clock()
    a, b = elector(store, "a", clock), elector(store, "b", clock)
    assert a.try_acquire_or_renew()
    a.release()  # holder "" : both may take it now
    real_get = store.get
    seen: list[Lease] = []

    def stale_get(kind: Any, name: str, namespace: str) -> Lease:
        # b reads the same version a read, then a writes first.
        if not seen:
            seen.append(real_get(kind, name, namespace))
        return seen[0]

    assert a.try_acquire_or_renew()
    store.get = stale_get  # type: ignore[method-assign]
    assert not b.try_acquire_or_renew()
    assert store.holder == "a"


def test_release_hands_over_at_once() -> None:
    store, clock = LeaseStore(), Clock()
    a, b = elector(store, "a", clock), elector(store, "b", clock)
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    a.release()
    assert store.holder == "" and not a.is_leader()
    assert b.try_acquire_or_renew() and store.holder == "b"


def test_a_partitioned_holder_loses_leadership_within_its_renew_deadline() -> None:
    store = LeaseStore()
    timing = LeaseTiming(lease_duration=1.0, renew_deadline=0.5, retry_period=0.1)
    a = LeaderElector(store, "ops", "lease", "a", timing)  # type: ignore[arg-type]
    a.acquire()
    lost = threading.Event()
    a.keep_renewing(on_lost=lost.set)
    time.sleep(0.4)
    assert a.is_leader() and not lost.is_set(), "renewals keep it leader"
    store.down = True
    started = time.monotonic()
    assert lost.wait(3)
    assert time.monotonic() - started < timing.lease_duration
    assert not a.is_leader()
    a.release()


def test_the_write_fence_stops_every_write_before_it_reaches_the_client() -> None:
    class NoClient:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"client.{name} called although the fence refused")

    def fence() -> None:
        raise NotLeader("standby")

    kube = Kube(NoClient(), write_fence=fence)  # type: ignore[arg-type]
    child = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "namespace": "y"}}
    for write in (
        kube.apply(child),
        kube.create_event({"apiVersion": "v1", "kind": "Event", "metadata": {"name": "e", "namespace": "y"}}),
        kube.patch_status("y", "x", {"phase": "Ready"}),
    ):
        with pytest.raises(NotLeader):
            asyncio.run(write)


def test_cli_refuses_leader_election_without_a_namespace(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("SOVEREIGN_OPERATOR_NAMESPACE", raising=False)
    assert cli.main(["run", "--leader-elect"]) == 2
    assert "--leader-election-namespace" in capsys.readouterr().err


def test_cli_refuses_inconsistent_timing(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["run", "--leader-elect", "--leader-election-namespace", "ops"]
    assert cli.main([*argv, "--leader-election-renew-deadline", "20"]) == 2
    assert "renew deadline < lease duration" in capsys.readouterr().err
