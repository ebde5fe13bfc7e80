"""Radix prefix cache: matching at page granularity, splits, locks, LRU eviction, integrity."""

from __future__ import annotations

import random

import pytest

from sglang_ext.kvcache.allocator import PageAllocator
from sglang_ext.kvcache.radix_cache import RadixCache

P = 4


def _insert(c: RadixCache, alloc: PageAllocator, tokens: list[int]) -> list[int]:
    pages = alloc.alloc(len(tokens) // P)
    res = c.insert(tokens, pages)
    alloc.free([m for m, t in zip(pages, res.pages, strict=True) if m != t])
    return res.pages


def test_match_is_page_aligned() -> None:
    c, a = RadixCache(P), PageAllocator(64)
    toks = list(range(100, 112))
    pages = _insert(c, a, toks)
    m = c.match_prefix([*toks, 1, 2])
    assert m.num_tokens == 12 and m.pages == pages
    assert c.match_prefix(toks[:7]).num_tokens == 4  # partial page does not match
    assert c.match_prefix([1, *toks]).num_tokens == 0
    c.check_integrity()


def test_split_and_share() -> None:
    c, a = RadixCache(P), PageAllocator(64)
    t1 = list(range(16))
    t2 = list(range(8)) + [99] * 8
    p1 = _insert(c, a, t1)
    p2 = _insert(c, a, t2)
    assert p2[:2] == p1[:2] and p2[2:] != p1[2:]
    assert c.size_info().cached_pages == 6
    assert a.num_free == 63 - 6
    c.check_integrity()


def test_locked_nodes_survive_eviction_and_lru_order() -> None:
    c, a = RadixCache(P), PageAllocator(64)
    old = list(range(8))
    new = [50 + i for i in range(8)]
    _insert(c, a, old)
    _insert(c, a, new)
    m = c.match_prefix(new)
    c.lock(m.node)
    assert c.size_info().evictable_pages == 2
    freed = c.evict(10)
    assert len(freed) == 2  # only the unlocked one
    assert c.match_prefix(old).num_tokens == 0 and c.match_prefix(new).num_tokens == 8
    c.unlock(m.node)
    c.check_integrity()
    with pytest.raises(RuntimeError):
        c.unlock(m.node)


def test_evict_least_recent_first() -> None:
    c, a = RadixCache(P), PageAllocator(64)
    seqs = [[k * 100 + i for i in range(4)] for k in range(3)]
    for s in seqs:
        _insert(c, a, s)
    c.match_prefix(seqs[0])  # touch the first: the second is now the oldest
    c.evict(1)
    assert c.match_prefix(seqs[1]).num_tokens == 0
    assert c.match_prefix(seqs[0]).num_tokens == 4 and c.match_prefix(seqs[2]).num_tokens == 4


def test_random_operations_keep_invariants() -> None:
    rng = random.Random(0)
    c, a = RadixCache(P), PageAllocator(400)
    locked = []
    for _ in range(400):
        op = rng.random()
        if op < 0.5:
            n = rng.randint(1, 6) * P
            toks = [rng.randint(0, 3) for _ in range(n)]  # small alphabet: many shared prefixes
            if a.num_free < n // P:
                a.free(c.evict(n // P))
            if a.num_free >= n // P:
                _insert(c, a, toks)
        elif op < 0.7:
            m = c.match_prefix([rng.randint(0, 3) for _ in range(rng.randint(0, 24))])
            c.lock(m.node)
            locked.append(m.node)
        elif op < 0.85 and locked:
            c.unlock(locked.pop(rng.randrange(len(locked))))
        else:
            a.free(c.evict(rng.randint(1, 5)))
        c.check_integrity()
        assert sorted(c.all_pages()) == sorted(p for p in range(1, 400) if a.is_used(p))
    for n in locked:
        c.unlock(n)
    a.free(c.reset())
    assert a.num_free == a.capacity


def test_match_stops_at_the_page_of_the_first_difference() -> None:
    """A difference anywhere in a page drops that page and the rest, whatever the position in the page."""
    for diff in range(1, 24):
        c, a = RadixCache(P), PageAllocator(64)
        toks = list(range(500, 524))
        pages = _insert(c, a, toks)
        probe = [*toks[:diff], 7, *toks[diff + 1 :]]
        m = c.match_prefix(probe)
        assert m.num_tokens == diff - diff % P and m.pages == pages[: diff // P]
        c.check_integrity()
