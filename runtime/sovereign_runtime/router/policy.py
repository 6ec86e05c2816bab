"""Which worker gets a request: pure policies over the router's view of its workers."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Literal, Protocol

from .prefix_tree import ApproximatePrefixTree

Role = Literal["worker", "prefill", "decode"]


@dataclass
class Worker:
    url: str
    role: Role
    # Set by health checks: `alive` means it answers at all, `ready` that it takes new work (not
    # starting, not draining). Only alive and ready workers get requests.
    alive: bool = True
    ready: bool = True
    in_flight: int = 0
    consecutive_failures: int = 0

    @property
    def routable(self) -> bool:
        return self.alive and self.ready


class RoutingPolicy(Protocol):
    def choose(self, candidates: list[Worker], prompt_key: str) -> Worker: ...

    def record(self, worker: Worker, prompt_key: str) -> None: ...

    def forget(self, worker_url: str) -> None: ...


class RoundRobinPolicy:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: list[Worker], prompt_key: str) -> Worker:
        ordered = sorted(candidates, key=lambda w: w.url)
        return ordered[next(self._counter) % len(ordered)]

    def record(self, worker: Worker, prompt_key: str) -> None:
        pass

    def forget(self, worker_url: str) -> None:
        pass


class LeastLoadPolicy:
    """Fewest in-flight requests; ties rotate so equal workers share the load."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: list[Worker], prompt_key: str) -> Worker:
        lowest = min(w.in_flight for w in candidates)
        tied = sorted((w for w in candidates if w.in_flight == lowest), key=lambda w: w.url)
        return tied[next(self._counter) % len(tied)]

    def record(self, worker: Worker, prompt_key: str) -> None:
        pass

    def forget(self, worker_url: str) -> None:
        pass


class CacheAwarePolicy:
    """Send a prompt to the worker most likely to hold its prefix, unless that would unbalance the pool.

    Like SGLang's router: when loads are balanced, a match covering at least `match_threshold` of the
    prompt wins; a weaker match goes to the least-loaded worker. When the busiest worker has more than
    `balance_abs` requests over the idlest and `balance_rel` times its load, cache affinity is ignored.
    """

    def __init__(
        self,
        match_threshold: float = 0.5,
        balance_abs: int = 16,
        balance_rel: float = 1.5,
        max_chars: int = 2_000_000,
    ) -> None:
        self.match_threshold = match_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.tree = ApproximatePrefixTree(max_chars=max_chars)
        self._least_load = LeastLoadPolicy()

    def choose(self, candidates: list[Worker], prompt_key: str) -> Worker:
        loads = [w.in_flight for w in candidates]
        imbalanced = max(loads) - min(loads) > self.balance_abs and max(loads) > self.balance_rel * min(loads)
        if not imbalanced and prompt_key:
            by_url = {w.url: w for w in candidates}
            match = self.tree.match(prompt_key, alive=set(by_url))
            if match.worker is not None and match.matched_chars >= self.match_threshold * len(prompt_key):
                return by_url[match.worker]
        return self._least_load.choose(candidates, prompt_key)

    def record(self, worker: Worker, prompt_key: str) -> None:
        if prompt_key:
            self.tree.insert(prompt_key, worker.url)

    def forget(self, worker_url: str) -> None:
        self.tree.remove_worker(worker_url)


POLICIES = {"cache-aware": CacheAwarePolicy, "least-load": LeastLoadPolicy, "round-robin": RoundRobinPolicy}


def make_policy(name: str) -> RoutingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; valid: {', '.join(POLICIES)}") from None


class WorkerPool:
    """The router's view of its workers, kept in step with discovery and health checks."""

    def __init__(self, failure_threshold: int = 3) -> None:
        self.failure_threshold = failure_threshold
        self._workers: dict[str, Worker] = {}

    def set_members(self, role: Role, urls: set[str]) -> list[str]:
        """Replace the members of one role; returns the URLs that left (so policies can forget them)."""
        gone = [u for u, w in self._workers.items() if w.role == role and u not in urls]
        for url in gone:
            del self._workers[url]
        for url in urls:
            self._workers.setdefault(url, Worker(url=url, role=role))
        return gone

    def workers(self, role: Role | None = None) -> list[Worker]:
        return [w for w in self._workers.values() if role is None or w.role == role]

    def routable(self, role: Role, exclude: frozenset[str] | set[str] = frozenset()) -> list[Worker]:
        return [w for w in self.workers(role) if w.routable and w.url not in exclude]

    def get(self, url: str) -> Worker | None:
        return self._workers.get(url)

    def record_success(self, worker: Worker) -> None:
        worker.consecutive_failures = 0
        worker.alive = True

    def record_failure(self, worker: Worker) -> None:
        """A failed request or health check; after `failure_threshold` in a row the worker leaves rotation."""
        worker.consecutive_failures += 1
        if worker.consecutive_failures >= self.failure_threshold:
            worker.alive = False


def prompt_key(payload: dict) -> str:
    """The text a prefix cache would key on: chat messages' contents or the completion prompt."""
    if isinstance(payload.get("messages"), list):
        parts = []
        for message in payload["messages"]:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, list):  # content parts
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"{message.get('role', '')}:{content or ''}\n")
        return "".join(parts)
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first
        if isinstance(first, int):
            return ",".join(map(str, prompt))
        if isinstance(first, list):
            return ",".join(map(str, first))
    return ""
