"""Moves KV pages between the device pool and the host pool (the DuplexKV interface).

The scheduler calls `swap_out` / `swap_in` with page lists and gets a `Transfer` back; it never
blocks on one on the hot path:
- `swap_out` is ordered after all compute enqueued so far (the steps that wrote those pages), so the
  device pages may be reused only once `done(t)` is true: the scheduler frees them then.
- `swap_in` must land before the step that reads the pages: `fence(t)` makes the compute stream wait
  for it (no host sync), or the scheduler waits until `done(t)`. Its device pages may have been
  freed by a request whose last step is still running, so it too is ordered after the compute
  enqueued so far.
- The scheduler frees nothing a transfer still uses before `done(t)`: device and host pages freed
  meanwhile are parked (kvcache/holds.py), cache pages under a copy stay locked.
This first version is the reference: plain indexed copies on the caller's stream, so on CPU every
transfer is complete on return. The GPU version keeps the interface.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import torch

from sglang_ext.kvcache.host_memory import host_kv_tensor, mem_available_bytes
from sglang_ext.kvcache.host_pool import HostKVPool
from sglang_ext.kvcache.pool import KVGeometry, KVPool

logger = logging.getLogger(__name__)

HOST_MEM_SHARE: Final = 0.5  # of MemAvailable, when kv_host_size_gb is not given
HOST_MAX_POOLS: Final = 16  # ... and at most this many times the device pool (a CPU "device" pool is host memory too)


@dataclass
class Transfer:
    direction: str  # "out" (device -> host) or "in"
    num_pages: int
    nbytes: int
    event: torch.cuda.Event | None = None  # None: complete when created


class RotationEngine:
    def __init__(self, pool: KVPool, host: HostKVPool) -> None:
        if pool.geometry != host.geometry:
            raise ValueError("device and host KV pools must share one geometry")
        self.pool = pool
        self.host = host
        self.page_bytes = pool.geometry.page_bytes
        self.bytes_out = 0
        self.bytes_in = 0

    def swap_out(self, dev_pages: list[int], host_pages: list[int]) -> Transfer:
        assert len(dev_pages) == len(host_pages)
        if dev_pages:
            src = torch.tensor(dev_pages, dtype=torch.long, device=self.pool.device)
            dst = torch.tensor(host_pages, dtype=torch.long)
            self.host.data[dst] = self.pool.data[src].to("cpu")
        n = len(dev_pages) * self.page_bytes
        self.bytes_out += n
        return Transfer("out", len(dev_pages), n)

    def swap_in(self, host_pages: list[int], dev_pages: list[int]) -> Transfer:
        assert len(dev_pages) == len(host_pages)
        if dev_pages:
            src = torch.tensor(host_pages, dtype=torch.long)
            dst = torch.tensor(dev_pages, dtype=torch.long, device=self.pool.device)
            self.pool.data[dst] = self.host.data[src].to(self.pool.device)
        n = len(dev_pages) * self.page_bytes
        self.bytes_in += n
        return Transfer("in", len(dev_pages), n)

    def done(self, t: Transfer) -> bool:
        return t.event is None or t.event.query()

    def fence(self, t: Transfer) -> None:
        """Order the compute stream after `t` (a swap-in the next step reads)."""
        if t.event is not None:
            torch.cuda.current_stream(self.pool.device).wait_event(t.event)

    def synchronize(self) -> None:
        """Wait for every transfer (tests, shutdown): never on the hot path."""
        if self.pool.device.type == "cuda":
            torch.cuda.synchronize(self.pool.device)


def make_rotation_engine(pool: KVPool, host: HostKVPool) -> RotationEngine:
    """The engine the scheduler uses: DuplexKV on a GPU (two streams, batched copies), plain copies on CPU."""
    if pool.device.type == "cuda":
        from sglang_ext.kvcache.duplex import DuplexRotationEngine

        return DuplexRotationEngine(pool, host)
    return RotationEngine(pool, host)


def host_kv_bytes(size_gb: float | None, device_pool_bytes: int, meminfo: str | Path = "/proc/meminfo") -> int:
    """Bytes of the host KV pool: `kv_host_size_gb`, else a share of the host's available memory.

    Not all of it: pinned pages cannot be swapped or reclaimed, and taking everything starves the
    tokenizer, the page cache and other workers. Where available memory starts low and grows as memory
    is used (the lent multi-GPU Firecracker machines), the share underestimates: give the size there."""
    if size_gb is not None:
        return int(size_gb * (1 << 30))
    avail = mem_available_bytes(meminfo)
    chosen = min(int(avail * HOST_MEM_SHARE), HOST_MAX_POOLS * device_pool_bytes)
    logger.info("host KV pool: %.2f GiB (kv_host_size_gb not set: %.0f%% of %.2f GiB available, at most %dx "
                "the device pool)", chosen / 2**30, HOST_MEM_SHARE * 100, avail / 2**30, HOST_MAX_POOLS)
    return chosen


def make_host_pool(geometry: KVGeometry, nbytes: int, device: torch.device) -> HostKVPool:
    """Pageable memory for a CPU engine; for a GPU, memory pinned at its exact size on the host NUMA
    node next to the GPU where that is known (host_memory.py: the Grace path)."""
    pages = nbytes // geometry.page_bytes + 1  # + the reserved page 0
    if pages < 2:
        raise ValueError(f"the host KV pool ({nbytes} bytes) is smaller than one KV page "
                         f"({geometry.page_bytes} bytes): raise kv_host_size_gb")
    if device.type != "cuda":
        return HostKVPool(geometry, pages, pin=False)
    alloc = host_kv_tensor(geometry, pages, device)
    return HostKVPool(geometry, pages, pin=True, data=alloc.tensor)
