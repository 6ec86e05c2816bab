"""An approximate radix tree of the prompts each worker has recently served.

The router cannot see a worker's real KV cache, so it remembers which worker received which prompt
text and assumes the worker still holds that prefix. Entries age out by LRU when the tree grows past its
character budget, just as the worker's own cache evicts old prefixes.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field


@dataclass
class _Node:
    key: str = ""
    children: dict[str, _Node] = field(default_factory=dict)
    parent: _Node | None = None
    # worker -> logical time it last used this node
    workers: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class PrefixMatch:
    worker: str | None
    matched_chars: int


class ApproximatePrefixTree:
    def __init__(self, max_chars: int = 2_000_000) -> None:
        self._root = _Node()
        self._clock = itertools.count(1)
        self._chars = 0
        self.max_chars = max_chars

    @property
    def size_chars(self) -> int:
        return self._chars

    def insert(self, text: str, worker: str) -> None:
        now = next(self._clock)
        node = self._root
        node.workers[worker] = now
        rest = text
        while rest:
            child = node.children.get(rest[0])
            if child is None:
                child = _Node(key=rest, parent=node)
                node.children[rest[0]] = child
                self._chars += len(rest)
                child.workers[worker] = now
                break
            common = _common_prefix_len(child.key, rest)
            if common < len(child.key):
                child = self._split(child, common)
            child.workers[worker] = now
            node, rest = child, rest[common:]
        if self._chars > self.max_chars:
            self._evict()

    def match(self, text: str, alive: set[str] | None = None) -> PrefixMatch:
        """The worker holding the longest prefix of `text` (most recent on ties), among `alive` ones."""
        node, rest, matched = self._root, text, 0
        best = PrefixMatch(None, 0)
        while rest:
            child = node.children.get(rest[0])
            if child is None:
                break
            common = _common_prefix_len(child.key, rest)
            latest, latest_time = None, -1
            for worker, used in child.workers.items():
                if used > latest_time and (alive is None or worker in alive):
                    latest, latest_time = worker, used
            if latest is None:
                break
            matched += common
            best = PrefixMatch(latest, matched)
            if common < len(child.key):
                break
            node, rest = child, rest[common:]
        return best

    def remove_worker(self, worker: str) -> None:
        stack = [self._root]
        while stack:
            node = stack.pop()
            node.workers.pop(worker, None)
            stack.extend(node.children.values())
        self._prune(self._root)

    def _split(self, child: _Node, at: int) -> _Node:
        parent = child.parent
        assert parent is not None
        head = _Node(key=child.key[:at], parent=parent, workers=dict(child.workers))
        parent.children[head.key[0]] = head
        child.key = child.key[at:]
        child.parent = head
        head.children[child.key[0]] = child
        return head

    def _evict(self) -> None:
        # Drop the least recently used (leaf, worker) pairs until the tree is back under 90 % of its
        # budget: one walk and a heap of leaves, not a walk per evicted entry. A leaf that lost its last
        # worker is detached, and its parent becomes a leaf in turn.
        target = int(self.max_chars * 0.9)
        heap = [
            (min(n.workers.values(), default=0), id(n), n)
            for n in self._iter_nodes()
            if not n.children and n is not self._root
        ]
        heapq.heapify(heap)
        while self._chars > target and heap:
            used, _, leaf = heapq.heappop(heap)
            if leaf.children or leaf.parent is None or min(leaf.workers.values(), default=0) != used:
                continue  # stale: it gained children or a newer user since it was pushed
            oldest = min(leaf.workers, key=leaf.workers.__getitem__, default=None)
            if oldest is not None:
                del leaf.workers[oldest]
            if leaf.workers:
                heapq.heappush(heap, (min(leaf.workers.values()), id(leaf), leaf))
                continue
            parent = leaf.parent
            self._detach(leaf)
            leaf.parent = None
            if parent is not self._root and not parent.children:
                heapq.heappush(heap, (min(parent.workers.values(), default=0), id(parent), parent))

    def _prune(self, node: _Node) -> None:
        for child in list(node.children.values()):
            self._prune(child)
            if not child.workers and not child.children:
                self._detach(child)

    def _detach(self, node: _Node) -> None:
        assert node.parent is not None
        del node.parent.children[node.key[0]]
        self._chars -= len(node.key)

    def _iter_nodes(self) -> list[_Node]:
        out, stack = [], [self._root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
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
