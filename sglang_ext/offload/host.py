"""A worker's executor for other models' senders (`executor_mem_gb`): one ExecutorService thread per
pairing the router opens (the host's end of transport/protocol.py's remote-attention messages; with
cuda_ipc, ipc_host.py has its GPU part), all over one AttentionExecutor and its foreign-KV partition.

A guest is keyed by sender and pairing (`hot-0/p-1a2b-3`), so a sender paired again (it restarted,
or lost its executor for a while) never meets the pages of its previous pairing: those are released
when that pairing's thread ends.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING, Final

import torch
from torch.distributed import TCPStore

from sglang_ext.kvcache.pool import KVGeometry
from sglang_ext.messages import ExecutorOpen
from sglang_ext.offload.executor import AttentionExecutor, ExecutorFull, GuestSpec
from sglang_ext.transport.choice import SERVED_DEFAULT
from sglang_ext.transport.link import HOST_RANK, IDLE_TIMEOUT_S, Link, open_store, pair_backend, say_goodbye
from sglang_ext.transport.protocol import (
    Begin,
    Close,
    LinkError,
    Load,
    LoadMore,
    LoadStaged,
    ProtocolError,
    Release,
    Reply,
    Tag,
)
from sglang_ext.transport.stage import copied, staged_kv

if TYPE_CHECKING:
    from sglang_ext.offload.ipc_host import IpcHostEnd

logger = logging.getLogger(__name__)

_DTYPES: Final = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def guest_spec_of(msg: ExecutorOpen) -> GuestSpec:
    if msg.dtype not in _DTYPES:
        raise ValueError(f"unsupported KV dtype {msg.dtype!r} (one of {', '.join(_DTYPES)})")
    if min(msg.num_layers, msg.num_kv_heads, msg.head_dim, msg.page_size, msg.num_q_heads) < 1:
        raise ValueError("the guest's attention shape has a zero or negative size")
    geo = KVGeometry(msg.num_layers, msg.num_kv_heads, msg.head_dim, msg.page_size, _DTYPES[msg.dtype])
    return GuestSpec(geo, msg.num_q_heads, msg.head_dim, msg.scale)


class ExecutorHost:
    def __init__(self, executor: AttentionExecutor, address: str = "127.0.0.1", staged_loads: bool = True) -> None:
        self.executor = executor
        self.address = address  # where senders reach this worker (the interface toward the router)
        self.staged_loads = staged_loads  # cuda_ipc: offer senders a KV stage (--disable-ipc-staged-loads)
        self.lock = threading.Lock()
        self.services: dict[str, ExecutorService] = {}
        self.guest_models: dict[str, str] = {}  # guest key -> the guest's model name
        self._side: torch.cuda.Stream | None = None  # adopted requests' copies (see _adopt_stream)

    def open(self, msg: ExecutorOpen) -> dict[str, str]:
        """Start serving a new pairing; returns the rendezvous address and backend for the sender.
        ValueError when this executor cannot host the guest."""
        transport = self._transport(msg)
        spec = guest_spec_of(msg)
        key = f"{msg.guest}/{msg.pairing}"
        if key in self.services:
            raise ValueError(f"pairing {msg.pairing} of {msg.guest} is open already")
        with self.lock:
            self.executor.attach(key, spec)  # ValueError: a page larger than a slab
        # cuda_ipc: control messages over gloo (CPU tensors); the data moves over IPC mappings
        backend, wire = (pair_backend(self.executor.device, torch.device(msg.guest_device))
                         if transport == SERVED_DEFAULT else ("gloo", torch.device("cpu")))
        try:
            store, listener = open_store(self.address)
        except (OSError, RuntimeError) as e:
            with self.lock:
                self.executor.detach(key)
            raise ValueError(f"cannot open a rendezvous on {self.address}: {e}") from None
        svc = ExecutorService(self.executor, self.lock, key, spec, store, backend, wire, self.address,
                              msg.timeout_s, on_exit=self._ended, listener=listener, transport=transport,
                              staged_loads=self.staged_loads)
        self.services[key] = svc
        self.guest_models[key] = msg.guest_model
        svc.start()
        return {"store": f"{self.address}:{store.port}", "backend": backend, "transport": transport}

    def adopt(self, pairing: str, handle: int, kv: torch.Tensor, length: int, reserve_tokens: int = 0) -> bool:
        """Adrenaline placement, on this (prefill) worker's forward thread: take a request's prompt KV
        from this worker's own pool (`kv`, on this device: a device-local copy) into the executor under
        the live pairing `pairing`, as its guest's request `handle`. False when that pairing is not
        served here (any more) or its executor is full: the KV then goes to the decode worker as usual."""
        svc = next((v for k, v in list(self.services.items()) if k.rpartition("/")[2] == pairing), None)
        if svc is None or svc.ended.is_set():
            return False
        with self.lock:
            if svc.guest not in self.executor.guests:
                return False
            program = svc.ipc.program if svc.ipc is not None else None
            side = self._adopt_stream(kv) if program is not None else None
            try:
                with torch.cuda.stream(side) if side is not None else nullcontext():
                    if program is not None:
                        program.before_load()
                    self.executor.load(svc.guest, handle, kv, length, reserve_tokens=reserve_tokens)
                    if program is not None and side is not None:
                        program.after_load(side)  # its next program reads these pages after the copy
            except (ExecutorFull, ValueError):
                return False
        return True

    def _adopt_stream(self, kv: torch.Tensor) -> torch.cuda.Stream | None:
        """The stream an adopted request's copy into the executor runs on (cuda): not the forward
        thread's. The copy must wait for the guest's last queued gated program (`before_load`), which
        waits on the GPU for the decode worker's doorbells; on the forward stream, every later
        prefill -- and the KV sends of plain hand-offs behind them, which the decode worker's step
        may wait for -- would queue behind that program too: a cycle across the two GPUs that only
        a timeout breaks (most likely what lost the pairing 6 s into an Adrenaline run at 40 req/s
        on two H200s; the rerun with this side stream kept it). The
        side stream first waits for the forward stream (the gather that made `kv`), and `kv` is
        kept alive until the copy has read it."""
        if kv.device.type != "cuda":
            return None
        if self._side is None:
            self._side = torch.cuda.Stream(kv.device)
        self._side.wait_stream(torch.cuda.current_stream(kv.device))
        kv.record_stream(self._side)
        return self._side

    def release_placed(self, pairing: str, handle: int) -> None:
        """Give back KV that `adopt` took for a request whose decode worker will never use it."""
        svc = next((v for k, v in list(self.services.items()) if k.rpartition("/")[2] == pairing), None)
        if svc is not None:
            with self.lock:
                self.executor.release(svc.guest, handle)

    def _transport(self, msg: ExecutorOpen) -> str:
        """What this host serves for `msg`: cuda_ipc only where it can work here (else its fallback,
        or a ValueError that the router reports as the pairing's failure)."""
        if msg.transport == SERVED_DEFAULT:
            return SERVED_DEFAULT
        if msg.transport != "cuda_ipc":
            raise ValueError(f"this executor serves torch_dist or cuda_ipc, not {msg.transport}")
        from sglang_ext.transport.ipc import ipc_problem

        problem = ipc_problem(self.executor.device, msg.guest_device, msg.guest_gpu)
        if problem is None:
            return "cuda_ipc"
        if msg.fallback == SERVED_DEFAULT:
            logger.info("pairing %s: cuda_ipc cannot work here (%s); serving torch_dist", msg.pairing, problem)
            return SERVED_DEFAULT
        raise ValueError(f"offload_transport cuda_ipc: {problem}")

    def _ended(self, svc: ExecutorService) -> None:  # on the service's thread
        self.services.pop(svc.guest, None)
        self.guest_models.pop(svc.guest, None)

    @property
    def capacity_bytes(self) -> int:
        return self.executor.partition.total_bytes

    def used_tokens(self) -> dict[str, int]:
        """KV tokens held per guest model (a report; read without the lock, so it may be a step old)."""
        out: dict[str, int] = {}
        for key, model in list(self.guest_models.items()):
            g, pg = self.executor.guests.get(key), self.executor.partition.guests.get(key)
            if g is not None and pg is not None:
                out[model] = out.get(model, 0) + pg.used * g.spec.geometry.page_size
        return out

    def pairing_tokens(self) -> tuple[dict[str, int], dict[str, int]]:
        """KV tokens each pairing holds and could still get (its free pages plus whole free slabs,
        which every guest shares), by pairing id; a report read without the lock, like `used_tokens`."""
        used: dict[str, int] = {}
        free: dict[str, int] = {}
        part = self.executor.partition
        for key in list(self.guest_models):
            g, pg = self.executor.guests.get(key), part.guests.get(key)
            if g is not None and pg is not None:
                pairing, ps = key.rpartition("/")[2], g.spec.geometry.page_size
                used[pairing], free[pairing] = pg.used * ps, part.free_pages(key) * ps
        return used, free


class ExecutorService:
    """The host's end of one pairing: a thread answering the sender against the worker's executor.

    It does not stop the host's own forward: torch ops and waits release the GIL, and the
    partition (shared by every guest) is changed under `lock`. When the sender goes away (closes,
    dies, or stops answering mid-step) the guest's KV is released and the thread ends.
    """

    def __init__(self, executor: AttentionExecutor, lock: threading.Lock, guest: str, spec: GuestSpec,
                 store: TCPStore, backend: str, wire: torch.device, local_host: str, timeout_s: float,
                 on_exit: Callable[[ExecutorService], None] | None = None,
                 idle_timeout_s: float = IDLE_TIMEOUT_S, listener: socket.socket | None = None,
                 transport: str = SERVED_DEFAULT, staged_loads: bool = True) -> None:
        self.executor = executor
        self.lock = lock
        self.guest = guest
        self.spec = spec
        self.store = store
        self.listener = listener  # the store's listening socket, closed with the pairing
        self.backend = backend
        self.wire = wire
        self.local_host = local_host
        self.timeout_s = timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.on_exit = on_exit
        self.transport = transport
        self.staged_loads = staged_loads
        self.ipc: IpcHostEnd | None = None  # cuda_ipc: the GPU exchange, after the handshake
        self._filling: list[int] | None = None  # a staged load in parts: [handle, pages, pages landed]
        self.link: Link | None = None
        self.ended = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"executor-{guest}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        why = "closed by the sender"
        try:
            if self.executor.device.type == "cuda":
                torch.cuda.set_device(self.executor.device)
            self.link = Link(self.store, HOST_RANK, self.backend, self.wire, self.local_host)
            if self.transport == "cuda_ipc":
                from sglang_ext.offload.ipc_host import IpcHostEnd

                self.ipc = IpcHostEnd.handshake(self.link, self.executor, self.lock, self.guest, self.spec,
                                                self.timeout_s, self.staged_loads)
                # Plans and loads on a stream of this thread's own: on the worker's default stream they
                # would queue behind its model's kernels, and a load's wait for the guest's last program
                # would hold those kernels back until the sender rang it.
                cuda = self.executor.device.type == "cuda"
                with torch.cuda.stream(torch.cuda.Stream(self.executor.device)) if cuda else nullcontext():
                    self._serve(self.link)
            else:
                self._serve(self.link)
        except LinkError as e:
            why = str(e)
        except Exception as e:  # a protocol or executor bug: end this pairing only, loudly
            logger.exception("executor for guest %s failed", self.guest)
            why = f"{type(e).__name__}: {e}"
        finally:
            # cuda_ipc: queued programs still write the guest's pages (and the sender's memory): drain
            # them first; pages a program may still write are never handed to another guest.
            drained = self.ipc.drain() if self.ipc is not None else True
            with self.lock:
                held = self.executor.used_tokens(self.guest) if self.guest in self.executor.guests else 0
                if drained:
                    self.executor.detach(self.guest)
                else:
                    logger.error("executor for guest %s: its queued GPU program did not drain; keeping its %d "
                                 "tokens of KV", self.guest, held)
            if self.ipc is not None and drained:
                self.ipc.close()
            if self.link is not None:
                self.link.close()
            if self.listener is not None:
                self.listener.close()
            logger.info("executor for guest %s ended (%s); released its KV (%d tokens)", self.guest, why, held)
            self.ended.set()
            if self.on_exit is not None:
                self.on_exit(self)

    def _serve(self, link: Link) -> None:
        while True:
            h = link.recv_header(self.idle_timeout_s)
            if self._filling is not None and not isinstance(h, LoadMore):
                raise ProtocolError(f"{h!r} before the staged load of request {self._filling[0]} ended")
            if isinstance(h, Load):
                self._load(link, h.handle, h.length, h.n_pages, h.reserve)
            elif isinstance(h, LoadStaged) and self.ipc is not None and self.ipc.stage is not None:
                self._load_staged(link, h.handle, h.length, h.n_pages, h.reserve)
            elif isinstance(h, LoadMore) and self._filling is not None:
                self._load_more(link, h.handle, h.first, h.count)
            elif isinstance(h, Release):
                with self.lock:
                    self.executor.release(self.guest, h.handle)
            elif isinstance(h, Begin):
                self._step(link, h.n_rows)
            elif isinstance(h, Close):
                if self.ipc is not None:  # the sender keeps its buffers until this goodbye
                    self.ipc.drain()
                    say_goodbye(link, self.timeout_s)
                return
            else:
                raise ProtocolError(f"unexpected {h!r} from a sender")

    def _kv_shape(self, n: int) -> tuple[int, ...]:
        g = self.spec.geometry
        return (n, g.num_layers, 2, g.page_size, g.num_kv_heads, g.head_dim)

    def _load(self, link: Link, handle: int, length: int, n: int, reserve: int = 0) -> None:
        kv = torch.empty(self._kv_shape(n), dtype=self.spec.geometry.dtype, device=self.wire)
        link.recv(kv, Tag.CTRL, self.timeout_s)
        link.send_header(Reply(self._take(handle, kv, length, reserve=reserve)), self.timeout_s)

    def _load_staged(self, link: Link, handle: int, length: int, n: int, reserve: int = 0) -> None:
        """cuda_ipc: the sender pushed the KV (its first pages, when it is larger than the stage) into
        our stage (transport/stage.py) before this message. The copy into the partition runs on this thread's
        stream; we wait for it before the reply, after which the sender may overwrite the stage. The
        program that reads the pages is queued on a later Begin, on a stream that first waits for
        this one."""
        kv = self._staged(min(n, self._stage_pages()))
        ok = self._take(handle, kv, length, n, reserve)
        if ok and len(kv) < n:  # the rest comes in chunks (LoadMore); the pages are all taken now
            self._filling = [handle, n, len(kv)]
        copied(self.executor.device, self.timeout_s)
        link.send_header(Reply(ok), self.timeout_s)

    def _load_more(self, link: Link, handle: int, first: int, count: int) -> None:
        """The next chunk of a staged load in parts: pages `first`.. of the request."""
        assert self._filling is not None
        want, n, landed = self._filling
        if (handle, first, count) != (want, landed, min(n - landed, self._stage_pages())):
            raise ProtocolError(f"staged load of request {want}: expected pages {landed}.. of {n}, got {handle} "
                            f"pages {first}..+{count}")
        kv = self._staged(count)
        with self.lock:  # pages taken on the first chunk, after the guest's last program (before_load)
            self.executor.write(self.guest, handle, first, kv)
        self._filling = None if first + count == n else [handle, n, first + count]
        copied(self.executor.device, self.timeout_s)
        link.send_header(Reply(1), self.timeout_s)

    def _stage_pages(self) -> int:
        assert self.ipc is not None and self.ipc.stage is not None
        return self.ipc.stage.numel() // self.spec.geometry.page_bytes

    def _staged(self, n: int) -> torch.Tensor:
        assert self.ipc is not None and self.ipc.stage is not None
        try:
            return staged_kv(self.ipc.stage, self._kv_shape(n), self.spec.geometry.dtype)
        except ValueError as e:
            raise LinkError(f"staged load: {e}") from None

    def _take(self, handle: int, kv: torch.Tensor, length: int, num_pages: int = 0, reserve: int = 0) -> int:
        """Load a request's KV (or its first `len(kv)` of `num_pages` pages) into the partition, with
        pages for `reserve` tokens in all: 1, or 0 when it is full."""
        with self.lock:
            if self.ipc is not None:
                self.ipc.program.before_load()
            try:
                self.executor.load(self.guest, handle, kv, length, num_pages, reserve)
            except ExecutorFull:
                return 0
        return 1

    def _answer(self, link: Link, failed: list[int]) -> None:
        link.send_header(Reply(len(failed)), self.timeout_s)
        if failed:
            link.send(torch.tensor(failed, dtype=torch.int64).to(self.wire), Tag.CTRL, self.timeout_s)

    def _step(self, link: Link, n: int) -> None:
        hp = torch.empty((2, n), dtype=torch.int64, device=self.wire)
        link.recv(hp, Tag.CTRL, self.timeout_s)
        handles, positions = ([int(x) for x in row] for row in hp.tolist())
        with self.lock:
            if self.ipc is not None:  # plan, answer, then queue the gated program (the layers never come here)
                failed = self.ipc.program.plan(handles, positions)
                # Answered before the program is queued: the sender launches its step and rings the
                # doorbells whatever this process does next. Queued first, the program would wait on
                # the GPU for a step that waits for our answer, and any CUDA call of ours that waits
                # for the GPU to go idle (a kernel's first launch on the model's thread may) would
                # never return -- the likeliest cause of an executor's host that hung on two H200s.
                self._answer(link, failed)
                self.ipc.program.queue()
                return
            failed = self.executor.plan(self.guest, handles, positions)
        self._answer(link, failed)
        rows = n - len(failed)
        if not rows or self.ipc is not None:
            return
        s = self.spec
        hq, hkv, d = s.num_q_heads, s.geometry.num_kv_heads, s.head_dim
        for layer in range(s.geometry.num_layers):
            qkv = torch.empty((rows, (hq + 2 * hkv) * d), dtype=s.geometry.dtype, device=self.wire)
            link.recv(qkv, Tag.QKV, self.timeout_s)
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
            o = self.executor.attend(self.guest, layer, q.reshape(rows, hq, d), k.reshape(rows, hkv, d),
                                     v.reshape(rows, hkv, d))
            link.send(o.reshape(rows, -1).to(self.wire, s.geometry.dtype).contiguous(), Tag.OUT, self.timeout_s)
