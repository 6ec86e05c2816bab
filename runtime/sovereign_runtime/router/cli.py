"""`sovereign-runtime router`: flags and start-up of the router process."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
from pathlib import Path

import uvloop
from aiohttp import web

from ..program import UsageError
from ..read_deadlines import DeadlineSite, add_read_deadline_flags, read_deadlines
from .app import DEADLINE_GUARD, Router, RouterConfig, create_app
from .discovery import EndpointSliceWatch
from .policy import POLICIES
from .upstream import UpstreamError, worker_address


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--policy", choices=sorted(POLICIES), default="cache-aware")
    parser.add_argument("--worker", nargs="+", default=[], metavar="URL", help="unified workers (static)")
    parser.add_argument("--prefill", nargs="+", default=[], metavar="URL", help="prefill workers (static)")
    parser.add_argument("--decode", nargs="+", default=[], metavar="URL", help="decode workers (static)")
    parser.add_argument("--namespace", help="namespace of the Services to discover workers from")
    parser.add_argument("--worker-service", help="headless Service of a unified pool (EndpointSlice watch)")
    parser.add_argument("--prefill-service", help="headless Service of the prefill pool")
    parser.add_argument("--decode-service", help="headless Service of the decode pool")
    parser.add_argument("--health-interval", type=float, default=5.0, metavar="SECONDS")
    parser.add_argument("--max-attempts", type=int, default=3)
    parser.add_argument(
        "--failure-threshold",
        type=int,
        default=3,
        metavar="N",
        help="a worker's own failures in a row (connect errors, timeouts, failed checks) that take it out",
    )
    parser.add_argument(
        "--breaker-cooldown",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="how long a worker stays out before one trial request (doubles while trials fail, up to 60 s)",
    )
    parser.add_argument(
        "--internal-token-file",
        metavar="PATH",
        help="the deployment's internal token, sent to decode workers (else $SOVEREIGN_INTERNAL_TOKEN)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=64 * 1024 * 1024,
        metavar="BYTES",
        help="larger request bodies get 413",
    )
    parser.add_argument(
        "--wait-for-worker",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="hold a request this long for a worker when none can take it (a one-replica pool"
        " restarting, all draining) instead of answering 503 at once; the router stays Ready meanwhile",
    )
    parser.add_argument(
        "--shutdown-delay",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="on SIGTERM keep serving this long with /health/ready answering 503, so load balancers"
        " (kube-proxy, an ingress) stop sending new connections before the listener closes",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="after the listener closes, how long in-flight requests (streams) may take to finish",
    )
    add_read_deadline_flags(parser)
    parser.add_argument(
        "--disaggregation-threshold",
        type=int,
        default=512,
        metavar="CHARS",
        help="prompts with fewer uncached characters are prefilled on the decode worker",
    )


def validate_router_args(args: argparse.Namespace) -> str | None:
    """One line naming what is wrong, or None."""
    static = bool(args.worker or args.prefill or args.decode)
    discovered = bool(args.worker_service or args.prefill_service or args.decode_service)
    if not static and not discovered:
        return "router: give workers with --worker URL... (unified) or --prefill URL... --decode URL..., or Services with --worker-service / --prefill-service --decode-service"
    if (args.worker or args.worker_service) and (
        args.prefill or args.decode or args.prefill_service or args.decode_service
    ):
        return "router: --worker/--worker-service (unified) cannot be combined with prefill/decode workers"
    if bool(args.prefill or args.prefill_service) != bool(args.decode or args.decode_service):
        return "router: disaggregated routing needs both prefill and decode workers"
    for url in [*(args.worker or []), *(args.prefill or []), *(args.decode or [])]:
        try:
            worker_address(url)
        except UpstreamError as exc:
            return f"router: {exc}"
    if discovered and not args.namespace:
        return "router: --namespace is required with --*-service discovery"
    if args.max_attempts < 1:
        return "router: --max-attempts must be at least 1"
    if args.failure_threshold < 1:
        return "router: --failure-threshold must be at least 1"
    if args.breaker_cooldown <= 0:
        return "router: --breaker-cooldown must be positive"
    if args.max_body_bytes < 1024:
        return "router: --max-body-bytes must be at least 1024"
    if not args.wait_for_worker >= 0:
        return "router: --wait-for-worker must be 0 or more seconds"
    if not args.shutdown_delay >= 0:
        return "router: --shutdown-delay must be 0 or more seconds"
    if not args.drain_timeout > 0:
        return "router: --drain-timeout must be positive"
    return None


def read_secret(path: str | None, env: str, flag: str) -> str | None:
    """A secret from a file (stripped), else from the environment, else None."""
    if path:
        try:
            value = Path(path).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise SystemExit(f"router: {flag} {path}: {exc.strerror or exc}") from None
        if not value:
            raise SystemExit(f"router: {flag} {path}: the file is empty")
        return value
    return os.environ.get(env) or None


def run_command(args: argparse.Namespace) -> int:
    """`sovereign-runtime router`: bad flags are a usage error (one line, exit status 2)."""
    problem = validate_router_args(args)
    if problem:
        raise UsageError(problem)
    run_router(args)
    return 0


def run_router(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = RouterConfig(
        policy=args.policy,
        health_interval_s=args.health_interval,
        max_attempts=args.max_attempts,
        failure_threshold=args.failure_threshold,
        breaker_cooldown_s=args.breaker_cooldown,
        max_body_bytes=args.max_body_bytes,
        internal_token=read_secret(
            args.internal_token_file, "SOVEREIGN_INTERNAL_TOKEN", "--internal-token-file"
        ),
        disaggregation_threshold_chars=args.disaggregation_threshold,
        static_members={"worker": args.worker, "prefill": args.prefill, "decode": args.decode},
        read_deadlines=read_deadlines(args),
        wait_for_worker_s=args.wait_for_worker,
    )
    router = Router(config)
    for role, service in (
        ("worker", args.worker_service),
        ("prefill", args.prefill_service),
        ("decode", args.decode_service),
    ):
        if service:
            router.expect_discovery(role)
    app = create_app(router)

    async def start_discovery(app: web.Application) -> None:
        for role, service in (
            ("worker", args.worker_service),
            ("prefill", args.prefill_service),
            ("decode", args.decode_service),
        ):
            if service:
                watch = EndpointSliceWatch(
                    args.namespace, service, on_change=lambda urls, role=role: router.set_members(role, urls)
                )
                router.add_background(watch.run())
        # Check newly discovered members at once rather than a health interval later.
        router.add_background(_prompt_checks(router))

    app.on_startup.append(start_discovery)
    app.on_startup.append(freeze_startup_objects)
    # uvloop: the router is all socket I/O and event-loop bookkeeping, which uvloop does in C (about a
    # third less CPU per proxied request than asyncio's own loop, bench/router_overhead.py).
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(
            serve_router(
                app,
                args.host,
                args.port,
                shutdown_delay_s=args.shutdown_delay,
                drain_timeout_s=args.drain_timeout,
                router=router,
            )
        )


async def serve_router(
    app: web.Application,
    host: str,
    port: int,
    *,
    shutdown_delay_s: float = 0.0,
    drain_timeout_s: float = 60.0,
    router: Router | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT; then keep serving `shutdown_delay_s` with readiness 503 (endpoints
    take a moment to forget this pod), close the listener and let in-flight requests finish (up to
    `drain_timeout_s`). Not `web.run_app`: its site cannot watch connections for slow clients
    (read_deadlines.py). `stop` replaces the signals (tests)."""
    log = logging.getLogger("sovereign_runtime.router")
    guard = app[DEADLINE_GUARD]
    runner = web.AppRunner(
        app, access_log=None, shutdown_timeout=drain_timeout_s, **guard.deadlines.runner_kwargs()
    )
    await runner.setup()
    loop = asyncio.get_running_loop()
    if stop is None:  # a test passes its own
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    try:
        site = DeadlineSite(runner, host, port, guard)
        await site.start()
        log.info("router listening on %s", site.name)
        await stop.wait()
        if router is not None:
            router.stopping = True
        in_flight = router.in_flight() if router is not None else 0
        log.info(
            "router stopping: %d request(s) in flight; serving %g s more with readiness 503, then up to %g s"
            " for in-flight requests",
            in_flight,
            shutdown_delay_s,
            drain_timeout_s,
        )
        await asyncio.sleep(shutdown_delay_s)
    finally:
        started = loop.time()
        await runner.cleanup()
        log.info("router stopped in %.1f s after closing its listener", loop.time() - started)


async def freeze_startup_objects(app: web.Application) -> None:
    """Move everything start-up made (modules, the app, the clients) out of the collector's reach.

    They live as long as the process, yet every gen1 and gen2 collection walked them again: with them
    in, a collection paused the loop for up to 6 ms (gen1) and 44 ms (gen2) under load, in front of
    every request queued behind it. After the freeze a collection walks only what requests made."""
    gc.collect()
    gc.freeze()


async def _prompt_checks(router: Router) -> None:
    await asyncio.sleep(0.5)
    await router.check_all()
