"""Host-memory KV pool for rotated-out requests (SuperInfer's rotary state).

Same block-first layout as the device `KVPool` (one page = every layer's K and V for `page_size`
tokens, contiguous), so a page moves between the pools as one segment. Pinned when the device is a
GPU, so copies run asynchronously at link speed.
"""

from __future__ import annotations

import torch

from sglang_ext.kvcache.allocator import PageAllocator
from sglang_ext.kvcache.pool import KVGeometry


class HostKVPool:
    def __init__(self, geometry: KVGeometry, num_pages: int, pin: bool, data: torch.Tensor | None = None) -> None:
        """`data`: storage to adopt (host_memory.host_kv_tensor: exact-size, NUMA-placed, registered)."""
        if num_pages < 2:
            raise ValueError(f"host KV pool needs at least 2 pages (one is reserved), got {num_pages}")
        g = geometry
        self.geometry = g
        self.num_pages = num_pages
        shape = (num_pages, g.num_layers, 2, g.page_size, g.num_kv_heads, g.head_dim)
        if data is None:
            data = torch.empty(shape, dtype=g.dtype, device="cpu", pin_memory=pin)
        elif tuple(data.shape) != shape or data.dtype != g.dtype:
            raise ValueError(f"host KV storage is {tuple(data.shape)} {data.dtype}, the pool needs {shape} {g.dtype}")
        self.data = data
        self.allocator = PageAllocator(num_pages)  # page 0 unused: keeps ids symmetric with the GPU pool

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def used_bytes(self) -> int:
        return (self.allocator.capacity - self.allocator.num_free) * self.geometry.page_bytes
