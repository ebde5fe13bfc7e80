"""DuplexKV: the rotation engine on CUDA, swap-out and swap-in on two streams of their own (full duplex).

    compute stream ──[step t writes pages]──●───────────────[step t+1 reads swapped-in pages]──
                                            │ (at the call)                ▲ fence(t_in)
    out stream     ─────────────────────────┴─ wait ─ D->H copies ─● t_out │  done(t_out): free device pages
    in stream      ─────────────────────────┬─ wait ─ H->D copies ─● t_in ─┘
                                            ● (at the call)

- A swap-out waits for everything queued on the compute stream before the call: the steps that wrote
  its pages. A swap-in waits the same way, because the device pages it fills may have been freed by a
  request whose last step is still in flight (the overlap loop frees on the host ahead of the GPU).
- Each transfer records an event: `done(t)` queries it (no sync), `fence(t)` makes the compute stream
  wait for it (no host sync). Nothing on these paths blocks the host; `synchronize()` is for tests and
  shutdown.
- The two directions never wait for each other, so a swap-in and a swap-out use both directions of
  the host link at once (90.8 GB/s measured on the H200 vs 55 GB/s one way).

Few, large copies. A block-first page is one contiguous segment (2 MiB for Llama-3-8B at page 16), and
separate copies of >= 1 MB already reach ~0.9x of the link (measured on the H200), so what matters is how
many API calls and copies a transfer issues, not how they read a page. `method`:
- "batched" (default): the (device, host) pairs merged into runs of consecutive pages on both sides,
  all runs in one `cudaMemcpyBatchAsync` call (memcpy_batch.py). Falls back to "runs" with the reason in
  `fallback_reason` when cuda-python or the API is missing or the call fails.
- "runs": one cudaMemcpyAsync (torch `copy_`) per merged run.
`_copy_pages` is the one step a transfer's copying goes through; the benchmark (bench/kv_rotation.py)
overrides it with the variants it compares these with (bench/rotation_variants.py: a staging buffer
gathered on the GPU, one copy per page); the default follows its figures.

On CPU the same engine runs its host-side logic synchronously (no streams, no events), so the plans are
tested in CI; "batched" falls back to "runs" there.
"""

from __future__ import annotations

import logging
from typing import Final, Literal

import torch

from sglang_ext.kvcache import memcpy_batch
from sglang_ext.kvcache.copy_plan import Run, check_pages, plan_runs
from sglang_ext.kvcache.host_pool import HostKVPool
from sglang_ext.kvcache.pool import KVPool
from sglang_ext.kvcache.rotation import RotationEngine, Transfer

log = logging.getLogger(__name__)

Method = Literal["batched", "runs"]
Direction = Literal["out", "in"]
METHODS: Final = ("batched", "runs")
DEFAULT_METHOD: Final[Method] = "batched"


class DuplexRotationEngine(RotationEngine):
    def __init__(
        self,
        pool: KVPool,
        host: HostKVPool,
        method: Method = DEFAULT_METHOD,
        compute_stream: torch.cuda.Stream | None = None,
        batch_api: str = "auto",
    ) -> None:
        """`compute_stream`: the stream the model runs on; None = the current stream at each call."""
        super().__init__(pool, host)
        if method not in METHODS:
            raise ValueError(f"rotation method must be one of {', '.join(METHODS)}, got {method!r}")
        if not (pool.data.is_contiguous() and host.data.is_contiguous()):
            raise ValueError("rotation needs contiguous device and host pools (pages are addressed by offset)")
        self.requested_method: Method = method
        self.method: Method = method
        self.fallback_reason: str | None = None
        self.compute_stream = compute_stream
        self.is_cuda = pool.device.type == "cuda"
        self.out_stream: torch.cuda.Stream | None = None
        self.in_stream: torch.cuda.Stream | None = None
        self._batch: memcpy_batch.BatchCopy | None = None
        if self.is_cuda:
            self.out_stream = torch.cuda.Stream(pool.device)
            self.in_stream = torch.cuda.Stream(pool.device)
            if not host.data.is_pinned():
                log.warning("host KV pool is not pinned: copies to and from it block the host")
        if method == "batched":
            if not self.is_cuda:
                self._fall_back("no cudaMemcpyBatchAsync on a CPU device")
            else:
                try:
                    self._batch = memcpy_batch.load(batch_api)
                except memcpy_batch.BatchCopyUnavailable as e:
                    self._fall_back(str(e))

    @property
    def batch_api(self) -> str | None:
        return self._batch.api if self._batch is not None and self.method == "batched" else None

    def _fall_back(self, reason: str) -> None:
        self.method, self.fallback_reason = "runs", reason
        log.warning("KV rotation: batched copies unavailable, one copy per run instead: %s", reason)

    # ---- the interface ------------------------------------------------------------------------------
    def swap_out(self, dev_pages: list[int], host_pages: list[int]) -> Transfer:
        check_pages(dev_pages, host_pages, self.pool.num_pages, self.host.num_pages)
        self.bytes_out += len(dev_pages) * self.page_bytes
        return self._transfer("out", dev_pages, host_pages)

    def swap_in(self, host_pages: list[int], dev_pages: list[int]) -> Transfer:
        check_pages(host_pages, dev_pages, self.host.num_pages, self.pool.num_pages)
        self.bytes_in += len(dev_pages) * self.page_bytes
        return self._transfer("in", dev_pages, host_pages)

    def fence(self, t: Transfer) -> None:
        """Order the compute stream after `t` (a swap-in the next step reads); no host sync."""
        if t.event is not None:
            self._compute().wait_event(t.event)

    def synchronize(self) -> None:
        for s in (self.out_stream, self.in_stream):
            if s is not None:
                s.synchronize()

    # ---- mechanics ----------------------------------------------------------------------------------
    def _compute(self) -> torch.cuda.Stream:
        return self.compute_stream or torch.cuda.current_stream(self.pool.device)

    def _transfer(self, direction: Direction, dev: list[int], host: list[int]) -> Transfer:
        n = len(dev)
        if n == 0:
            return Transfer(direction, 0, 0)
        if not self.is_cuda:  # CPU: every copy is complete on return
            self._copy_pages(direction, dev, host, 0)
            return Transfer(direction, n, n * self.page_bytes)
        stream = self.out_stream if direction == "out" else self.in_stream
        assert stream is not None
        stream.wait_stream(self._compute())  # an event recorded on the compute stream now, waited on there
        with torch.cuda.device(self.pool.device), torch.cuda.stream(stream):
            self._copy_pages(direction, dev, host, stream.cuda_stream)
            event = torch.cuda.Event()
            event.record(stream)
        return Transfer(direction, n, n * self.page_bytes, event)

    def _copy_pages(self, direction: Direction, dev: list[int], host: list[int], stream: int) -> None:
        """Queue the copies of one validated, non-empty transfer on `stream` (a raw CUDA stream handle,
        0 on CPU), which is also torch's current stream here."""
        runs = plan_runs(dev, host)  # Run.src = device page, Run.dst = host page
        if self.method == "batched":
            try:
                self._batched(direction, runs, stream)
                return
            except memcpy_batch.BatchCopyUnavailable as e:
                # Copies of a failed batch that did get queued write the same bytes again below.
                self._fall_back(str(e))
        self._copy_runs(direction, runs)

    def _copy_runs(self, direction: Direction, runs: list[Run]) -> None:
        dev, host = self.pool.data, self.host.data
        for r in runs:
            d, h = dev[r.src:r.src + r.n], host[r.dst:r.dst + r.n]
            if direction == "out":
                h.copy_(d, non_blocking=True)
            else:
                d.copy_(h, non_blocking=True)

    def _batched(self, direction: Direction, runs: list[Run], stream: int) -> None:
        assert self._batch is not None
        pb, dev0, host0 = self.page_bytes, self.pool.data.data_ptr(), self.host.data.data_ptr()
        devs = [dev0 + r.src * pb for r in runs]
        hosts = [host0 + r.dst * pb for r in runs]
        sizes = [r.n * pb for r in runs]
        if direction == "out":
            self._batch(hosts, devs, sizes, stream)
        else:
            self._batch(devs, hosts, sizes, stream)
