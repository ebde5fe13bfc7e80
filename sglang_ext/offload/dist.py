"""The torch_dist transport's sender: `DistRemote`, RemoteAttention over a `Link` to an executor in
another process (the host's end is host.py's ExecutorService), in the messages of transport/protocol.py.

`post` only starts the layer's send and receive, so the sender's local attention runs meanwhile;
`collect` waits. A broken link raises ExecutorLost, and the host releases the guest's KV.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import torch

from sglang_ext.offload.executor import GuestSpec
from sglang_ext.offload.remote import ExecutorLost, RemoteAttention
from sglang_ext.transport.link import SENDER_RANK, Link, connect_store, local_address_toward, short_error
from sglang_ext.transport.protocol import Begin, Close, LinkError, Load, Release, Reply, Tag, expect

logger = logging.getLogger(__name__)


class DistRemote(RemoteAttention):
    """The sender's end: RemoteAttention over a Link to an executor in another process."""

    # Overlap: `collect` waits on the host, so when a forward returns every exchange of its step is
    # done and the host's thread is back at its next header: Begin of t+1 and Release follow step t
    # there, in the order sent.

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
            raise ExecutorLost(f"executor {executor_id} at {store_address}: {short_error(e)}") from None
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
            self.link.send_header(Load(handle, length, kv.shape[0], reserve_tokens), self.timeout_s)
            self.link.send(kv.to(self.link.device).contiguous(), Tag.CTRL, self.timeout_s)
            ok = expect(self.link.recv_header(self.timeout_s), Reply).value
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
            self.link.send_header(Release(handle), self.timeout_s)
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
            self.link.send_header(Begin(len(handles)), self.timeout_s)
            self.link.send(hp, Tag.CTRL, self.timeout_s)
            n_failed = expect(self.link.recv_header(self.timeout_s), Reply).value
            failed: list[int] = []
            if n_failed:
                buf = torch.empty(n_failed, dtype=torch.int64, device=self.link.device)
                self.link.recv(buf, Tag.CTRL, self.timeout_s)
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
            sent = self.link.isend(packed.contiguous(), Tag.QKV)
            got = self.link.irecv(out, Tag.OUT)
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
                self.link.send_header(Close(), min(self.timeout_s, 1.0))
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
            self.link.send_header(Begin(len(handles)), self.timeout_s)
            self.link.send(hp, Tag.CTRL, self.timeout_s)
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
            n_failed = expect(self.link.header_of(answer, self.timeout_s), Reply).value
            if n_failed:
                buf = torch.empty(n_failed, dtype=torch.int64, device=self.link.device)
                self.link.recv(buf, Tag.CTRL, self.timeout_s)
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
