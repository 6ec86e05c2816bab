"""`sovereign-operator run`: start kopf with the handlers, standalone (no peering objects)."""

from __future__ import annotations

import asyncio
import logging

import kopf

# Importing the module registers the kopf handlers (and the index that feeds the periodic loop).
from sovereign_operator import handlers


def run_operator(namespaces: list[str] | None, health_port: int, verbose: bool) -> int:
    handlers.STATE.health_port = health_port
    # kopf installs its own log format; a second handler would print every line twice.
    kopf.configure(verbose=verbose)
    if not verbose:
        # lightkube's HTTP client logs every request at INFO; keep the log about decisions.
        for name in ("httpx", "httpx2"):
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        # The loop serves what kopf indexes, so these namespaces are the loop's too.
        kopf.run(
            standalone=True,
            clusterwide=not namespaces,
            namespaces=namespaces or (),
        )
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 0
    return 0
