"""`sovereign-operator run`: start kopf with the handlers, standalone (no peering objects)."""

from __future__ import annotations

import asyncio
import logging

import kopf


def run_operator(namespaces: list[str] | None, health_port: int, verbose: bool) -> int:
    from sovereign_operator import handlers  # registers the handlers

    handlers.STATE.health_port = health_port
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    kopf.configure(verbose=verbose)
    try:
        kopf.run(
            standalone=True,
            clusterwide=not namespaces,
            namespaces=namespaces or (),
        )
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 0
    return 0
