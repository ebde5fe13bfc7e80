"""A page allocator that knows which pages transfers in flight still read or write.

A rotation copy runs beside model execution (on the GPU, on its own stream): until it has landed,
its device and host pages must not be handed to anyone else, even if their owner lets go of them
(a finished request, a dropped eager copy, an evicted cache leaf). A freed page that a transfer
still holds is *parked*: out of the free list until the transfer's hold is released.
"""

from __future__ import annotations

from sglang_ext.kvcache.allocator import PageAllocator


class HoldingAllocator(PageAllocator):
    def __init__(self, num_pages: int) -> None:
        super().__init__(num_pages)
        self._holds: dict[int, int] = {}  # page -> transfers in flight on it
        self._parked: set[int] = set()  # freed while held

    @property
    def parked(self) -> frozenset[int]:
        return frozenset(self._parked)

    def hold(self, pages: list[int]) -> None:
        for p in pages:
            if not self.is_used(p):
                raise RuntimeError(f"hold of unallocated page {p}")
            self._holds[p] = self._holds.get(p, 0) + 1

    def unhold(self, pages: list[int]) -> None:
        ready: list[int] = []
        for p in pages:
            n = self._holds[p] - 1
            if n:
                self._holds[p] = n
                continue
            del self._holds[p]
            if p in self._parked:
                self._parked.remove(p)
                ready.append(p)
        super().free(ready)

    def free(self, pages: list[int]) -> None:
        ready: list[int] = []
        for p in pages:
            if p not in self._holds:
                ready.append(p)
            elif p in self._parked or not self.is_used(p):
                raise RuntimeError(f"double free of page {p}")
            else:
                self._parked.add(p)
        super().free(ready)
