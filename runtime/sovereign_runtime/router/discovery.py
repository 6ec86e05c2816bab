"""Where the workers are: a static list, or the EndpointSlices of a pool's headless Service (watched)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

MembershipCallback = Callable[[set[str]], None]


def endpoint_urls(slices: dict[str, dict], default_port: int = 8000, port_name: str = "http") -> set[str]:
    """Ready, non-terminating endpoints of a Service's EndpointSlices as worker base URLs."""
    urls: set[str] = set()
    for endpoint_slice in slices.values():
        port = default_port
        for p in endpoint_slice.get("ports") or []:
            if p.get("name") == port_name or len(endpoint_slice["ports"]) == 1:
                port = p.get("port") or default_port
        for endpoint in endpoint_slice.get("endpoints") or []:
            conditions = endpoint.get("conditions") or {}
            # A missing `ready` means ready (the API's convention); terminating pods get no new work.
            if conditions.get("ready") is False or conditions.get("terminating") is True:
                continue
            for address in endpoint.get("addresses") or []:
                host = f"[{address}]" if ":" in address else address
                urls.add(f"http://{host}:{port}")
    return urls


@dataclass
class EndpointSliceWatch:
    """Follows one Service's EndpointSlices with a watch (no polling) and reports the ready members."""

    namespace: str
    service: str
    on_change: MembershipCallback
    retry_seconds: float = 2.0

    async def run(self) -> None:
        from lightkube import AsyncClient
        from lightkube.resources.discovery_v1 import EndpointSlice

        slices: dict[str, dict] = {}
        selector = {"kubernetes.io/service-name": self.service}
        while True:
            try:
                client = AsyncClient()
                slices.clear()
                async for item in client.list(EndpointSlice, namespace=self.namespace, labels=selector):
                    slices[item.metadata.name] = item.to_dict()
                self.on_change(endpoint_urls(slices))
                async for op, item in client.watch(EndpointSlice, namespace=self.namespace, labels=selector):
                    if op == "DELETED":
                        slices.pop(item.metadata.name, None)
                    else:
                        slices[item.metadata.name] = item.to_dict()
                    self.on_change(endpoint_urls(slices))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the apiserver went away or the watch expired: resync
                log.warning(
                    "EndpointSlice watch for %s/%s failed (%s); retrying", self.namespace, self.service, exc
                )
                await asyncio.sleep(self.retry_seconds)
