"""Copy variants of the DuplexKV rotation engine that exist only for bench/kv_rotation.py to compare with
the engine's own methods ("batched", "runs"). Each is a `DuplexRotationEngine` with its `_copy_pages`
step replaced, so streams, events, validation and byte counts are the engine's own:
- "staged": device pages gathered (swap-out) or scattered (swap-in) on the GPU through a bounded
  staging buffer (index_select / index_copy_, ~1.7 TB/s), one copy per run of consecutive host pages.
  Wins when device pages are scattered but host pages are contiguous (`PageAllocator.alloc_lowest`);
  costs an extra HBM read+write (~3 % of the copy time at 55 GB/s), serialized with the copies on one
  stream. On the H200 it stayed below "batched" (docs/benchmarks.md, KV rotation).
- "per_page": one copy per page.
`make_engine(name, ...)` builds any of the four by name.
"""

from __future__ import annotations

from typing import Final, NamedTuple

import torch

from sglang_ext.kvcache.copy_plan import Run
from sglang_ext.kvcache.duplex import Direction, DuplexRotationEngine
from sglang_ext.kvcache.host_pool import HostKVPool
from sglang_ext.kvcache.pool import KVPool

VARIANTS: Final = ("staged", "per_page")
ALL_METHODS: Final = ("batched", "staged", "runs", "per_page")
DEFAULT_STAGING_BYTES: Final = 128 << 20  # per direction; 64 Llama-3-8B pages


class HostRun(NamedTuple):
    row: int  # first staging row
    host: int  # first host page
    n: int


class StagedChunk(NamedTuple):
    dev_pages: list[int]  # staging row i holds device page dev_pages[i]
    host_runs: list[HostRun]  # rows [row, row + n) <-> host pages [host, host + n)


def plan_staged(dev: list[int], host: list[int], capacity: int) -> list[StagedChunk]:
    """Pairs sorted by host page, cut into chunks of at most `capacity` staging rows; a host run that
    crosses a chunk boundary is split there. Only the host side decides how many link copies there are:
    the device side of a chunk moves on the GPU."""
    if capacity < 1:
        raise ValueError(f"staging capacity must be at least one page, got {capacity}")
    chunks: list[StagedChunk] = []
    dev_pages: list[int] = []
    host_runs: list[HostRun] = []
    for h, d in sorted(zip(host, dev, strict=True)):
        if len(dev_pages) == capacity:
            chunks.append(StagedChunk(dev_pages, host_runs))
            dev_pages, host_runs = [], []
        row = len(dev_pages)
        dev_pages.append(d)
        if host_runs and h == host_runs[-1].host + host_runs[-1].n:
            r = host_runs[-1]
            host_runs[-1] = HostRun(r.row, r.host, r.n + 1)
        else:
            host_runs.append(HostRun(row, h, 1))
    if dev_pages:
        chunks.append(StagedChunk(dev_pages, host_runs))
    return chunks


class StagedRotationEngine(DuplexRotationEngine):
    """The "staged" variant. `staging_bytes`: the staging buffer per direction, rounded down to whole
    pages (at least one)."""

    def __init__(self, pool: KVPool, host: HostKVPool, staging_bytes: int = DEFAULT_STAGING_BYTES,
                 compute_stream: torch.cuda.Stream | None = None) -> None:
        super().__init__(pool, host, method="runs", compute_stream=compute_stream)
        self.staging_pages = max(1, staging_bytes // self.page_bytes)
        self._staging: dict[Direction, torch.Tensor] = {}

    def _copy_pages(self, direction: Direction, dev: list[int], host: list[int], stream: int) -> None:
        chunks = plan_staged(dev, host, self.staging_pages)
        staging = self._staging_buffer(direction, min(self.staging_pages, len(dev)))
        order = torch.tensor([d for c in chunks for d in c.dev_pages], dtype=torch.long)
        if self.is_cuda:
            # Pinned + non_blocking: building the index never syncs; torch's pinned allocator keeps the
            # source block until the copy (queued on this side stream) has read it.
            order = order.pin_memory().to(self.pool.device, non_blocking=True)
        pool, hdata = self.pool.data, self.host.data
        start = 0
        for c in chunks:
            k = len(c.dev_pages)
            idx = order[start:start + k]
            start += k
            # Reusing the buffer for the next chunk is safe: everything here runs in one stream's order.
            if direction == "out":
                torch.index_select(pool, 0, idx, out=staging[:k])
                for r in c.host_runs:
                    hdata[r.host:r.host + r.n].copy_(staging[r.row:r.row + r.n], non_blocking=True)
            else:
                for r in c.host_runs:
                    staging[r.row:r.row + r.n].copy_(hdata[r.host:r.host + r.n], non_blocking=True)
                pool.index_copy_(0, idx, staging[:k])

    def _staging_buffer(self, direction: Direction, need: int) -> torch.Tensor:
        """Bounded by `staging_pages`; grown to the largest chunk seen, never beyond. Allocated while the
        direction's stream is current, so the caching allocator ties the block to that stream."""
        buf = self._staging.get(direction)
        if buf is None or buf.shape[0] < need:
            shape = (need, *self.pool.data.shape[1:])
            buf = torch.empty(shape, dtype=self.pool.data.dtype, device=self.pool.device)
            self._staging[direction] = buf
        return buf


class PerPageRotationEngine(DuplexRotationEngine):
    """The "per_page" variant: one copy per page."""

    def __init__(self, pool: KVPool, host: HostKVPool, compute_stream: torch.cuda.Stream | None = None) -> None:
        super().__init__(pool, host, method="runs", compute_stream=compute_stream)

    def _copy_pages(self, direction: Direction, dev: list[int], host: list[int], stream: int) -> None:
        self._copy_runs(direction, [Run(d, h, 1) for d, h in zip(dev, host, strict=True)])


def make_engine(name: str, pool: KVPool, host: HostKVPool, staging_bytes: int = DEFAULT_STAGING_BYTES,
                compute_stream: torch.cuda.Stream | None = None) -> DuplexRotationEngine:
    """The engine with method `name`, or the bench variant of that name (`staging_bytes`: "staged" only)."""
    match name:
        case "batched" | "runs":
            return DuplexRotationEngine(pool, host, method=name, compute_stream=compute_stream)
        case "staged":
            return StagedRotationEngine(pool, host, staging_bytes, compute_stream)
        case "per_page":
            return PerPageRotationEngine(pool, host, compute_stream)
    raise ValueError(f"rotation method must be one of {', '.join(ALL_METHODS)}, got {name!r}")


def effective_method(name: str, engine: DuplexRotationEngine) -> str:
    """What `engine` really does: a variant's name, or the engine's method after any fallback."""
    return name if name in VARIANTS else engine.method
