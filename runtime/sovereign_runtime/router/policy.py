"""Which worker gets a request: pure policies over the router's view of its workers."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from .health import BreakerState, CircuitBreaker, FailureKind
from .prefix_tree import ApproximatePrefixTree

Role = Literal["worker", "prefill", "decode"]


@dataclass
class Worker:
    url: str
    role: Role
    # `ready` is set by health checks and 503 answers: the worker takes new work (not starting, not
    # draining). The breaker tracks the worker's own failures. Only ready workers whose breaker admits
    # traffic get requests.
    ready: bool = True
    in_flight: int = 0
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)

    @property
    def alive(self) -> bool:
        """Not taken out for its own failures (an open breaker); a half-open one is on trial."""
        return self.breaker.state is not BreakerState.OPEN

    @property
    def routable(self) -> bool:
        return self.ready and self.breaker.admits()


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

    def __init__(
        self,
        failure_threshold: int = 3,
        cooldown_s: float = 5.0,
        max_cooldown_s: float = 60.0,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self._clock = clock
        self._workers: dict[str, Worker] = {}
        self._by_role: dict[Role, list[Worker]] = {}

    def _breaker(self) -> CircuitBreaker:
        breaker = CircuitBreaker(self.failure_threshold, self.cooldown_s, self.max_cooldown_s)
        if self._clock is not None:
            breaker.clock = self._clock
        return breaker

    def set_members(self, role: Role, urls: set[str]) -> list[str]:
        """Replace the members of one role; returns the URLs that left (so policies can forget them)."""
        gone = [u for u, w in self._workers.items() if w.role == role and u not in urls]
        for url in gone:
            del self._workers[url]
        for url in urls:
            if url not in self._workers:
                self._workers[url] = Worker(url=url, role=role, breaker=self._breaker())
        # Members by role, kept with the membership: every request asks for them.
        self._by_role[role] = [w for w in self._workers.values() if w.role == role]
        return gone

    def workers(self, role: Role | None = None) -> list[Worker]:
        if role is None:
            return list(self._workers.values())
        return list(self._by_role.get(role, ()))

    def has_members(self, role: Role) -> bool:
        return bool(self._by_role.get(role))

    def routable(self, role: Role, exclude: frozenset[str] | set[str] = frozenset()) -> list[Worker]:
        return [w for w in self._by_role.get(role, ()) if w.routable and w.url not in exclude]

    def get(self, url: str) -> Worker | None:
        return self._workers.get(url)

    def record_success(self, worker: Worker) -> None:
        """The worker answered (any status but 503 for a request): it works, whatever the request was."""
        worker.breaker.record_success()

    def record_failure(self, worker: Worker, kind: FailureKind) -> None:
        """One of the worker's own failures; after `failure_threshold` in a row it leaves rotation.

        Timeouts alone never take out the last routable worker of a role: they may be the router's or the
        network's doing, and answering slowly beats answering every client "no worker is ready".
        """
        others = [w for w in self.routable(worker.role) if w is not worker]
        last_one_standing = not others and worker.breaker.only_timeouts and kind is FailureKind.TIMEOUT
        worker.breaker.record_failure(kind, may_open=not last_one_standing)


def prompt_key(payload: dict) -> str:
    """The text a prefix cache would key on: chat messages' contents or the completion prompt.

    Any JSON object is accepted: whatever is malformed is the worker's to reject, so it contributes
    nothing to the key rather than failing here.
    """
    if isinstance(payload.get("messages"), list):
        parts = []
        for message in payload["messages"]:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, list):  # content parts
                content = "".join(
                    p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
                )
            role = message.get("role")
            parts.append(
                f"{role if isinstance(role, str) else ''}:{content if isinstance(content, str) else ''}\n"
            )
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
