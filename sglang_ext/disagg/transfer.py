"""Prefill -> decode KV transfer over a private two-rank torch.distributed pair (transport/link.py's
`Link`), in the messages of transport/protocol.py.

    decode worker (rank 0)                                   prefill worker (rank 1)
    open_store + KVReceiver thread ── HOST:PORT via the router ──> KVSender thread: connect
    KV(room, n_tokens, n_pages, first_token)                   <──  one per request, in order
    KV pages [n_pages, L, 2, P, Hkv, D] (the pool's block-first layout)
    Placed(room, n_tokens, handle, first_token)                <──  Adrenaline placement: no pages;
                                                                    the KV is in the prefill worker's
                                                                    executor under `handle`
    Close()                                                    <──  the prefill side closes the pair

Headers always go over gloo (CPU tensors; `Link`'s control channel). The KV pages go over gloo too
when an end is a CPU (the CI's multi-process path); between GPUs of one node as CUDA IPC peer copies
through a stage on the decode GPU (backend `cuda_ipc`, staged.py); between GPUs of different nodes
(or with --disable-pd-kv-ipc) over NCCL. Not the
headers over NCCL: an idle decode worker would keep a receive kernel spinning on its GPU until the next request,
and anything that waits for that GPU to go idle -- a kernel's first launch loading its module, a
cudaFree -- would hang the worker until then (its first request did, on two H200s). Both
ends run on threads of their own, so the prefill worker's next forward overlaps a send, and the
decode worker's forward a receive. A peer that dies closes its sockets: the other end's wait fails
at once, and every request still in transit on that pair fails explicitly (never hangs).
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import torch

from sglang_ext.disagg import staged
from sglang_ext.kvcache.pool import KVGeometry, KVPool
from sglang_ext.transport.link import HOST_RANK, IDLE_TIMEOUT_S, SENDER_RANK, Link, connect_store, local_address_toward
from sglang_ext.transport.protocol import KV, Close, KVStaged, LinkError, Placed, ProtocolError, Tag
from sglang_ext.transport.stage import KVStage

logger = logging.getLogger(__name__)



@dataclass
class KVArrival:
    """One request's prompt KV, landed on the decode side (on the wire device)."""

    pairing: str
    room: int
    n_tokens: int
    first_token: int
    kv: torch.Tensor  # [n_pages, L, 2, P, Hkv, D] (empty when placed)
    handle: int = 0  # Adrenaline placement: the KV stayed in the prefill worker's executor as this request


@dataclass
class SendJob:
    rid: str
    room: int
    pages: list[int]
    n_tokens: int
    first_token: int
    handle: int = 0  # Adrenaline placement: no pages go, only the header saying where the KV is


class KVSender:
    """The prefill end of one pair: a thread that connects, then sends the jobs it is given in order.
    `on_done(rid, error)` runs on that thread once a job's pages may be freed (error None: sent)."""

    def __init__(self, pairing: str, peer: str, store: str, backend: str, pool: KVPool, timeout_s: float,
                 on_done: Callable[[str, str | None], None]) -> None:
        self.pairing = pairing
        self.peer = peer
        self.store_address = store
        self.backend = backend
        self.pool = pool
        self.timeout_s = timeout_s
        self.on_done = on_done
        self.wire = pool.device if backend == "nccl" else torch.device("cpu")
        self.stage: KVStage | None = None  # cuda_ipc: the decode worker's stage, mapped here
        self._mapping: Any = None  # its IPC mapping (cuda_signal.IpcMapping), closed with the pair
        self.jobs: queue.SimpleQueue[SendJob | None] = queue.SimpleQueue()
        self.broken = ""  # why the pair is unusable ("" while it works)
        self.bytes_sent = 0
        self.thread = threading.Thread(target=self._run, name=f"kv-send-{peer}", daemon=True)
        self.thread.start()

    def submit(self, job: SendJob) -> None:
        self.jobs.put(job)

    def close(self) -> None:
        self.jobs.put(None)

    def _run(self) -> None:
        link: Link | None = None
        try:
            if self.pool.device.type == "cuda":
                torch.cuda.set_device(self.pool.device)
            store = connect_store(self.store_address, self.timeout_s)
            host = local_address_toward(self.store_address.rpartition(":")[0])
            ipc = self.backend == staged.BACKEND
            link = Link(store, SENDER_RANK, "gloo" if ipc else self.backend, self.wire, host, self.timeout_s)
            if ipc:
                self.stage, self._mapping = staged.map_stage(link, self.pool.device, self.timeout_s)
        except (RuntimeError, ValueError) as e:  # LinkError and CudaSignalError are RuntimeErrors
            self.broken = f"cannot connect to decode worker {self.peer}: {e}"
        while (job := self.jobs.get()) is not None:
            if link is None or self.broken:
                self.on_done(job.rid, self.broken or "the KV pair is closed")
                continue
            try:
                self._send(link, job)
            except LinkError as e:
                self.broken = f"the KV pair to decode worker {self.peer} broke: {e}"
                logger.warning("%s", self.broken)
                link.close()
                self.on_done(job.rid, self.broken)
                continue
            self.on_done(job.rid, None)
        if link is not None:
            if not self.broken:
                with suppress(LinkError):
                    link.send_header(Close(), min(self.timeout_s, 1.0))
            link.close()
        if self._mapping is not None:  # every copy into the stage was waited for
            with suppress(RuntimeError):
                self._mapping.close()

    def _send(self, link: Link, job: SendJob) -> None:
        if job.handle:
            link.send_header(Placed(job.room, job.n_tokens, job.handle, job.first_token), self.timeout_s)
            return
        # Gathered here, off the forward thread: the pages stay the request's until on_done.
        idx = torch.tensor(job.pages, dtype=torch.int64, device=self.pool.device)
        kv = self.pool.data.index_select(0, idx)
        if self.stage is not None:
            staged.send_staged(link, self.stage, kv, job.room, job.n_tokens, job.first_token, self.timeout_s)
        else:
            link.send_header(KV(job.room, job.n_tokens, len(job.pages), job.first_token), self.timeout_s)
            link.send(kv.to(self.wire), Tag.CTRL, self.timeout_s)
        self.bytes_sent += kv.numel() * kv.element_size()


class KVReceiver:
    """The decode end of one pair: a thread that receives requests' KV until the prefill side closes
    the pair or dies. `on_kv` gets each arrival; `on_end(pairing, why)` runs once, at the end."""

    def __init__(self, pairing: str, peer: str, geometry: KVGeometry, store: object, listener: socket.socket,
                 backend: str, wire: torch.device, local_host: str, timeout_s: float,
                 on_kv: Callable[[KVArrival], None], on_end: Callable[[str, str], None],
                 stage: tuple[torch.Tensor, bytes] | None = None) -> None:
        self.pairing = pairing
        self.peer = peer
        self.geometry = geometry
        self.store = store
        self.listener = listener
        self.backend = backend
        self.wire = wire
        self.local_host = local_host
        self.timeout_s = timeout_s
        self.on_kv = on_kv
        self.on_end = on_end
        self.stage = stage  # cuda_ipc: (the stage on this GPU, its exported handle)
        self.link: Link | None = None
        self.thread = threading.Thread(target=self._run, name=f"kv-recv-{peer}", daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Drop the pair from this end (the peer's next send fails at once)."""
        if self.link is not None:
            self.link.close()

    def _run(self) -> None:
        why = "closed by the prefill worker"
        clean = False
        try:
            own = self.stage[0].device if self.stage is not None else self.wire
            if own.type == "cuda":
                torch.cuda.set_device(own)
            backend = "gloo" if self.stage is not None else self.backend
            self.link = Link(self.store, HOST_RANK, backend, self.wire, self.local_host,  # type: ignore[arg-type]
                             self.timeout_s)
            if self.stage is not None:
                staged.offer_stage(self.link, self.stage[1], self.timeout_s)
            self._serve(self.link)
            clean = True
        except LinkError as e:
            why = f"prefill worker {self.peer} lost: {e}"
        except Exception as e:  # a protocol bug: end this pair only, loudly
            logger.exception("KV receiver from %s failed", self.peer)
            why = f"{type(e).__name__}: {e}"
        finally:
            if self.link is not None:
                self.link.close()
            self.listener.close()
            if self.stage is not None:
                staged.release_stage(self.stage[0], clean)
                self.stage = None
            self.on_end(self.pairing, why)

    def _serve(self, link: Link) -> None:
        g = self.geometry
        page = (g.num_layers, 2, g.page_size, g.num_kv_heads, g.head_dim)
        chunks = staged.StagedIn(self.stage[0], page, g.dtype, self.timeout_s) if self.stage is not None else None
        while True:
            h = link.recv_header(IDLE_TIMEOUT_S)
            if isinstance(h, Close):
                return
            if isinstance(h, KVStaged) and chunks is not None:
                kv = chunks.chunk(link, h.room, h.n_pages, h.first, h.count)
                if kv is not None:
                    self.on_kv(KVArrival(self.pairing, h.room, h.n_tokens, h.first_token, kv))
                continue
            if isinstance(h, Placed) and h.handle > 0:
                self.on_kv(KVArrival(self.pairing, h.room, h.n_tokens, h.first_token, torch.empty(0),
                                     handle=h.handle))
                continue
            if not isinstance(h, KV) or h.n_pages < 1 or h.n_pages > 1 << 24:
                raise ProtocolError(f"unexpected header {h!r}")
            kv = torch.empty((h.n_pages, g.num_layers, 2, g.page_size, g.num_kv_heads, g.head_dim), dtype=g.dtype,
                             device=self.wire)
            link.recv(kv, Tag.CTRL, self.timeout_s)
            self.on_kv(KVArrival(self.pairing, h.room, h.n_tokens, h.first_token, kv))
