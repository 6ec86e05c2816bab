"""List, then watch, the LLMDeployments and each kind the operator renders (and pods) into the
watch cache: client-go's informer in a few lines.

One informer per kind and scope, with the operator's label selector (children) or none
(LLMDeployments). The scopes follow `run --namespace`: none, every namespace at once; plain names,
one informer per namespace (what a chart bound to those namespaces allows); globs (kopf's syntax),
every namespace at once, keeping those that match (this needs cluster-wide read access):
- the first LIST fills the cache; `synced` is set after it, and nothing reconciles before every
  kind has synced (so the first reconcile after a restart sees every child and writes nothing);
- the watch continues from the LIST's resourceVersion; a dropped connection resumes from the last
  version seen, after a short backoff;
- an expired version (410 Gone) means events were missed: LIST again, and whatever the cache holds
  that the new LIST does not have is gone (a DELETED is passed on for it);
- every change reaches `on_change(event_type, object)` after the cache has it;
- a kind the apiserver does not serve (LeaderWorkerSet without its CRD) counts as synced and empty,
  and is listed again every ABSENT_RETRY_S.

kopf's own watches are not used: its index handlers (its only way to hold handlers back until a
listing is complete) make its start quadratic in the number of listed objects (14 000 objects:
minutes of CPU and 400 MiB before the first handler ran), its relists deliver no DELETED for objects
removed meanwhile, and a namespace-restricted kopf stops watching a namespace being deleted before
its objects' DELETED events arrive (their last bodies would be served for as long as it runs).
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
from collections.abc import Callable, Iterable
from typing import Any

import httpx2 as httpx
from lightkube import ApiError, AsyncClient

from sovereign_operator.cache import ClusterCache, WatchedKind
from sovereign_operator.kube import api_error_code, api_resource

log = logging.getLogger(__name__)

ChangeHandler = Callable[[str, dict[str, Any]], None]
# Objects per LIST page: a fleet's pods are read in pieces, never held all at once.
LIST_CHUNK = 500
MAX_BACKOFF_S = 30.0
ALL_NAMESPACES = "*"
# How often a kind the apiserver does not serve (a CRD not installed) is looked for again.
ABSENT_RETRY_S = 60.0
_GLOB_CHARS = set("*?[],!")


def informer_scopes(patterns: Iterable[str]) -> list[str]:
    """Where informers list and watch: one namespace each when every pattern is a plain name, else
    all namespaces at once (filtered by `namespace_served`)."""
    names = [p.strip() for p in patterns]
    if not names or any(not n or _GLOB_CHARS & set(n) for n in names):
        return [ALL_NAMESPACES]
    return sorted(set(names))


def namespace_served(name: str, patterns: Iterable[str]) -> bool:
    """Whether `name` matches any of `run --namespace`'s patterns as kopf matches them (no pattern:
    every namespace). A pattern is comma-separated globs; one starting with `!` excludes; a pattern
    whose first glob excludes starts from `*`; an inclusive glob after the first re-includes only
    what the first one matched."""
    patterns = list(patterns)
    if not patterns:
        return True
    for pattern in patterns:
        globs = [glob.strip() for glob in pattern.split(",")]
        if not globs or globs[0].startswith("!"):
            globs.insert(0, "*")
        matches = first = fnmatch.fnmatch(name, globs[0])
        for glob in globs[1:]:
            if glob.startswith("!"):
                matches = matches and not fnmatch.fnmatch(name, glob.lstrip("!"))
            else:
                matches = matches or (first and fnmatch.fnmatch(name, glob))
        if matches:
            return True
    return False


class Informer:
    def __init__(
        self,
        client: AsyncClient,
        kind: WatchedKind,
        cache: ClusterCache,
        served: Callable[[str], bool],
        on_change: ChangeHandler,
        namespace: str = ALL_NAMESPACES,
        labels: dict[str, str] | None = None,
    ) -> None:
        self.client = client
        self.kind = kind
        self.namespace = namespace
        self.labels = labels
        self.cache = cache
        self.served = served
        self.on_change = on_change
        self.synced = asyncio.Event()
        self.lists = 0  # LISTs made (the first and one per expired watch)

    async def run(self) -> None:
        failures = 0
        while True:
            try:
                version = await self._list()
                self.synced.set()
                failures = 0
                await self._watch(version)  # returns when the version expired: list again
            except asyncio.CancelledError:
                raise
            except (ApiError, httpx.HTTPStatusError) as error:
                if api_error_code(error) != 404:
                    failures += 1
                    await self._relist_pause(error, failures)
                    continue
                # The kind is not served (LeaderWorkerSet's CRD not installed; the apiserver's 404
                # for an API group it does not know is plain text, so lightkube raises httpx's
                # error): nothing to wait for before reconciling; look again now and then, and
                # watch once it is there.
                if not self.synced.is_set():
                    log.info(
                        "%s are not served by the apiserver; looking again every %.0f s",
                        self.kind.plural,
                        ABSENT_RETRY_S,
                    )
                self.synced.set()
                await asyncio.sleep(ABSENT_RETRY_S)
            except Exception as error:
                failures += 1
                await self._relist_pause(error, failures)

    async def _relist_pause(self, error: Exception, failures: int) -> None:
        delay = min(MAX_BACKOFF_S, 2.0 ** min(failures, 5))
        log.warning(
            "%s informer (%s): %s; listing again in %.0f s", self.kind.plural, self.namespace, error, delay
        )
        await asyncio.sleep(delay)

    async def _list(self) -> str:
        since = self.cache.mark()
        present: set[tuple[str, str]] = set()
        listing = self.client.list(
            api_resource(self.kind), namespace=self.namespace, labels=self.labels, chunk_size=LIST_CHUNK
        )
        async for item in listing:
            obj = item.to_dict()
            meta = obj["metadata"]
            if not self.served(meta["namespace"]):
                continue
            obj.setdefault("kind", self.kind.kind)
            obj.setdefault("apiVersion", self.kind.api_version)
            present.add((meta["namespace"], meta["name"]))
            self.cache.put(obj)
            self.on_change("ADDED", obj)
        self.lists += 1
        scope = None if self.namespace == ALL_NAMESPACES else self.namespace
        for gone in self.cache.sweep(self.kind.kind, present, since, scope):
            self.on_change("DELETED", gone)
        return listing.resourceVersion

    async def _watch(self, version: str) -> None:
        failures = 0
        while True:
            try:
                stream = self.client.watch(
                    api_resource(self.kind),
                    namespace=self.namespace,
                    labels=self.labels,
                    resource_version=version,
                )
                async for event_type, item in stream:
                    failures = 0
                    obj = item.to_dict()
                    version = obj.get("metadata", {}).get("resourceVersion") or version
                    if event_type not in ("ADDED", "MODIFIED", "DELETED"):
                        continue  # BOOKMARK: only the version moves
                    meta = obj["metadata"]
                    if not self.served(meta.get("namespace", "")):
                        continue
                    obj.setdefault("kind", self.kind.kind)
                    obj.setdefault("apiVersion", self.kind.api_version)
                    if event_type == "DELETED":
                        self.cache.remove(self.kind.kind, meta["namespace"], meta["name"])
                    else:
                        self.cache.put(obj)
                    self.on_change(event_type, obj)
            except asyncio.CancelledError:
                raise
            except ApiError as error:
                if getattr(error.status, "code", None) == 410:
                    log.info(
                        "%s informer (%s): watch expired; listing again", self.kind.plural, self.namespace
                    )
                    return
                failures += 1
                await self._pause(error, failures)
            except Exception as error:  # the connection dropped (apiserver restart): resume
                failures += 1
                await self._pause(error, failures)

    async def _pause(self, error: Exception, failures: int) -> None:
        delay = min(MAX_BACKOFF_S, 0.5 * 2.0 ** min(failures, 6))
        log.warning(
            "%s informer (%s): watch failed (%s); resuming in %.1f s",
            self.kind.plural,
            self.namespace,
            error,
            delay,
        )
        await asyncio.sleep(delay)
