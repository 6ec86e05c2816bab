"""One GET of a pod's JSON health endpoint, shared by the KV-health and output-health monitors.

The error texts end up in condition messages, and a condition is rewritten whenever its message
changes. So they name the kind of failure, never the transport's exact words: a pod that cannot be
reached is "not reachable" whether this round timed out, was refused or found no route (a pod IP
that does not answer ARP gives a timeout one round and EHOSTUNREACH the next). The exact error goes
to the operator's debug log.
"""

from __future__ import annotations

import logging
from typing import Any

import aiohttp

log = logging.getLogger(__name__)


def unreachable_error(timeout_s: float) -> str:
    return f"not reachable within {timeout_s:g} s"


async def get_pod_json(
    session: aiohttp.ClientSession, url: str, timeout_s: float, *, not_found: str | None = None
) -> tuple[dict[str, Any] | None, str | None]:
    """(body, None) for a JSON object whatever the HTTP status (a 503 carries the reason in its
    body), else (None, a stable error). `not_found` replaces the text for a 404."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            if response.status == 404 and not_found is not None:
                return None, not_found
            try:
                body = await response.json(content_type=None)
            except ValueError:
                return None, f"HTTP {response.status} without a JSON body"
            if not isinstance(body, dict):
                return None, f"HTTP {response.status} with an unexpected body"
            return body, None
    except (TimeoutError, aiohttp.ClientError) as error:
        log.debug("GET %s failed: %s: %s", url, type(error).__name__, error)
        return None, unreachable_error(timeout_s)
