"""`sovereign-operator run`: start kopf with the handlers, standalone (no peering objects)."""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import logging

import kopf


def run_operator(namespaces: list[str] | None, health_port: int, verbose: bool) -> int:
    from sovereign_operator import handlers  # registers the handlers

    # The autoscaler registers its loop's start and stop on import; optional, so the core runs alone.
    if importlib.util.find_spec("sovereign_operator.autoscale.timer") is not None:
        timer = importlib.import_module("sovereign_operator.autoscale.timer")
        # The loop lists LLMDeployments itself: it must serve the same namespaces kopf does.
        timer.serve_namespaces(namespaces or ())

    handlers.STATE.health_port = health_port
    # kopf installs its own log format; a second handler would print every line twice.
    kopf.configure(verbose=verbose)
    if not verbose:
        # lightkube's HTTP client logs every request at INFO; keep the log about decisions.
        for name in ("httpx", "httpx2"):
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        kopf.run(
            standalone=True,
            clusterwide=not namespaces,
            namespaces=namespaces or (),
        )
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 0
    return 0
