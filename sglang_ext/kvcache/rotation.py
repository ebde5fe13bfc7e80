"""Moves KV pages between the device pool and the host pool (the DuplexKV interface).

The scheduler calls `swap_out` / `swap_in` with page lists and gets a `Transfer` back; it never
blocks on one on the hot path:
- `swap_out` is ordered after all compute enqueued so far (the steps that wrote those pages), so the
  device pages may be reused only once `done(t)` is true: the scheduler frees them then.
- `swap_in` must land before the step that reads the pages: `fence(t)` makes the compute stream wait
  for it (no host sync), or the scheduler waits until `done(t)`.
This first version is the reference: plain indexed copies on the caller's stream, so on CPU every
transfer is complete on return. The GPU version keeps the interface.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_ext.kvcache.host_pool import HostKVPool
from sglang_ext.kvcache.pool import KVPool


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
