"""Operator metrics on /metrics and a health endpoint on /healthz (one aiohttp server, port 8080)."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

REGISTRY = CollectorRegistry()
RECONCILES = Counter(
    "sovereign_operator_reconciles_total",
    "Reconciles of LLMDeployments by result (applied, unchanged, invalid, failed).",
    ["result"],
    registry=REGISTRY,
)
ERRORS = Counter(
    "sovereign_operator_errors_total",
    "Errors while reconciling, by reason.",
    ["reason"],
    registry=REGISTRY,
)
DURATION = Histogram(
    "sovereign_operator_reconcile_duration_seconds",
    "Time to render and apply one LLMDeployment.",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    registry=REGISTRY,
)
CHILDREN_APPLIED = Counter(
    "sovereign_operator_children_applied_total",
    "Child objects sent with server-side apply, by kind.",
    ["kind"],
    registry=REGISTRY,
)
STATUS_WRITES = Counter(
    "sovereign_operator_status_writes_total",
    "Status patches written (zero in steady state).",
    registry=REGISTRY,
)

LEADER = Gauge(
    "sovereign_operator_leader",
    "1 while this replica holds the leader-election Lease (or runs without leader election), else 0.",
    registry=REGISTRY,
)
LEADER.set(1)


async def _metrics(_: web.Request) -> web.Response:
    return web.Response(body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _healthz(_: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def build_app() -> web.Application:
    app = web.Application()
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/healthz", _healthz)
    return app


async def start_server(host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(build_app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


QUEUE_DEPTH = Gauge(
    "sovereign_operator_queue_depth",
    "Deployments waiting in or being processed by a work queue (reconcile, status).",
    ["queue"],
    registry=REGISTRY,
)
CACHE_SYNCED = Gauge(
    "sovereign_operator_cache_synced",
    "1 once kopf has listed every watched kind into the watch cache, else 0.",
    registry=REGISTRY,
)
