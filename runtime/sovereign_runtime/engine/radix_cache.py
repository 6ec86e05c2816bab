"""Radix-tree prefix cache over full KV pages.

Design: the cache works in whole pages (``block_size`` tokens, one KV block each). A node's key is a run
of tokens whose length is a multiple of ``block_size`` and it owns one block id per page. Only full pages
are cached, so a block table is always [cached pages..., private pages...] with no copy-on-write and the
kernel's block tables stay plain. Splits happen on page boundaries; children are keyed by their first
page. The tree holds one pool reference to each block it owns; a sequence that reuses a prefix adds its
own reference and locks the path (lock counts up to the root) so eviction never takes a page in use.
Eviction removes least-recently-used unlocked leaves and drops the tree's references.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from itertools import count

from .block_manager import BlockPool


class RadixNode:
    __slots__ = ("blocks", "children", "key", "last_access", "lock_ref", "parent")

    def __init__(self, key: tuple[int, ...], blocks: list[int], parent: RadixNode | None) -> None:
        self.key = key
        self.blocks = blocks
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.lock_ref = 0
        self.last_access = 0


class RadixCache:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.root = RadixNode((), [], None)
        self.root.lock_ref = 1  # never evicted
        self._clock = count(1)
        self.num_cached_blocks = 0
        self.num_evictable_blocks = 0
        self.queries = 0  # tokens looked up
        self.hits = 0  # tokens found

    # ---- lookup -------------------------------------------------------------------------------------
    def match_prefix(self, tokens: list[int], max_tokens: int | None = None) -> tuple[RadixNode, list[int]]:
        """Longest cached full-page prefix of ``tokens[:max_tokens]``.

        Returns the deepest matched node (split so that it ends exactly at the match) and the block ids
        of the matched pages. Does not lock; call :meth:`lock` to keep the prefix while it is in use.
        """
        bs = self.block_size
        limit = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
        pages = limit // bs
        node, blocks, page = self.root, [], 0
        now = next(self._clock)
        node.last_access = now
        while page < pages:
            child = node.children.get(tuple(tokens[page * bs : (page + 1) * bs]))
            if child is None:
                break
            common = self._common_pages(child.key, tokens, page, pages)
            if common < len(child.blocks):
                child = self._split(child, common)
            child.last_access = now
            blocks.extend(child.blocks)
            page += common
            node = child
        return node, blocks

    def record_lookup(self, queried: int, hit: int) -> None:
        self.queries += queried
        self.hits += hit

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    # ---- locking ------------------------------------------------------------------------------------
    def lock(self, node: RadixNode) -> None:
        while node is not None:
            if node.lock_ref == 0:
                self.num_evictable_blocks -= len(node.blocks)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node is not None:
            if node.lock_ref <= 0:
                raise RuntimeError("unlock of an unlocked radix node")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.num_evictable_blocks += len(node.blocks)
            node = node.parent

    # ---- insertion ----------------------------------------------------------------------------------
    def insert(self, tokens: list[int], blocks: list[int]) -> int:
        """Cache the full pages ``tokens`` (``len(blocks) * block_size`` tokens) held in ``blocks``.

        Pages already cached keep their existing block (the caller's duplicate is simply not referenced
        by the tree); new pages take a tree reference on the caller's block. Returns the number of new
        pages.
        """
        bs = self.block_size
        pages = len(blocks)
        assert len(tokens) >= pages * bs
        node, page = self.root, 0
        now = next(self._clock)
        while page < pages:
            first = tuple(tokens[page * bs : (page + 1) * bs])
            child = node.children.get(first)
            if child is None:
                leaf = RadixNode(tuple(tokens[page * bs : pages * bs]), list(blocks[page:]), node)
                leaf.last_access = now
                node.children[first] = leaf
                self.pool.incref(leaf.blocks)
                self.num_cached_blocks += len(leaf.blocks)
                self.num_evictable_blocks += len(leaf.blocks)
                return pages - page
            common = self._common_pages(child.key, tokens, page, pages)
            if common < len(child.blocks):
                child = self._split(child, common)
            child.last_access = now
            page += common
            node = child
        return 0

    # ---- eviction -----------------------------------------------------------------------------------
    def evict(self, num_blocks: int) -> int:
        """Evict LRU unlocked leaves until ``num_blocks`` blocks went back to the pool (or none is left)."""
        heap = [(n.last_access, id(n), n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_blocks:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[: self.block_size]]
            self.num_cached_blocks -= len(leaf.blocks)
            self.num_evictable_blocks -= len(leaf.blocks)
            freed += self.pool.decref(leaf.blocks)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def reset(self) -> None:
        """Drop every unlocked page (used by tests and when the cache is turned off at runtime)."""
        self.evict(self.num_cached_blocks)

    # ---- helpers ------------------------------------------------------------------------------------
    def _common_pages(self, key: tuple[int, ...], tokens: list[int], page: int, pages: int) -> int:
        bs = self.block_size
        n = min(len(key) // bs, pages - page)
        common = 1  # the first page matched through the children dict
        while common < n:
            a = common * bs
            if key[a : a + bs] != tuple(tokens[(page + common) * bs : (page + common + 1) * bs]):
                break
            common += 1
        return common

    def _split(self, node: RadixNode, pages: int) -> RadixNode:
        """Cut ``node`` after ``pages`` pages; returns the new upper part (which takes the node's place)."""
        bs = self.block_size
        parent = node.parent
        assert parent is not None and 0 < pages < len(node.blocks)
        upper = RadixNode(node.key[: pages * bs], node.blocks[:pages], parent)
        upper.lock_ref = node.lock_ref  # every lock on node passes through upper
        upper.last_access = node.last_access
        parent.children[node.key[:bs]] = upper
        node.key = node.key[pages * bs :]
        node.blocks = node.blocks[pages:]
        node.parent = upper
        upper.children[node.key[:bs]] = node
        return upper

    def _nodes(self) -> Iterator[RadixNode]:
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def cached_pages(self) -> Iterator[tuple[list[int], bool]]:
        """Each node's blocks and whether a sequence holds it locked (for reference-count checks)."""
        for n in self._nodes():
            yield n.blocks, n.lock_ref > 0

    def check(self) -> None:
        """Invariants: counters match the tree, locks are monotone up the path, keys are page runs."""
        cached = evictable = 0
        for n in self._nodes():
            assert len(n.key) == len(n.blocks) * self.block_size and n.blocks
            assert n.parent is not None and n.parent.children[n.key[: self.block_size]] is n
            assert n.lock_ref >= 0 and n.parent.lock_ref >= n.lock_ref
            for b in n.blocks:
                assert self.pool.ref_count(b) >= 1
            cached += len(n.blocks)
            evictable += len(n.blocks) if n.lock_ref == 0 else 0
        assert cached == self.num_cached_blocks, (cached, self.num_cached_blocks)
        assert evictable == self.num_evictable_blocks, (evictable, self.num_evictable_blocks)
