"""A foreign-KV partition: one byte budget that serves KV pages of any model geometry.

WEAVER's unified allocator, in slabs: the arena is cut into equal slabs; a slab belongs to one guest
at a time and holds as many of that guest's pages as fit. A guest sees the whole arena as one
paged pool of its own geometry (so the engine's attention backends read it unchanged): its page p
is the byte range [p * page_bytes, (p + 1) * page_bytes), and it may use the pages that lie wholly
inside its slabs. When a guest holds no pages, its slabs go back to the arena for any guest.

    arena  | slab 0 (guest A) | slab 1 (guest B) | slab 2 (free) | slab 3 (guest A) | ...
    A view |p1|p2|p3|p4|      ·                  ·               |p12|p13|p14|p15|
    B view ·                  |q1 |q2 |q3 |      ·               ·

Guest page 0 is never handed out (it may straddle slab 0's start for every guest; padded rows of
CUDA-graph batches write there in the engine's own pool, and the executor keeps the convention).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sglang_ext.kvcache.pool import KVGeometry, KVPool

_DEFAULT_SLABS = 64
_MIN_SLAB = 2 << 20  # a Llama-3-8B page (16 tokens, bf16) is 2 MiB


class GuestPool(KVPool):
    """A KVPool whose storage is the partition's arena viewed in the guest's geometry."""

    def __init__(self, geometry: KVGeometry, arena: torch.Tensor) -> None:
        # Not KVPool.__init__: the arena is the storage, nothing is allocated here.
        g = geometry
        self.geometry = g
        self.page_size = g.page_size
        self.device = arena.device
        self.num_pages = arena.numel() // g.page_bytes
        flat = arena[: self.num_pages * g.page_bytes].view(g.dtype)
        self.data = flat.view(self.num_pages, g.num_layers, 2, g.page_size, g.num_kv_heads, g.head_dim)


@dataclass
class _Guest:
    pool: GuestPool
    slabs: list[int] = field(default_factory=list)
    free: list[int] = field(default_factory=list)  # free pages inside the guest's slabs
    used: int = 0


class ForeignKVPartition:
    def __init__(self, budget_bytes: int, device: torch.device | str, slab_bytes: int | None = None) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"executor memory must be positive, got {budget_bytes} bytes")
        self.device = torch.device(device)
        self.slab_bytes = slab_bytes or min(budget_bytes, max(budget_bytes // _DEFAULT_SLABS, _MIN_SLAB))
        self.num_slabs = budget_bytes // self.slab_bytes
        # Zeroed: the torch backend reads whole pages (a last page's unwritten tail, page 0 as padding)
        # and masks what it must not see, but a masked NaN from uninitialised memory still poisons
        # the weighted sum (0 * NaN), as in the engine's own pool (zero_fill for torch).
        self.arena = torch.zeros(self.num_slabs * self.slab_bytes, dtype=torch.uint8, device=self.device)
        self._free_slabs = list(range(self.num_slabs - 1, -1, -1))
        self._owner: list[str | None] = [None] * self.num_slabs
        self.guests: dict[str, _Guest] = {}

    @property
    def total_bytes(self) -> int:
        return self.arena.numel()

    def attach(self, guest: str, geometry: KVGeometry) -> GuestPool:
        if guest in self.guests:
            if self.guests[guest].pool.geometry != geometry:
                raise ValueError(f"guest {guest!r} is attached with another KV geometry")
            return self.guests[guest].pool
        if geometry.page_bytes > self.slab_bytes:
            raise ValueError(f"a page of guest {guest!r} ({geometry.page_bytes} bytes) is larger than a slab "
                             f"({self.slab_bytes} bytes): give the executor more memory")
        g = self.guests[guest] = _Guest(GuestPool(geometry, self.arena))
        return g.pool

    def detach(self, guest: str) -> None:
        g = self.guests.pop(guest, None)
        if g is None:
            return
        for s in g.slabs:
            self._owner[s] = None
            self._free_slabs.append(s)

    def _slab_pages(self, g: _Guest, slab: int) -> range:
        pb = g.pool.geometry.page_bytes
        lo = -(-slab * self.slab_bytes // pb)
        hi = ((slab + 1) * self.slab_bytes) // pb
        return range(max(lo, 1), hi)  # page 0 is never handed out

    def pages_per_slab(self, guest: str) -> int:
        return self.slab_bytes // self.guests[guest].pool.geometry.page_bytes

    def free_pages(self, guest: str) -> int:
        """Pages the guest could still get: its own free ones plus whole free slabs."""
        g = self.guests[guest]
        return len(g.free) + len(self._free_slabs) * max(self.pages_per_slab(guest) - 1, 0)

    def alloc(self, guest: str, n: int) -> list[int] | None:
        """n pages for the guest, or None (nothing taken) when the partition cannot hold them."""
        g = self.guests[guest]
        while len(g.free) < n:
            if not self._free_slabs:
                return None
            s = self._free_slabs.pop()
            self._owner[s] = guest
            g.slabs.append(s)
            g.free.extend(reversed(self._slab_pages(g, s)))
        pages = [g.free.pop() for _ in range(n)]
        g.used += n
        return pages

    def free(self, guest: str, pages: list[int]) -> None:
        g = self.guests[guest]
        g.free.extend(pages)
        g.used -= len(pages)
        if g.used == 0:  # nothing of this guest left: every slab goes back to the arena
            for s in g.slabs:
                self._owner[s] = None
                self._free_slabs.append(s)
            g.slabs, g.free = [], []

    def used_pages(self, guest: str) -> int:
        return self.guests[guest].used

    def check(self) -> None:
        """Slabs are owned once; a guest's pages lie inside its own slabs (tests call this)."""
        owned = [s for g in self.guests.values() for s in g.slabs]
        assert len(owned) == len(set(owned)), "a slab has two owners"
        assert set(owned).isdisjoint(self._free_slabs), "an owned slab is on the free list"
        for name, g in self.guests.items():
            inside = {p for s in g.slabs for p in self._slab_pages(g, s)}
            assert set(g.free) <= inside, f"guest {name}: a free page lies outside its slabs"
            assert len(set(g.free)) == len(g.free), f"guest {name}: a page is free twice"
            assert g.used + len(g.free) == len(inside), f"guest {name}: pages leaked"
