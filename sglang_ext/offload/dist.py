"""The torch.distributed transport: a sender (`DistRemote`) and an executor's host (`ExecutorService`
in host.py) over a private two-rank process group per pairing -- never the global default group,
since a worker may host several guests while it sends to an executor of its own.

    host (rank 0)                                           sender (rank 1)
    TCPStore(master, a free port) ── HOST:PORT via the router ──> TCPStore(client)
    ProcessGroupGloo | NCCL(store, 0, 2)  <──── connect ────  ProcessGroupGloo | NCCL(store, 1, 2)

Gloo carries CPU tensors (the CI's real multi-process path); NCCL carries the payloads when both
ends are GPUs, and then the headers go over a gloo group of their own (`Link.ctrl`: see there why).
Messages are an int64 header [kind, a, b, c, d, 0, 0, 0] on TAG_CTRL, then payload tensors:

    load     [LOAD, handle, length, n, reserve] + KV pages [n, L, 2, P, Hkv, D]  -> [REPLY, 1 ok | 0 full]
             (reserve: tokens to hold pages for, the request's longest; 0: just its KV)
    release  [RELEASE, handle]
    begin    [BEGIN, n] + int64 [2, n] (handles; positions)                      -> [REPLY, f] + int64 [f] dropped
      then per layer, if rows remain:  q|k|v [R, (Hq + 2 Hkv) D] on TAG_QKV   ->   o [R, Hq D] on TAG_OUT
    close    [CLOSE]

`post` only starts the layer's send and receive, so the sender's local attention runs meanwhile;
`collect` waits. Every wait has a timeout: a peer that dies closes its sockets (an error at once), a
hung one times out; the sender then raises ExecutorLost, and the host releases the guest's KV.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Any, Final

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from sglang_ext.offload.executor import GuestSpec
from sglang_ext.offload.remote import ExecutorLost, RemoteAttention

logger = logging.getLogger(__name__)

HOST_RANK: Final = 0
SENDER_RANK: Final = 1
TAG_CTRL, TAG_QKV, TAG_OUT = 0, 1, 2
LOAD, RELEASE, BEGIN, CLOSE, REPLY = 1, 2, 3, 4, 5
_HEADER: Final = 8  # int64 [kind, a, b, c, d, ...]: unused fields are 0
CONNECT_TIMEOUT_S: Final = 30.0  # the sender applies its directive between two of its steps
# A sender with nothing offloaded sends nothing for as long as it likes. (A gloo wait that times out
# breaks the pair, so the host cannot poll; a dead sender closes its sockets and ends the wait.)
IDLE_TIMEOUT_S: Final = 86400.0


class LinkError(RuntimeError):
    """The pair is broken: the peer closed it, died, or did not answer in time."""


def local_address_toward(host: str) -> str:
    """This machine's address on the route to `host` (no packet is sent)."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def pair_backend(own: torch.device, peer: torch.device) -> tuple[str, torch.device]:
    """NCCL when both ends are GPUs (tensors stay on this GPU), else gloo over CPU tensors."""
    if own.type == "cuda" and peer.type == "cuda":
        return "nccl", own
    return "gloo", torch.device("cpu")


def _short(e: BaseException) -> str:
    """gloo's message without its source path and advice: 'Connection closed by peer [1.2.3.4]:5'."""
    msg = str(e).strip()
    if msg.startswith("[") and "] " in msg:
        msg = msg.split("] ", 1)[1]
    return msg.split(". ", 1)[0]


class Link:
    """One end of a pair: the process group and blocking sends and receives with timeouts."""

    def __init__(self, store: TCPStore, rank: int, backend: str, device: torch.device, local_host: str,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        self.backend = backend
        self.device = device
        self.store = store  # kept: the groups rendezvoused through it

        def gloo(on: Any) -> Any:
            opts = ProcessGroupGloo._Options()
            opts._timeout = timedelta(seconds=connect_timeout_s)
            opts._devices = [ProcessGroupGloo.create_device(hostname=local_host)]
            opts._threads = 1
            return ProcessGroupGloo(on, rank, 2, opts)

        self.ctrl: Any = None  # headers (CPU tensors, gloo): the group itself, or one of its own beside NCCL
        try:
            if backend == "gloo":
                self.pg: Any = gloo(store)
                self.ctrl = self.pg
            else:
                from torch.distributed import ProcessGroupNCCL

                # Headers never go over NCCL: a receive posted while the peer is idle would keep a
                # kernel spinning on this GPU until its next message, and anything in this process
                # that waits for the GPU to go idle (a kernel's first launch, a cudaFree) would hang
                # until then; a dead peer would not be noticed either. Gloo sees a closed socket at once.
                self.ctrl = gloo(PrefixStore("ctrl/", store))
                nopts = ProcessGroupNCCL.Options()
                # Our own waits time out first; NCCL's watchdog would take the whole process down.
                nopts._timeout = timedelta(hours=1)
                self.pg = ProcessGroupNCCL(PrefixStore("data/", store), rank, 2, nopts)
        except RuntimeError as e:
            raise LinkError(f"cannot connect the pair: {_short(e)}") from None
        self.peer = 1 - rank

    def isend(self, t: torch.Tensor, tag: int) -> Any:
        try:
            return self._open().send([t], self.peer, tag)
        except RuntimeError as e:
            raise LinkError(_short(e)) from None

    def irecv(self, t: torch.Tensor, tag: int) -> Any:
        try:
            return self._open().recv([t], self.peer, tag)
        except RuntimeError as e:
            raise LinkError(_short(e)) from None

    def _open_ctrl(self) -> Any:
        if self.ctrl is None:
            raise LinkError("the pair is closed")
        return self.ctrl

    def _open(self) -> Any:
        if self.pg is None:
            raise LinkError("the pair is closed")
        return self.pg

    def wait(self, work: Any, timeout_s: float, gloo: bool = False) -> None:
        try:
            if self.backend == "gloo" or gloo:
                work.wait(timedelta(seconds=timeout_s))
                return
            deadline = time.monotonic() + timeout_s  # NCCL: poll, so a dead peer cannot block us
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise LinkError(f"timed out after {timeout_s:g} s")
                time.sleep(10e-6)
            work.wait()
        except RuntimeError as e:
            if isinstance(e, LinkError):
                raise
            raise LinkError(_short(e)) from None

    def send(self, t: torch.Tensor, tag: int, timeout_s: float) -> None:
        self.wait(self.isend(t, tag), timeout_s)

    def recv(self, t: torch.Tensor, tag: int, timeout_s: float) -> None:
        self.wait(self.irecv(t, tag), timeout_s)

    def _post_ctrl(self, op: str, t: torch.Tensor) -> Any:
        """Post a send or receive of a small CPU tensor on the control channel (TAG_CTRL): gloo, whatever
        carries data. Returns the work to wait on."""
        try:
            return getattr(self._open_ctrl(), op)([t], self.peer, TAG_CTRL)
        except RuntimeError as e:
            raise LinkError(_short(e)) from None

    def send_header(self, vals: list[int], timeout_s: float) -> None:
        h = torch.zeros(_HEADER, dtype=torch.int64)
        h[: len(vals)] = torch.tensor(vals, dtype=torch.int64)
        self.wait(self._post_ctrl("send", h), timeout_s, gloo=True)

    def recv_header(self, timeout_s: float) -> list[int]:
        return self.header_of(self.post_header_recv(), timeout_s)

    def post_header_recv(self) -> tuple[Any, torch.Tensor]:
        """Post the receive of the next header now and wait for it later (`header_of`): a gloo send
        completes only once its peer has posted the matching receive, so a peer that answers before
        we are ready to read must find the receive already posted, or it waits on us."""
        h = torch.empty(_HEADER, dtype=torch.int64)
        return self._post_ctrl("recv", h), h

    def header_of(self, posted: tuple[Any, torch.Tensor], timeout_s: float) -> list[int]:
        work, h = posted
        self.wait(work, timeout_s, gloo=True)
        return [int(x) for x in h.tolist()]

    def close(self) -> None:
        """Drop the group: its sockets close, so a peer waiting on it fails at once."""
        if self.backend == "nccl" and self.pg is not None:
            with suppress(RuntimeError):
                self.pg.abort()
        self.pg = self.ctrl = None


def connect_store(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> TCPStore:
    host, _, port = address.rpartition(":")
    return TCPStore(host.strip("[]"), int(port), 2, False, timeout=timedelta(seconds=timeout_s))


def open_store(host: str) -> tuple[TCPStore, socket.socket]:
    """The pair's rendezvous on a free port of `host` only (TCPStore alone would listen on every
    interface). The store takes ownership of the descriptor it is given and closes it when it is
    destroyed, so it gets a duplicate: each descriptor then has one owner. (Handing it the
    listener's own made two owners close one number; the second close could hit whatever socket
    had reused it meanwhile, an EBADF in an unrelated place.)"""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        listener.bind((host.strip("[]"), 0))
        listener.listen(16)
        port = listener.getsockname()[1]
    except OSError:
        listener.close()
        raise
    owned_by_store = os.dup(listener.fileno())
    try:
        store = TCPStore(host, port, 2, True, timeout=timedelta(seconds=CONNECT_TIMEOUT_S), wait_for_workers=False,
                         master_listen_fd=owned_by_store)
    except (OSError, RuntimeError):
        listener.close()  # the duplicate is the store's: never closed here, in case it already did
        raise
    return store, listener


class DistRemote(RemoteAttention):
    """The sender's end: RemoteAttention over a Link to an executor in another process."""

    # `collect` waits on the host, so when a forward returns every exchange of its step is done and
    # the host's thread is back at its next header: BEGIN of t+1 and RELEASE follow step t there, in
    # the order sent.
    overlap_safe = True

    def __init__(self, link: Link, spec: GuestSpec, executor_id: str, timeout_s: float) -> None:
        super().__init__()
        self.link = link
        self.spec = spec
        self.executor_id = executor_id
        self.timeout_s = timeout_s
        self._posted: tuple[Any, Any, torch.Tensor, torch.Tensor, torch.Size, torch.device] | None = None

    @classmethod
    def connect(cls, store_address: str, backend: str, device: torch.device, spec: GuestSpec, executor_id: str,
                timeout_s: float) -> DistRemote:
        """Join the pair the executor's host opened (rank 1); the host waits already, so this takes
        `timeout_s` at most (it runs on the sender's forward thread). Raises ExecutorLost."""
        wire = device if backend == "nccl" else torch.device("cpu")
        try:
            store = connect_store(store_address, timeout_s)
            link = Link(store, SENDER_RANK, backend, wire, local_address_toward(store_address.rpartition(":")[0]),
                        timeout_s)
        except (RuntimeError, ValueError) as e:
            raise ExecutorLost(f"executor {executor_id} at {store_address}: {_short(e)}") from None
        return cls(link, spec, executor_id, timeout_s)

    @contextmanager
    def _exchange(self, what: str) -> Iterator[None]:
        self._check()
        t0 = time.perf_counter()
        try:
            yield
        except LinkError as e:
            self._lost(what, e)
        finally:
            self.wait_s += time.perf_counter() - t0

    def _lost(self, what: str, e: Exception) -> None:
        self.alive = False
        self._posted = None
        self.link.close()
        raise ExecutorLost(f"executor {self.executor_id}: {what}: {e}") from None

    def _check(self) -> None:
        if not self.alive:
            raise ExecutorLost(f"executor {self.executor_id} is gone")

    # load and release never raise: the scheduler calls them outside a forward, where a gone
    # executor must only mean "stays local"; the next step's begin_step reports the loss.
    def load(self, handle: int, kv: torch.Tensor, length: int, reserve_tokens: int = 0) -> bool:
        if not self.alive:
            return False
        t0 = time.perf_counter()
        try:
            self.link.send_header([LOAD, handle, length, kv.shape[0], reserve_tokens], self.timeout_s)
            self.link.send(kv.to(self.link.device).contiguous(), TAG_CTRL, self.timeout_s)
            ok = self.link.recv_header(self.timeout_s)[1]
        except LinkError as e:
            self._broken("load", e)
            return False
        finally:
            self.wait_s += time.perf_counter() - t0
        if ok:
            self.bytes_out += kv.numel() * kv.element_size()
        return bool(ok)

    def release(self, handle: int) -> None:
        if not self.alive:
            return
        try:
            self.link.send_header([RELEASE, handle], self.timeout_s)
        except LinkError as e:
            self._broken("release", e)

    def _broken(self, what: str, e: Exception) -> None:
        logger.warning("executor %s: %s failed (%s); no more requests go there", self.executor_id, what, e)
        self.alive = False
        self._posted = None
        self.link.close()

    def begin_step(self, handles: list[int], positions: list[int]) -> list[int]:
        with self._exchange("begin_step"):
            hp = torch.tensor([handles, positions], dtype=torch.int64).to(self.link.device)
            self.link.send_header([BEGIN, len(handles)], self.timeout_s)
            self.link.send(hp, TAG_CTRL, self.timeout_s)
            n_failed = self.link.recv_header(self.timeout_s)[1]
            failed: list[int] = []
            if n_failed:
                buf = torch.empty(n_failed, dtype=torch.int64, device=self.link.device)
                self.link.recv(buf, TAG_CTRL, self.timeout_s)
                failed = [int(x) for x in buf.tolist()]
        return failed

    def post(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self._check()
        if q.dtype != self.spec.geometry.dtype:
            raise ValueError(f"q is {q.dtype}, the executor holds {self.spec.geometry.dtype} KV")
        r = q.shape[0]
        packed = torch.cat([q.reshape(r, -1), k.reshape(r, -1), v.reshape(r, -1)], 1).to(self.link.device)
        out = torch.empty(r, q.shape[1] * q.shape[2], dtype=q.dtype, device=self.link.device)
        try:
            sent = self.link.isend(packed.contiguous(), TAG_QKV)
            got = self.link.irecv(out, TAG_OUT)
        except LinkError as e:
            self._lost(f"layer {layer}", e)
        self._posted = (sent, got, packed, out, q.shape, q.device)
        self.bytes_out += packed.numel() * packed.element_size()

    def collect(self, layer: int) -> torch.Tensor:
        assert self._posted is not None, "collect before post"
        sent, got, _, out, shape, device = self._posted
        with self._exchange(f"layer {layer}"):
            self.link.wait(got, self.timeout_s)
            self.link.wait(sent, self.timeout_s)
        self._posted = None
        self.bytes_in += out.numel() * out.element_size()
        return out.view(shape).to(device)

    def close(self) -> None:
        """Tell the executor this guest is done (it releases the guest's KV), then drop the pair."""
        if self.alive:
            with suppress(LinkError):
                self.link.send_header([CLOSE], min(self.timeout_s, 1.0))
        self.alive = False
        self.link.close()


class PipelinedBegin(DistRemote):
    """A DistRemote whose `begin_step` does not wait for the host's answer: it is read later (before
    the next control message, or when the step lands), by which time it has long arrived -- the host
    answers as soon as it has planned. For transports whose per-layer exchange does not go through
    the link (cuda_ipc), this takes a control round trip and the host's planning off every step.

    The answer only ever matters if the host dropped rows (no room to grow them). Loads set pages
    aside for a request's longest (`reserve_tokens`), so that does not happen; if it does (a host
    that could not), the step already runs with rows the host left out, so its remote results are
    wrong: the pairing ends and `results_forged` says so, and the scheduler recomputes those requests."""

    _pending = 0  # the number (`begins`) of the BEGIN whose answer is unread; 0: none
    _answer: tuple[Any, torch.Tensor] | None = None  # its receive, posted with the BEGIN
    _late_drop = False  # the host dropped rows of a step that had already been launched

    def begin_step(self, handles: list[int], positions: list[int]) -> list[int]:
        self._settle()
        with self._exchange("begin_step"):
            hp = torch.tensor([handles, positions], dtype=torch.int64).to(self.link.device)
            self.link.send_header([BEGIN, len(handles)], self.timeout_s)
            self.link.send(hp, TAG_CTRL, self.timeout_s)
            # Posted now: the host answers at once, and its send would otherwise wait for us to read
            # (which may be seconds away when no remote step follows) and time out.
            self._answer = self.link.post_header_recv()
        self.begins += 1
        self._pending = self.begins
        return []

    def _settle(self) -> None:
        """Read the last BEGIN's answer; ExecutorLost if it dropped rows or the link broke."""
        if not self._pending:
            return
        self._pending = 0
        answer, self._answer = self._answer, None
        assert answer is not None
        with self._exchange("begin_step"):
            n_failed = self.link.header_of(answer, self.timeout_s)[1]
            if n_failed:
                buf = torch.empty(n_failed, dtype=torch.int64, device=self.link.device)
                self.link.recv(buf, TAG_CTRL, self.timeout_s)
                self._late_drop = True
                raise LinkError(f"it dropped {n_failed} row(s) of a step already launched")

    def _settled(self) -> bool:
        """`_settle` for calls that must not raise: False when the executor is gone."""
        try:
            self._settle()
        except ExecutorLost:
            return False
        return True

    def results_forged(self, upto: int | None = None) -> bool:
        # The answer of a step planned later than the one asked about is left for later: under
        # overlap, step t lands after t+1 was planned, and t+1's answer may not be in yet.
        if self._pending and self.alive and (upto is None or self._pending <= upto):
            self._settled()
        return self._late_drop or super().results_forged(upto)

    def load(self, handle: int, kv: torch.Tensor, length: int, reserve_tokens: int = 0) -> bool:
        return self._settled() and super().load(handle, kv, length, reserve_tokens)

    def close(self) -> None:
        if self.alive:
            self._settled()
        super().close()
