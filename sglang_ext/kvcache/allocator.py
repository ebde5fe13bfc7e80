"""Free-list page allocator over a `KVPool`'s pages (page 0 is reserved)."""

from __future__ import annotations


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        # Hand out low page ids first; deterministic order keeps runs reproducible.
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        self._used = [False] * num_pages
        self._sorted = True  # the free list is in descending order (no free since the last sort)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    @property
    def parked(self) -> frozenset[int]:
        """Pages freed by their owner but not yet back in the free list (none here: `HoldingAllocator`
        parks those that copies in flight still use)."""
        return frozenset()

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"need {n} KV pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._used[p] = True
        return pages

    def alloc_lowest(self, n: int) -> list[int]:
        """`alloc(n)` of the lowest free ids, ascending: pages handed out together then form long runs
        of consecutive ids (a host pool's rotation moves them in few copies even after it has
        fragmented). Sorts the free list if pages were freed since the last sort; it stays nearly
        sorted, so this is close to linear."""
        if not self._sorted:
            self._free.sort(reverse=True)  # alloc pops from the end: lowest ids first
            self._sorted = True
        return self.alloc(n)

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if not self._used[p]:
                raise RuntimeError(f"double free of KV page {p}")
            self._used[p] = False
            self._free.append(p)
        if pages:
            self._sorted = False

    def is_used(self, page: int) -> bool:
        return self._used[page]
