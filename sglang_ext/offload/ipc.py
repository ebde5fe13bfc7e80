"""The `cuda_ipc` transport across worker processes of one node: `IpcRemote`, the sender's end (the
host's is ipc_host.py).

Control and data go separate ways. The control messages (transport/protocol.py) go over the pairing's
private gloo group (CPU tensors, even though both ends are GPUs). The per-layer data and signals never
touch a host: they are transport/gated.py's stream operations on memory the two processes share with
CUDA IPC.

    sender (GPU a)                                         host (GPU b), its ExecutorService thread
    GatedSender: send, recv, done[L]                       GatedProgram: exec_in, exec_out, doorbell[L]
    Hello(n) + IpcHello(recv, done handles) ───────────>  opens recv, done on b; makes its buffers
    opens exec_in, doorbell, stage <── Reply(n) + IpcWelcome(exec_in, doorbell, stage handles | error)
    load: push KV -> stage; LoadStaged(..) ────────────>  copy stage -> partition (transport/stage.py)
           <───────────────────────────── Reply(ok)
    begin: Begin(n) + rows ─────────────────────────────>  plan; queue the gated program (2 lanes)
           <───────────────────────────── Reply(f) + dropped handles
    per layer: push q|k|v -> exec_in, ring doorbell[l] ─>  (on b's stream: wait, attend, push o -> recv,
               wait done[l] <────────────────────────────   raise done[l])
    close: Close() ─────────────────────────────────────>  drains, releases the guest; Bye() on Tag.WATCH

KV loads go GPU to GPU through a staging buffer the host exports in its welcome (KV larger than it
goes in chunks); with a host that sent none they go over the control channel (CPU tensors), as
torch_dist does. A dead executor is the watchdog's business (transport/watchdog.py): its thread waits
on Tag.WATCH, which only the host's Bye or a broken connection ends; then it raises the sender's
completion flags until its stream has drained, and the next call raises ExecutorLost.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
import torch

from sglang_ext.offload.dist import DistRemote, PipelinedBegin
from sglang_ext.offload.executor import GuestSpec
from sglang_ext.offload.remote import ExecutorLost
from sglang_ext.transport.gated import ExchangeShape, GatedSenderSide
from sglang_ext.transport.ipc import check_welcome, device_idle
from sglang_ext.transport.link import (
    SENDER_RANK,
    Link,
    connect_store,
    local_address_toward,
    recv_blob,
    send_blob,
    short_error,
    wait_for_goodbye,
)
from sglang_ext.transport.protocol import (
    Hello,
    IpcHandle,
    IpcHello,
    IpcWelcome,
    LinkError,
    LoadMore,
    LoadStaged,
    Reply,
    expect,
)
from sglang_ext.transport.stage import KVStage, pushed_chunks
from sglang_ext.transport.watchdog import Watchdog

logger = logging.getLogger(__name__)
_kept: list[object] = []  # exchange buffers a peer may still write (never freed: rare, and safe)


def exchange_shape(spec: GuestSpec, max_rows: int) -> ExchangeShape:
    g = spec.geometry
    return ExchangeShape(g.num_layers, spec.num_q_heads, g.num_kv_heads, spec.head_dim, g.dtype, max_rows)


class StagedRemote(DistRemote):
    """DistRemote whose loads go through the host's stage when it has one, in chunks of its size."""

    stage: KVStage | None = None

    def load(self, handle: int, kv: torch.Tensor, length: int, reserve_tokens: int = 0) -> bool:
        st = self.stage
        per = st.pages(kv) if st is not None else 0
        if st is None or not per or not self.alive:
            return super().load(handle, kv, length, reserve_tokens)  # gloo, as torch_dist does
        kv = kv.contiguous()
        n = kv.shape[0]
        t0 = time.perf_counter()
        try:
            ok = 1
            for first, chunk in pushed_chunks(st, kv, self.timeout_s):
                head = (LoadStaged(handle, length, n, reserve_tokens) if first == 0
                        else LoadMore(handle, first, len(chunk)))
                self.link.send_header(head, self.timeout_s)
                ok = expect(self.link.recv_header(self.timeout_s), Reply).value
                if not ok:
                    if first:
                        raise LinkError(f"the executor refused pages {first}.. of a staged load")
                    break  # full: nothing was taken
        except LinkError as e:
            self._broken("load", e)
            return False
        finally:
            self.wait_s += time.perf_counter() - t0
        if ok:
            self.bytes_out += kv.numel() * kv.element_size()
            self.staged_loads += 1
        return bool(ok)


class IpcRemote(GatedSenderSide, PipelinedBegin, StagedRemote):
    """DistRemote's control messages (load, release, begin, close) with gated.py's GPU-signalled
    per-layer exchange over CUDA IPC mappings, KV loads through the host's stage (StagedRemote), and
    a watchdog for waits on a dead executor."""

    graph_capturable = True  # post/collect are stream operations only
    # Overlap, as PeerRemote: step t+1 is planned in the host's other plan lane while t's program may
    # still be queued, and all programs run in order on one stream there; Begin and Release are
    # handled by the host's thread in the order sent.

    def __init__(self, link: Link, spec: GuestSpec, executor_id: str, timeout_s: float, device: torch.device,
                 max_rows: int) -> None:
        super().__init__(link, spec, executor_id, timeout_s)
        from sglang_ext.transport.gated import GatedSender

        self.device = device
        self.shape = exchange_shape(spec, max_rows)
        self.sender = GatedSender(self.shape, device)
        self.rows = 0
        self._maps: list[Any] = []
        self.watchdog: Watchdog | None = None

    @classmethod
    def connect_ipc(cls, store_address: str, device: torch.device, spec: GuestSpec, executor_id: str,
                    timeout_s: float, max_rows: int, gpu: str = "") -> IpcRemote:
        """Join the pair (gloo, rank 1), exchange IPC handles and map the host's buffers. Raises
        ExecutorLost with the reason when that fails (no peer path, another node, a refusal)."""
        try:
            store = connect_store(store_address, timeout_s)
            link = Link(store, SENDER_RANK, "gloo", torch.device("cpu"),
                        local_address_toward(store_address.rpartition(":")[0]), timeout_s)
        except (RuntimeError, ValueError) as e:
            raise ExecutorLost(f"executor {executor_id} at {store_address}: {short_error(e)}") from None
        remote = cls(link, spec, executor_id, timeout_s, device, max_rows)
        try:
            remote._handshake(gpu)
        except (LinkError, ValueError, RuntimeError) as e:  # CudaSignalError is a RuntimeError
            remote.alive = False
            remote._unmap()
            link.close()
            raise ExecutorLost(f"executor {executor_id}: cuda_ipc pairing failed: {e}") from None
        return remote

    def _handshake(self, gpu: str) -> None:
        from sglang_ext.transport import cuda_signal as cs

        s = self.sender
        hello = IpcHello(self.shape.max_rows, cs.export_tensor(s.recv).to_bytes(), s.done.export().to_bytes(), gpu)
        data = msgspec.msgpack.encode(hello)
        send_blob(self.link, Hello(len(data)), data, self.timeout_s)
        welcome = msgspec.msgpack.decode(recv_blob(self.link, Reply, self.timeout_s), type=IpcWelcome)
        staged = check_welcome(welcome, self.shape, self.spec.geometry.page_bytes)
        dev = self.device.index or 0
        exec_in = cs.IpcMapping(IpcHandle.from_bytes(welcome.exec_in), dev)
        self._maps.append(exec_in)
        bell = cs.IpcMapping(IpcHandle.from_bytes(welcome.doorbell), dev)
        self._maps.append(bell)
        s.attach(exec_in.ptr, bell.flags(self.shape.layers))
        if staged:
            stage = cs.IpcMapping(IpcHandle.from_bytes(welcome.stage), dev)
            self._maps.append(stage)
            # Its own stream: the forward stream may be blocked on the executor's completion flags.
            self.stage = KVStage(stage.ptr, staged, torch.cuda.Stream(self.device))
        release_stream = torch.cuda.Stream(self.device)  # not the (blocked) forward stream
        self.watchdog = Watchdog(lambda: wait_for_goodbye(self.link), lambda: s.done.fill(release_stream, 1),
                                 name=self.executor_id)
        self.watchdog.start()

    # ---- per step ---------------------------------------------------------------------------------
    def _check(self) -> None:
        if self.watchdog is not None and self.watchdog.lost is not None and self.alive:
            self.alive = False
            logger.warning("executor %s: %s", self.executor_id, self.watchdog.lost)
        super()._check()

    def results_forged(self, upto: int | None = None) -> bool:
        # First the pending BEGIN answer (a late drop ends the pairing). Then the watchdog: `lost` is
        # set before its first release (watchdog.fire), so if it is still None once a step landed,
        # every completion flag of that step came from the executor.
        forged = super().results_forged(upto)
        return forged or (self.watchdog is not None and self.watchdog.lost is not None)

    def _lost(self, what: str, e: Exception) -> None:
        if self.watchdog is not None:
            self.watchdog.fire(f"{what}: {e}")  # a step may be queued behind its flags
        super()._lost(what, e)

    def _broken(self, what: str, e: Exception) -> None:
        if self.watchdog is not None:
            self.watchdog.fire(f"{what}: {e}")
        super()._broken(what, e)

    def begin_step(self, handles: list[int], positions: list[int]) -> list[int]:
        if len(handles) > self.shape.max_rows:
            raise ValueError(f"{len(handles)} remote rows; the exchange buffers hold {self.shape.max_rows}")
        failed = super().begin_step(handles, positions)  # [] : the answer is read later (PipelinedBegin)
        self._planned(len(handles) - len(failed))
        return failed

    # ---- the end ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Drain the sender's stream (the watchdog keeps releasing it if the executor is gone), unmap,
        say CLOSE (the host drains, releases the guest's KV and says goodbye), stop the watchdog."""
        drained = True
        if self.watchdog is not None:
            drained = device_idle(self.device, max(self.timeout_s, 5.0))
            if not drained:
                logger.error("executor %s: the sender's stream did not drain in time; its IPC mappings stay "
                             "open", self.executor_id)
        super().close()
        if self.watchdog is None:
            return
        # The host drains its queued programs (which push into our `recv` and raise our flags) before
        # its goodbye; until then our buffers must not go back to the allocator.
        said_bye = self.watchdog.peer_ended.wait(max(self.timeout_s, 5.0))
        self.watchdog.stop()
        if drained:
            self._unmap()
        if not (drained and said_bye):
            _kept.append(self.sender)
            logger.error("executor %s: no goodbye in time; keeping this pairing's exchange buffers allocated",
                         self.executor_id)

    def _unmap(self) -> None:
        self.stage = None  # its mapping goes with the others
        for m in self._maps:
            try:
                m.close()
            except RuntimeError as e:
                logger.warning("executor %s: closing an IPC mapping: %s", self.executor_id, e)
        self._maps.clear()
