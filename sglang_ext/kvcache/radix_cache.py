"""Radix tree over token ids whose edges are whole KV pages.

Each node's key is a token run whose length is a multiple of `page_size`; its value is the
pages holding that run's KV. Children are keyed by their first page of tokens, so splits only
ever happen at page boundaries. `lock_ref` counts requests using a node or any descendant; every page in a node with
`lock_ref == 0` is evictable (eviction removes leaves, then their parents in turn).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any

from sglang_ext.kvcache.base import MatchResult, PrefixCache, SizeInfo

_clock = itertools.count()


class _Node:
    __slots__ = ("children", "key", "last_access", "lock_ref", "pages", "parent")

    def __init__(self, parent: _Node | None, key: tuple[int, ...], pages: list[int]) -> None:
        self.children: dict[tuple[int, ...], _Node] = {}
        self.parent = parent
        self.key = key
        self.pages = pages
        self.lock_ref = 0
        self.last_access = next(_clock)


class RadixCache(PrefixCache):
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.root = _Node(None, (), [])
        self.root.lock_ref = 1  # never evicted
        self._cached_pages = 0
        self._evictable_pages = 0

    # ---- lookup -----------------------------------------------------------------------------
    def _first_page(self, tokens: tuple[int, ...] | list[int], start: int = 0) -> tuple[int, ...]:
        return tuple(tokens[start : start + self.page_size])

    def _match_len(self, key: tuple[int, ...], tokens: list[int], start: int) -> int:
        """Tokens of `key` matched by tokens[start:], rounded down to whole pages."""
        ps = self.page_size
        n = min(len(key), len(tokens) - start)
        n -= n % ps  # only whole pages count: compare page slices, not tokens (a long prompt has thousands)
        if key[:n] == tuple(tokens[start : start + n]):
            return n  # the usual case, one comparison in C
        i = 0
        while i < n and key[i : i + ps] == tuple(tokens[start + i : start + i + ps]):
            i += ps
        return i

    def match_prefix(self, tokens: list[int]) -> MatchResult:
        node, pages, pos = self.root, [], 0
        usable = len(tokens) - len(tokens) % self.page_size
        while pos < usable:
            child = node.children.get(self._first_page(tokens, pos))
            if child is None:
                break
            m = self._match_len(child.key, tokens, pos)  # whole pages only: a partial last page never matches
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = next(_clock)
            pages.extend(child.pages)
            pos += m
            node = child
        return MatchResult(pages, pos, node)

    def _split(self, node: _Node, at: int) -> _Node:
        """Split `node` after `at` tokens; returns the new upper half."""
        assert node.parent is not None and 0 < at < len(node.key) and at % self.page_size == 0
        np_ = at // self.page_size
        upper = _Node(node.parent, node.key[:at], node.pages[:np_])
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        node.parent.children[self._first_page(upper.key)] = upper
        node.key, node.pages, node.parent = node.key[at:], node.pages[np_:], upper
        upper.children[self._first_page(node.key)] = node
        return upper

    # ---- insert -------------------------------------------------------------------------------
    def insert(self, tokens: list[int], pages: list[int]) -> MatchResult:
        if len(tokens) != len(pages) * self.page_size:
            raise ValueError("insert takes whole pages: len(tokens) must equal len(pages) * page_size")
        match = self.match_prefix(tokens)
        if match.num_tokens == len(tokens):
            return match
        node = match.node
        start = match.num_tokens // self.page_size
        leaf = _Node(node, tuple(tokens[match.num_tokens :]), list(pages[start:]))
        node.children[self._first_page(leaf.key)] = leaf
        self._cached_pages += len(leaf.pages)
        self._evictable_pages += len(leaf.pages)
        return MatchResult(match.pages + leaf.pages, len(tokens), leaf)

    # ---- locking ------------------------------------------------------------------------------
    def lock(self, node: Any) -> None:
        n: _Node | None = node
        while n is not None and n is not self.root:
            if n.lock_ref == 0:
                self._evictable_pages -= len(n.pages)
            n.lock_ref += 1
            n = n.parent

    def unlock(self, node: Any) -> None:
        n: _Node | None = node
        while n is not None and n is not self.root:
            if n.lock_ref <= 0:
                raise RuntimeError("unlock of an unlocked radix node")
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._evictable_pages += len(n.pages)
            n = n.parent

    # ---- eviction -----------------------------------------------------------------------------
    def _leaves(self) -> list[_Node]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            if not n.children and n is not self.root:
                out.append(n)
            stack.extend(n.children.values())
        return out

    def evict(self, num_pages: int) -> list[int]:
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_pages:
            _, _, n = heapq.heappop(heap)
            parent = n.parent
            assert parent is not None
            del parent.children[self._first_page(n.key)]
            freed.extend(n.pages)
            self._cached_pages -= len(n.pages)
            self._evictable_pages -= len(n.pages)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    # ---- introspection ------------------------------------------------------------------------
    def size_info(self) -> SizeInfo:
        return SizeInfo(self._cached_pages, self._evictable_pages)

    def all_pages(self) -> list[int]:
        out: list[int] = []
        stack = [self.root]
        while stack:
            n = stack.pop()
            out.extend(n.pages)
            stack.extend(n.children.values())
        return out

    def check_integrity(self) -> None:
        cached = evictable = 0
        seen: set[int] = set()
        stack = [self.root]
        while stack:
            n = stack.pop()
            if n is not self.root:
                assert len(n.key) == len(n.pages) * self.page_size > 0, "key/pages length mismatch"
                assert n.parent is not None and n.parent.children.get(self._first_page(n.key)) is n
                child_locks = sum(c.lock_ref for c in n.children.values())
                assert n.lock_ref >= child_locks, "a node is locked less than its children"
                assert n.lock_ref >= 0
                for p in n.pages:
                    assert p not in seen, f"page {p} appears twice in the radix tree"
                    seen.add(p)
                cached += len(n.pages)
                if n.lock_ref == 0:
                    evictable += len(n.pages)
            stack.extend(n.children.values())
        assert cached == self._cached_pages, f"cached pages {cached} != counter {self._cached_pages}"
        assert evictable == self._evictable_pages, (
            f"evictable pages {evictable} != counter {self._evictable_pages}"
        )

    def reset(self) -> list[int]:
        if any(c.lock_ref for c in self.root.children.values()):
            raise RuntimeError("cannot reset the prefix cache while requests use it")
        pages = self.all_pages()
        self.root.children.clear()
        self._cached_pages = self._evictable_pages = 0
        return pages
