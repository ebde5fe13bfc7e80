"""Local device pages, a scheduler member (home LOCAL): the default residency of a request's KV.

A candidate's longest cached prefix is matched and locked, and it is admitted with its first chunk's
pages if they fit beside the decoders' reserve. Every release ends here, after the other members
gave back what they hold: its full pages are published to the prefix cache and the rest freed.
"""

from __future__ import annotations

from sglang_ext.scheduler.member import Residency
from sglang_ext.scheduler.request import KVHome, Req
from sglang_ext.scheduler.view import LoopView


class LocalPages(Residency):
    home = KVHome.LOCAL

    def __init__(self, s: LoopView) -> None:
        self.s = s

    def admit(self, r: Req, budget: int, reserve: int) -> int | None:
        kv = self.s.kv
        kv.admit(r)
        n = min(r.fill_len - r.kv_len, budget)
        if kv.pages_for(r.kv_len + max(n, 1)) - len(r.pages) + reserve > kv.available_pages:
            kv.release(r, keep_in_cache=False)
            return None
        if r.num_preemptions == 0:
            r.cached_tokens = r.kv_len
        self.s.start_running(r, self.s.waiting)
        if n:
            kv.grow(r, r.kv_len + n)
        return n

    def first_pages(self, r: Req) -> int | None:
        kv = self.s.kv
        match = kv.cache.match_prefix(r.fill_ids[: kv.match_limit(r)])
        first = min(r.fill_len - match.num_tokens, self.s.chunk)
        return kv.pages_for(match.num_tokens + max(first, 1)) - len(match.pages)

    def release(self, r: Req) -> None:
        """Last of the members: the local pages go (full ones published to the prefix cache)."""
        self.s.kv.release(r, keep_in_cache=True)
