"""The health endpoints of a parallel group's worker node (a pod that is not the leader).

Only the leader serves the API and metrics for the replica; a worker node answers its kubelet's probes
from its ranks' phases in the group's store: ``/health`` (alive: 503 once the group failed),
``/health/startup`` (200 once every rank of this node has loaded its part and follows the leader; before
that 503 with the phase), ``/health/ready`` (the same, as the readiness signal). Plain threads: the node's
first rank blocks in collectives on its main thread.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ..engine.group import JOINING, READY, Member

log = logging.getLogger("sovereign_runtime.server")


def node_report(member: Member, ranks: range) -> tuple[int, dict[str, Any]]:
    """(status, body) of ``/health/startup`` for a node holding ``ranks``."""
    if member.failed is not None:
        return 503, {"phase": "failed", "error": member.failed}
    phases = member.phases(ranks)
    late = {
        r: str(phases.get(r, {}).get("phase", JOINING))
        for r in ranks
        if phases.get(r, {}).get("phase") != READY
    }
    if not late:
        return 200, {"phase": READY, "ranks": list(ranks)}
    slowest = min(late.values(), key=lambda p: (p != JOINING, p))
    detail = ", ".join(f"rank {r}: {phase}" for r, phase in late.items())
    return 503, {"phase": slowest, "detail": detail, "ranks": list(ranks)}


class _Handler(BaseHTTPRequestHandler):
    report: Callable[[str], tuple[int, dict[str, Any]]]

    def do_GET(self) -> None:
        status, body = type(self).report(self.path.split("?", 1)[0])
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        return  # probes every few seconds: not worth a line each


def serve_node_health(
    member: Callable[[], Member | None], ranks: range, host: str, port: int
) -> ThreadingHTTPServer:
    """Answer the node's probes on ``host:port`` from a daemon thread; returns the server. ``member()`` is
    None until this node has reached the group's store."""

    def report(path: str) -> tuple[int, dict[str, Any]]:
        current = member()
        if current is None:
            if path == "/health":
                return 200, {"status": "ok"}
            return 503, {"phase": "joining_group", "detail": "waiting for the leader's rendezvous"}
        return _report(current, path)

    def _report(member: Member, path: str) -> tuple[int, dict[str, Any]]:
        if path == "/health":
            ok = member.failed is None
            return (200, {"status": "ok"}) if ok else (503, {"status": "failed", "error": member.failed})
        if path in ("/health/startup", "/health/ready"):
            return node_report(member, ranks)
        return 404, {"error": f"{path}: a worker node serves only /health, /health/startup and /health/ready"}

    handler = type("NodeHealthHandler", (_Handler,), {"report": staticmethod(report)})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="node-health", daemon=True).start()
    log.info(
        "worker node health on %s:%d (/health, /health/startup, /health/ready)",
        host,
        server.server_address[1],
    )
    return server
