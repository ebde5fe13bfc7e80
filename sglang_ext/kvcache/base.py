"""Prefix cache interface (RadixAttention-compatible).

Pages inserted into the cache are owned by it; a request that matched a prefix holds a lock on the
matched node so its pages are never evicted while in use. Rotation (host swap) and remote attention
move only a request's *own* pages (those past its locked prefix), so shared prefixes stay intact.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NamedTuple


class MatchResult(NamedTuple):
    pages: list[int]  # cache-owned pages covering the matched tokens
    num_tokens: int  # = len(pages) * page_size
    node: Any  # handle to lock / unlock


class SizeInfo(NamedTuple):
    cached_pages: int
    evictable_pages: int


class PrefixCache(ABC):
    page_size: int

    @abstractmethod
    def match_prefix(self, tokens: list[int]) -> MatchResult:
        """Longest cached prefix of `tokens`, in whole pages. Touches it for LRU."""

    @abstractmethod
    def insert(self, tokens: list[int], pages: list[int]) -> MatchResult:
        """Offer `pages` holding KV of `tokens` (whole pages). Returns the cache's pages for the whole
        range afterwards; where they differ from `pages`, the caller's copies are duplicates to free."""

    @abstractmethod
    def lock(self, node: Any) -> None: ...

    @abstractmethod
    def unlock(self, node: Any) -> None: ...

    @abstractmethod
    def evict(self, num_pages: int) -> list[int]:
        """Drop least-recently-used unlocked leaves until `num_pages` are freed; returns the pages."""

    @abstractmethod
    def size_info(self) -> SizeInfo: ...

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise AssertionError if internal counts or locks are inconsistent."""

    @abstractmethod
    def reset(self) -> list[int]:
        """Drop everything (requires no locks); returns the pages to free."""

    def all_pages(self) -> list[int]:
        return []


class NoPrefixCache(PrefixCache):
    """`--disable-radix-cache`: nothing is ever shared."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size

    def match_prefix(self, tokens: list[int]) -> MatchResult:
        return MatchResult([], 0, None)

    def insert(self, tokens: list[int], pages: list[int]) -> MatchResult:
        return MatchResult(list(pages), len(pages) * self.page_size, None)

    def lock(self, node: Any) -> None:
        pass

    def unlock(self, node: Any) -> None:
        pass

    def evict(self, num_pages: int) -> list[int]:
        return []

    def size_info(self) -> SizeInfo:
        return SizeInfo(0, 0)

    def check_integrity(self) -> None:
        pass

    def reset(self) -> list[int]:
        return []
