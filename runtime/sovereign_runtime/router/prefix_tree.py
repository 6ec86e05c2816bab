"""An approximate radix tree of the prompts each worker has recently served.

The router cannot see a worker's real KV cache, so it remembers which worker received which prompt
text and assumes the worker still holds that prefix. Entries age out by LRU when the tree grows past its
character budget, just as the worker's own cache evicts old prefixes.

This runs on the router's one event loop, so nothing may walk the whole tree per request: eviction
takes leaves from a heap kept as the tree changes (an insert over the budget evicts about one leaf), and
nodes are numbers into parallel lists that hold only strings, ints and dicts of them. CPython's cyclic
garbage collector does not track such dicts, so a full collection passes over the lists' entries
without following them (12-16 ms at a full tree): with a node object per node, a full tree (2M
characters, ~100,000 nodes) made every full collection stop the router's event loop for ~100 ms.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

ROOT = 0


@dataclass(frozen=True)
class PrefixMatch:
    worker: str | None
    matched_chars: int


class ApproximatePrefixTree:
    def __init__(self, max_chars: int = 2_000_000) -> None:
        # Node n: the edge text leading to it, its parent, its children by their first character, and
        # the workers that used it with the logical time they last did.
        self._key: list[str] = [""]
        self._parent: list[int] = [-1]  # the root has no parent
        self._children: list[dict[str, int]] = [{}]
        self._workers: list[dict[str, int]] = [{}]
        self._free: list[int] = []
        # Eviction candidates: (a time no later than the node's oldest worker time, node), at most one
        # entry per node (`_queued`); every leaf but the root has one. Stale entries are fixed when they
        # surface: an inner node's is dropped (it is queued again when it becomes a leaf), a leaf used
        # since is pushed back under its oldest time. Only leaves whose entry surfaced are detached
        # here (remove_worker queues afresh), so a freed slot has no entry to pass on.
        self._heap: list[tuple[int, int]] = []
        self._queued = bytearray(1)
        self._clock = itertools.count(1)
        self._chars = 0
        self.max_chars = max_chars

    @property
    def size_chars(self) -> int:
        return self._chars

    @property
    def node_count(self) -> int:
        """Nodes in use, the root included."""
        return len(self._key) - len(self._free)

    def insert(self, text: str, worker: str) -> None:
        now = next(self._clock)
        key_of, children_of, workers_of = self._key, self._children, self._workers
        node = ROOT
        workers_of[node][worker] = now
        rest = text
        while rest:
            child = children_of[node].get(rest[0])
            if child is None:
                child = self._new_node(rest, node, {worker: now})
                children_of[node][rest[0]] = child
                self._chars += len(rest)
                self._queue(child, now)
                break
            key = key_of[child]
            common = _common_prefix_len(key, rest)
            if common < len(key):
                child = self._split(child, common)
            workers_of[child][worker] = now
            node, rest = child, rest[common:]
        if self._chars > self.max_chars:
            self._evict()

    def match(self, text: str, alive: set[str] | None = None) -> PrefixMatch:
        """The worker holding the longest prefix of `text` (most recent on ties), among `alive` ones."""
        key_of, children_of, workers_of = self._key, self._children, self._workers
        node, rest, matched = ROOT, text, 0
        best = PrefixMatch(None, 0)
        while rest:
            child = children_of[node].get(rest[0])
            if child is None:
                break
            key = key_of[child]
            common = _common_prefix_len(key, rest)
            latest, latest_time = None, -1
            for worker, used in workers_of[child].items():
                if used > latest_time and (alive is None or worker in alive):
                    latest, latest_time = worker, used
            if latest is None:
                break
            matched += common
            best = PrefixMatch(latest, matched)
            if common < len(key):
                break
            node, rest = child, rest[common:]
        return best

    def remove_worker(self, worker: str) -> None:
        """Forget `worker` everywhere (it left the pool). One walk of the whole tree: membership
        changes are rare, requests never come here."""
        order = self._nodes_top_down()
        for node in order:
            self._workers[node].pop(worker, None)
        # Children before parents: a parent whose last child goes may become empty in turn.
        leaves = []
        for node in reversed(order):
            if node == ROOT or self._children[node]:
                continue
            if self._workers[node]:
                leaves.append(node)
            else:
                self._detach(node)
        # Every remaining leaf's oldest time may have moved: queue them afresh.
        self._heap = [(min(self._workers[leaf].values()), leaf) for leaf in leaves]
        heapq.heapify(self._heap)
        self._queued = bytearray(len(self._key))
        for leaf in leaves:
            self._queued[leaf] = 1

    def _new_node(self, key: str, parent: int, workers: dict[str, int]) -> int:
        if self._free:
            node = self._free.pop()  # a detached leaf: its children dict is empty
            self._key[node], self._parent[node], self._workers[node] = key, parent, workers
            return node
        self._key.append(key)
        self._parent.append(parent)
        self._children.append({})
        self._workers.append(workers)
        self._queued.append(0)
        return len(self._key) - 1

    def _queue(self, node: int, oldest: int) -> None:
        if not self._queued[node]:
            self._queued[node] = 1
            heapq.heappush(self._heap, (oldest, node))

    def _split(self, child: int, at: int) -> int:
        """Put a node for the first `at` characters of `child`'s edge above it; return that node."""
        parent, key = self._parent[child], self._key[child]
        head = self._new_node(key[:at], parent, dict(self._workers[child]))
        self._children[parent][key[0]] = head
        self._key[child] = key[at:]
        self._parent[child] = head
        self._children[head][key[at]] = child
        return head

    def _evict(self) -> None:
        """Drop least recently used (leaf, worker) pairs until the tree is within its budget. A leaf
        that lost its last worker is detached, and its parent becomes a leaf in turn."""
        heap, queued = self._heap, self._queued
        parent_of, children_of, workers_of = self._parent, self._children, self._workers
        while self._chars > self.max_chars and heap:
            entry_time, node = heap[0]
            if children_of[node]:
                heapq.heappop(heap)  # an inner node now: not a candidate until it is a leaf again
                queued[node] = 0
                continue
            workers = workers_of[node]
            oldest = min(workers, key=workers.__getitem__)
            if workers[oldest] != entry_time:
                heapq.heapreplace(heap, (workers[oldest], node))  # used since it was queued
                continue
            del workers[oldest]
            if workers:
                heapq.heapreplace(heap, (min(workers.values()), node))
                continue
            heapq.heappop(heap)
            queued[node] = 0
            parent = parent_of[node]
            self._detach(node)
            if parent != ROOT and not children_of[parent]:
                self._queue(parent, min(workers_of[parent].values()))

    def _detach(self, node: int) -> None:
        key = self._key[node]
        del self._children[self._parent[node]][key[0]]
        self._chars -= len(key)
        self._key[node], self._workers[node] = "", {}  # let the text go now, not at reuse
        self._free.append(node)

    def _nodes_top_down(self) -> list[int]:
        """Every node in use, each after its parent."""
        out, stack = [], [ROOT]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(self._children[node].values())
        return out


def _common_prefix_len(a: str, b: str) -> int:
    # Slice comparisons (memcmp in C) with a binary search, not a Python loop per character: prompts
    # run to thousands of characters and this runs on every request.
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low]; a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle
    return low
