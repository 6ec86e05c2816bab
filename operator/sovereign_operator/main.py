"""`sovereign-operator run`: start kopf with the handlers, standalone (no peering objects), and
optionally only while this replica holds the leader-election Lease (leadership.py)."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from dataclasses import dataclass, field

import kopf
from lightkube import Client

# Importing the module registers kopf's startup and cleanup (the informers, queues and the loop).
from sovereign_operator import handlers, metrics
from sovereign_operator.kube import FIELD_MANAGER
from sovereign_operator.leadership import LeaderElector, LeaseTiming, NotLeader, default_identity

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeaderElection:
    """Where the Lease lives and how fast it moves (see leadership.LeaseTiming)."""

    namespace: str
    name: str = "sovereign-operator"
    identity: str = field(default_factory=default_identity)
    timing: LeaseTiming = field(default_factory=LeaseTiming)


def run_operator(
    namespaces: list[str] | None,
    health_port: int,
    verbose: bool,
    leader_election: LeaderElection | None = None,
) -> int:
    # kopf installs its own log format; a second handler would print every line twice.
    kopf.configure(verbose=verbose)
    if not verbose:
        # lightkube's HTTP client logs every request at INFO, kopf every handler call ("Handler
        # ... succeeded", thousands a minute at fleet scale); keep the log about decisions.
        for name in ("httpx", "httpx2", "kopf.objects"):
            logging.getLogger(name).setLevel(logging.WARNING)
    if leader_election is None:
        handlers.STATE.health_port = health_port
        return _run_kopf(namespaces)

    # A standby must answer its probes while it waits, so health and metrics are served from a
    # thread of their own for the whole life of the process (kopf's startup then serves none).
    handlers.STATE.health_port = 0
    if health_port:
        _serve_health_in_thread(handlers.STATE.health_host, health_port)
    elector = LeaderElector(
        Client(field_manager=FIELD_MANAGER),
        leader_election.namespace,
        leader_election.name,
        leader_election.identity,
        leader_election.timing,
    )
    metrics.LEADER.set(0)
    elector.acquire()
    metrics.LEADER.set(1)

    def lost() -> None:
        # Exit at once rather than stop gracefully: a graceful stop could still write. The
        # Deployment restarts the process, which then waits as a standby.
        os._exit(1)

    elector.keep_renewing(on_lost=lost)

    def fence() -> None:
        if not elector.is_leader():
            raise NotLeader(f"{leader_election.identity} does not hold the leader Lease")

    handlers.STATE.write_fence = fence
    try:
        return _run_kopf(namespaces)
    finally:
        # SIGTERM: kopf has finished its in-flight handlers; hand over without waiting for expiry.
        elector.release()
        metrics.LEADER.set(0)


def _run_kopf(namespaces: list[str] | None) -> int:
    # kopf runs the startup and cleanup handlers; the informers watch these namespaces (handlers.py).
    handlers.STATE.namespaces = tuple(namespaces or ())
    try:
        kopf.run(
            standalone=True,
            clusterwide=not namespaces,
            namespaces=namespaces or (),
        )
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 0
    return 0


def _serve_health_in_thread(host: str, port: int) -> None:
    started = threading.Event()

    def serve() -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(metrics.start_server(host, port))
        except OSError as error:
            log.error("cannot serve /metrics and /healthz on :%d: %s", port, error)
            return
        finally:
            started.set()
        log.info("metrics and health on :%d (/metrics, /healthz)", port)
        loop.run_forever()

    threading.Thread(target=serve, name="health", daemon=True).start()
    started.wait(10)
