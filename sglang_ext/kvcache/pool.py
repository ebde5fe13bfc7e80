"""Paged KV memory of one worker.

Block-first layout: one page holds every layer's K and V for `page_size` tokens, contiguous,
so rotating a page to host memory is one segment copy:

    data[page, layer, 0 = K | 1 = V, offset, kv_head, head_dim]

Attention reads per-layer views (strided over pages). Page 0 is never handed out: padded rows
of CUDA-graph batches write there.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class KVGeometry(NamedTuple):
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    @property
    def page_bytes(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.page_size * self.num_kv_heads * self.head_dim * itemsize


class KVPool:
    def __init__(
        self, geometry: KVGeometry, num_pages: int, device: torch.device | str, zero_fill: bool = True
    ) -> None:
        """`zero_fill=False` leaves every page but page 0 uninitialised: only for attention backends
        that never read a slot before it is written (the model runner decides)."""
        if num_pages < 2:
            raise ValueError(f"KV pool needs at least 2 pages (one is reserved), got {num_pages}")
        g = geometry
        self.geometry = g
        self.page_size = g.page_size
        self.num_pages = num_pages
        self.device = torch.device(device)
        alloc = torch.zeros if zero_fill else torch.empty
        self.data = alloc(
            (num_pages, g.num_layers, 2, g.page_size, g.num_kv_heads, g.head_dim),
            dtype=g.dtype,
            device=self.device,
        )
        if not zero_fill:  # page 0 still starts zeroed: padded rows of CUDA-graph batches attend to it
            self.data[0].zero_()

    def k_view(self, layer: int) -> torch.Tensor:
        """[pages, page_size, kv_heads, head_dim], strided over pages."""
        return self.data[:, layer, 0]

    def v_view(self, layer: int) -> torch.Tensor:
        return self.data[:, layer, 1]

    def layer_view(self, layer: int) -> torch.Tensor:
        """[pages, 2, page_size, kv_heads, head_dim]: FlashInfer's NHD paged layout, strided."""
        return self.data[:, layer]

    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        page = torch.div(loc, self.page_size, rounding_mode="floor")
        off = loc - page * self.page_size
        self.data[page, layer, 0, off] = k.to(self.data.dtype)
        self.data[page, layer, 1, off] = v.to(self.data.dtype)

    @property
    def total_bytes(self) -> int:
        return self.data.numel() * self.data.element_size()
