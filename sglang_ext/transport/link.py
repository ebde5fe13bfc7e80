"""A pair's link: a private two-rank torch.distributed group per pairing -- never the global default
group, since a worker may host several guests while it sends to an executor of its own -- with blocking
sends and receives that time out, and the control channel the headers of protocol.py travel on.

    host (rank 0)                                           sender (rank 1)
    TCPStore(master, a free port) ── HOST:PORT via the router ──> TCPStore(client)
    ProcessGroupGloo | NCCL(store, 0, 2)  <──── connect ────  ProcessGroupGloo | NCCL(store, 1, 2)

Gloo carries CPU tensors (the CI's real multi-process path); NCCL carries the payloads when both
ends are GPUs, and then the headers go over a gloo group of their own (`Link.ctrl`: see there why).
Every wait has a timeout: a peer that dies closes its sockets (an error at once), a hung one times out.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from contextlib import suppress
from datetime import timedelta
from typing import Any, Final

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from sglang_ext.transport.protocol import (
    MAX_BLOB,
    Bye,
    Header,
    LinkError,
    ProtocolError,
    Tag,
    empty,
    expect,
    fields,
    pack,
    unpack,
)

logger = logging.getLogger(__name__)

HOST_RANK: Final = 0
SENDER_RANK: Final = 1
CONNECT_TIMEOUT_S: Final = 30.0  # the sender applies its directive between two of its steps
# A sender with nothing offloaded sends nothing for as long as it likes. (A gloo wait that times out
# breaks the pair, so the host cannot poll; a dead sender closes its sockets and ends the wait.)
IDLE_TIMEOUT_S: Final = 86400.0


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


def short_error(e: BaseException) -> str:
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
            # torch exposes gloo's timeout, device and thread count only through its private options
            opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
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
            raise LinkError(f"cannot connect the pair: {short_error(e)}") from None
        self.peer = 1 - rank

    def isend(self, t: torch.Tensor, tag: int) -> Any:
        try:
            return self._open().send([t], self.peer, tag)
        except RuntimeError as e:
            raise LinkError(short_error(e)) from None

    def irecv(self, t: torch.Tensor, tag: int) -> Any:
        try:
            return self._open().recv([t], self.peer, tag)
        except RuntimeError as e:
            raise LinkError(short_error(e)) from None

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
            raise LinkError(short_error(e)) from None

    def send(self, t: torch.Tensor, tag: int, timeout_s: float) -> None:
        self.wait(self.isend(t, tag), timeout_s)

    def recv(self, t: torch.Tensor, tag: int, timeout_s: float) -> None:
        self.wait(self.irecv(t, tag), timeout_s)

    def _post_ctrl(self, op: str, t: torch.Tensor) -> Any:
        """Post a send or receive of a small CPU tensor on the control channel (Tag.CTRL): gloo, whatever
        carries data. Returns the work to wait on."""
        try:
            return getattr(self._open_ctrl(), op)([t], self.peer, Tag.CTRL)
        except RuntimeError as e:
            raise LinkError(short_error(e)) from None

    def send_header(self, h: Header, timeout_s: float) -> None:
        self.wait(self._post_ctrl("send", pack(h)), timeout_s, gloo=True)

    def recv_header(self, timeout_s: float) -> Header:
        return self.header_of(self.post_header_recv(), timeout_s)

    def post_header_recv(self) -> tuple[Any, torch.Tensor]:
        """Post the receive of the next header now and wait for it later (`header_of`): a gloo send
        completes only once its peer has posted the matching receive, so a peer that answers before
        we are ready to read must find the receive already posted, or it waits on us."""
        h = empty()
        return self._post_ctrl("recv", h), h

    def header_of(self, posted: tuple[Any, torch.Tensor], timeout_s: float) -> Header:
        work, h = posted
        self.wait(work, timeout_s, gloo=True)
        return unpack(h)

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


# ---- blobs and the goodbye (the cuda_ipc handshake and its end) -----------------------------------
def send_blob(link: Link, head: Header, data: bytes, timeout_s: float) -> None:
    """`head` (whose one field is the blob's length) and then the bytes, on the control channel."""
    link.send_header(head, timeout_s)
    link.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), Tag.CTRL, timeout_s)


def recv_blob(link: Link, kind: type[Header], timeout_s: float) -> bytes:
    """The bytes after a `kind` header; ProtocolError for another header or a size out of bounds."""
    h = link.recv_header(timeout_s)
    n = fields(h)[0] if isinstance(h, kind) and fields(h) else 0
    if not 0 < n <= MAX_BLOB:
        raise ProtocolError(f"expected {kind.__name__} of at most {MAX_BLOB} bytes, got {h!r}")
    buf = torch.empty(n, dtype=torch.uint8)
    link.recv(buf, Tag.CTRL, timeout_s)
    return buf.numpy().tobytes()


def wait_for_goodbye(link: Link) -> str | None:
    """Block on Tag.WATCH: None at the host's Bye, else why the pair broke. Holds the group (`pg`)
    itself, so it stays alive while this waits even after the sender's Link drops it."""
    pg = link.pg
    buf = empty()
    try:
        work = pg.recv([buf], link.peer, Tag.WATCH)
        work.wait(timedelta(seconds=IDLE_TIMEOUT_S))
        expect(unpack(buf), Bye)
    except ProtocolError as e:
        return f"unexpected watch message: {e}"
    except RuntimeError as e:
        return short_error(e)
    return None


def say_goodbye(link: Link, timeout_s: float) -> None:
    """The host's end of `wait_for_goodbye`."""
    link.send(pack(Bye()), Tag.WATCH, timeout_s)

