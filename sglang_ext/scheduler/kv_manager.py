"""Moves KV pages between the free list, requests and the prefix cache.

Every page is in exactly one place: free, owned by one request (`req.pages[req.cached_pages:]`),
or owned by the prefix cache. `check` verifies that invariant for tests.
"""

from __future__ import annotations

from collections.abc import Callable

from sglang_ext.kvcache.allocator import OutOfPages, PageAllocator
from sglang_ext.kvcache.base import PrefixCache
from sglang_ext.scheduler.request import Req


class KVManager:
    def __init__(self, allocator: PageAllocator, cache: PrefixCache, page_size: int) -> None:
        self.allocator = allocator
        self.cache = cache
        self.page_size = page_size
        # Told which page indices of a request `cache_prefix` swapped for the cache's twins (rotation
        # drops its eager copies of them).
        self.on_swap: Callable[[Req, list[int]], None] | None = None

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    @property
    def available_pages(self) -> int:
        """Free pages plus pages the cache could give up."""
        return self.allocator.num_free + self.cache.size_info().evictable_pages

    # ---- admission ----------------------------------------------------------------------------
    def match_limit(self, req: Req) -> int:
        """How many leading tokens may come from the cache: at least one token must be computed
        (its logits pick the next token), and prompt logprobs need their positions computed."""
        limit = req.fill_len - 1
        if req.return_logprob:
            first_needed = req.logprob_start + len(req.input_token_logprobs) - 1
            if first_needed < len(req.input_ids) - 1:
                limit = min(limit, max(first_needed, 0))
        return max(limit, 0)

    def admit(self, req: Req) -> None:
        """Match the longest cached prefix and lock it."""
        assert not req.admitted and not req.pages
        match = self.cache.match_prefix(req.fill_ids[: self.match_limit(req)])
        self.cache.lock(match.node)
        req.prefix_node = match.node
        req.pages = list(match.pages)
        req.cached_pages = len(match.pages)
        req.kv_len = match.num_tokens
        req.admitted = True

    # ---- growth -------------------------------------------------------------------------------
    def can_grow(self, req: Req, tokens: int) -> bool:
        need = self.pages_for(tokens) - len(req.pages)
        return need <= self.available_pages

    def grow(self, req: Req, tokens: int) -> None:
        """Ensure pages for KV of `tokens` tokens, evicting cache leaves if needed."""
        need = self.pages_for(tokens) - len(req.pages)
        if need <= 0:
            return
        short = need - self.allocator.num_free
        if short > 0:
            self.allocator.free(self.cache.evict(short))
        if need > self.allocator.num_free:
            raise OutOfPages(f"need {need} KV pages, {self.allocator.num_free} free after eviction")
        req.pages.extend(self.allocator.alloc(need))

    # ---- giving pages back ----------------------------------------------------------------------
    def cache_prefix(self, req: Req) -> None:
        """Insert the request's full computed pages into the cache and re-lock the longer prefix.
        Where another request cached the same tokens first, our copies are freed and theirs used."""
        full = req.kv_len // self.page_size
        if full <= req.cached_pages:
            return
        tokens = req.fill_ids[: full * self.page_size]
        result = self.cache.insert(tokens, req.pages[:full])
        swapped = [i for i in range(req.cached_pages, full) if req.pages[i] != result.pages[i]]
        if swapped:
            self.allocator.free([req.pages[i] for i in swapped])
        if result.node is None:  # caching disabled: pages stay ours
            return
        self.cache.lock(result.node)
        self.cache.unlock(req.prefix_node)
        req.prefix_node = result.node
        req.pages[:full] = result.pages
        req.cached_pages = full
        if swapped and self.on_swap is not None:
            self.on_swap(req, swapped)

    def release(self, req: Req, keep_in_cache: bool = True) -> None:
        """Give back all of a request's pages (finish, abort, or preemption)."""
        if not req.admitted:
            return
        if keep_in_cache:
            self.cache_prefix(req)
        self.allocator.free(req.pages[req.cached_pages :])
        self.cache.unlock(req.prefix_node)
        req.pages, req.cached_pages, req.prefix_node, req.kv_len, req.admitted = [], 0, None, 0, False

    def check(self, live: list[Req], elsewhere: dict[int, str] | None = None) -> None:
        """Assert every page is in exactly one place (tests call this between steps). `elsewhere`:
        pages owned outside requests and the cache (freed while a rotation copy still uses them)."""
        self.cache.check_integrity()
        owners: dict[int, str] = dict(elsewhere or {})
        for p in self.cache.all_pages():
            assert p not in owners, f"cache page {p} is also {owners[p]}"
            owners[p] = "cache"
        for r in live:
            for p in r.pages[r.cached_pages :]:
                assert p not in owners, f"page {p} owned by {r.rid} and {owners[p]}"
                owners[p] = r.rid
            for p in r.pages[: r.cached_pages]:
                assert owners.get(p) == "cache", f"{r.rid}'s prefix page {p} is not in the cache"
        used = {p for p in range(1, self.allocator.num_pages) if self.allocator.is_used(p)}
        assert used == set(owners), f"leaked pages: {sorted(used - set(owners))[:8]}, " \
                                    f"unallocated owned: {sorted(set(owners) - used)[:8]}"
