"""The attention executor: holds guests' KV in a foreign partition and computes their decode attention.

A guest is another model's sender. Per request (`handle`, chosen by the sender) the executor keeps
a page table in the guest's pool. Per decode step the sender names its offloaded rows and their
positions once (`plan`), then per layer sends q, k, v (`attend`): the executor writes k, v at the
new position and runs the engine's own attention backend over the guest's pages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from sglang_ext.attention import get_backend_class
from sglang_ext.attention.base import AttentionBackend
from sglang_ext.forward_batch import BatchRow, ForwardBatch, ForwardMode
from sglang_ext.kvcache.pool import KVGeometry
from sglang_ext.offload.partition import ForeignKVPartition


class ExecutorFull(RuntimeError):
    """The partition cannot hold what was asked (the request stays, or goes back, local)."""


@dataclass
class GuestSpec:
    """What an executor needs of a guest model: its KV geometry and attention shape."""

    geometry: KVGeometry
    num_q_heads: int
    head_dim: int
    scale: float


@dataclass
class _Seq:
    pages: list[int]
    length: int  # tokens whose KV is here


@dataclass
class _GuestState:
    spec: GuestSpec
    backend: AttentionBackend
    seqs: dict[int, _Seq] = field(default_factory=dict)
    batch: ForwardBatch | None = None  # the planned step


class AttentionExecutor:
    def __init__(self, partition: ForeignKVPartition, backend: str = "torch") -> None:
        self.partition = partition
        self.backend_name = backend
        self.guests: dict[str, _GuestState] = {}

    @property
    def device(self) -> torch.device:
        return self.partition.device

    @contextlib.contextmanager
    def _on_device(self) -> Iterator[None]:
        """Kernels, plans and events on the executor's GPU even when called from another device's
        thread (an in-process executor on cuda:1 driven by a cuda:0 sender)."""
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                yield
        else:
            yield

    def attach(self, guest: str, spec: GuestSpec) -> None:
        if guest in self.guests:
            if self.guests[guest].spec != spec:
                raise ValueError(f"guest {guest!r} is already attached with another shape")
            return
        pool = self.partition.attach(guest, spec.geometry)
        backend = get_backend_class(self.backend_name)(pool, spec.num_q_heads, spec.head_dim, spec.scale)
        self.guests[guest] = _GuestState(spec, backend)

    def used_tokens(self, guest: str) -> int:
        return self.partition.used_pages(guest) * self.guests[guest].spec.geometry.page_size

    # ---- requests -------------------------------------------------------------------------------
    def load(self, guest: str, handle: int, kv: torch.Tensor, length: int, num_pages: int = 0,
             reserve_tokens: int = 0) -> None:
        """Take a request's prefilled KV: `kv` is its pages in block-first layout
        [n, layers, 2, page_size, kv_heads, head_dim] covering `length` tokens. Raises ExecutorFull.
        `num_pages` > n: a load in parts, `kv` being its first n pages; `write` brings the rest (before
        the request is planned). `reserve_tokens`: take pages for that many tokens now (the request's
        longest), so that planning its steps never needs a page and never drops it."""
        g = self.guests[guest]
        if handle in g.seqs:
            raise ValueError(f"guest {guest!r} already has request {handle}")
        n = max(num_pages, kv.shape[0], -(-reserve_tokens // g.spec.geometry.page_size))
        pages = self.partition.alloc(guest, n)
        if pages is None:
            raise ExecutorFull(f"no room for {n} pages of guest {guest!r}")
        self._copy_in(g, pages[: kv.shape[0]], kv)
        g.seqs[handle] = _Seq(pages, length)

    def write(self, guest: str, handle: int, first: int, kv: torch.Tensor) -> None:
        """Pages `first`.. of a request loaded in parts (ValueError outside the pages it was given)."""
        g = self.guests[guest]
        seq = g.seqs[handle]
        if not 0 <= first < first + kv.shape[0] <= len(seq.pages):
            raise ValueError(f"pages {first}..{first + kv.shape[0]} of request {handle}, which has {len(seq.pages)}")
        self._copy_in(g, seq.pages[first : first + kv.shape[0]], kv)

    def _copy_in(self, g: _GuestState, pages: list[int], kv: torch.Tensor) -> None:
        with self._on_device():
            # Through pinned memory, asynchronously: a blocking upload would sync the current stream,
            # which may wait on the GPU for a guest's queued program (before_load) -- and so for the
            # guest's next step -- while this thread holds the executor's lock.
            idx = torch.tensor(pages, dtype=torch.long)
            if self.device.type == "cuda":
                idx = idx.pin_memory().to(self.device, non_blocking=True)
            g.backend.pool.data.index_copy_(0, idx, kv.to(self.device, non_blocking=True))

    def release(self, guest: str, handle: int) -> None:
        g = self.guests.get(guest)
        seq = g.seqs.pop(handle, None) if g is not None else None
        if seq is not None:
            self.partition.free(guest, seq.pages)

    def release_all(self, guest: str) -> None:
        for h in list(self.guests[guest].seqs):
            self.release(guest, h)

    def detach(self, guest: str) -> None:
        """Forget a guest whose pairing ended: its KV is released, its slabs go back to the arena."""
        if guest in self.guests:
            self.release_all(guest)
            del self.guests[guest]
            self.partition.detach(guest)

    # ---- one decode step ------------------------------------------------------------------------
    def plan(self, guest: str, handles: list[int], positions: list[int], prepare: bool = True) -> list[int]:
        """Lay out a decode step whose row i writes token `positions[i]` of request `handles[i]`.
        Returns the handles that could not grow (the partition is full): they are released here and
        left out of the step; the sender takes them back. `prepare=False` leaves the backend's plan to
        the caller (a CUDA-graph replay plans its own captured buffers)."""
        g = self.guests[guest]
        ps = g.spec.geometry.page_size
        failed: list[int] = []
        rows: list[BatchRow] = []
        for h, pos in zip(handles, positions, strict=True):
            seq = g.seqs[h]
            if pos != seq.length:
                raise ValueError(f"request {h}: step writes position {pos}, the executor holds {seq.length}")
            need = -(-(pos + 1) // ps) - len(seq.pages)
            if need > 0:
                more = self.partition.alloc(guest, need)
                if more is None:
                    failed.append(h)
                    continue
                seq.pages.extend(more)
            rows.append(BatchRow(pos, (0,), seq.pages))
        for h in failed:
            self.release(guest, h)
        g.batch = ForwardBatch.build(rows, ForwardMode.DECODE, ps, self.device) if rows else None
        if g.batch is not None and prepare:
            g.batch.attn_backend = g.backend
            with self._on_device():
                g.backend.prepare(g.batch)
        for h, pos in zip(handles, positions, strict=True):
            if h not in failed:
                g.seqs[h].length = pos + 1
        return failed

    def attend(self, guest: str, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Rows of the planned step: write k, v ([R, Hkv, D]), return attention of q ([R, Hq, D])."""
        g = self.guests[guest]
        assert g.batch is not None, "attend before plan"
        dev = self.device
        with self._on_device():
            return g.backend.forward(q.to(dev), k.to(dev), v.to(dev), layer, g.batch)

    def check(self) -> None:
        """Every held page belongs to one request of its guest (tests call this)."""
        self.partition.check()
        for name, g in self.guests.items():
            pages = [p for s in g.seqs.values() for p in s.pages]
            assert len(pages) == len(set(pages)), f"guest {name}: a page is held twice"
            assert len(pages) == self.partition.used_pages(name), f"guest {name}: pages leaked"
