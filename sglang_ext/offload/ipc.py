"""The `cuda_ipc` transport across worker processes of one node: `IpcRemote`, the sender's end
(the host's is ipc_host.py).

Control and data go separate ways. The control messages are dist.py's, over the pairing's private
gloo group (CPU tensors, even though both ends are GPUs): load, release, begin (the step's rows,
once per step) and close. The per-layer data and signals never touch a host: they are gated.py's
stream operations on memory the two processes share with CUDA IPC.

    sender (GPU a)                                         host (GPU b), its ExecutorService thread
    GatedSender: send, recv, done[L]                       GatedProgram: exec_in, exec_out, doorbell[L]
    [IPC_HELLO n] + IpcHello(recv, done handles) ───────>  opens recv, done on b; makes its buffers
    opens exec_in, doorbell, stage <── [REPLY n] + IpcWelcome(exec_in, doorbell, stage handles | error)
    load: push KV -> stage; [LOAD_STAGED ..] ──────────>  copy stage -> partition (stage.py)
           <───────────────────────────── [REPLY ok]
    begin: [BEGIN n] + rows ────────────────────────────>  plan; queue the gated program (2 lanes)
           <───────────────────────────── [REPLY f] + dropped handles
    per layer: push q|k|v -> exec_in, ring doorbell[l] ─>  (on b's stream: wait, attend, push o -> recv,
               wait done[l] <────────────────────────────   raise done[l])
    close: [CLOSE] ─────────────────────────────────────>  drains, releases the guest; goodbye on TAG_WATCH

Handles travel as IpcHandle bytes inside msgspec (msgpack) structs, never pickled. KV loads go GPU to
GPU through a staging buffer the host exports in its welcome (stage.py; KV larger than it goes in
chunks); with a host that sent none they go over the control channel (CPU tensors), as torch_dist does.

A dead executor is the watchdog's business (watchdog.py): its thread waits on TAG_WATCH, which only
the host's goodbye or a broken connection ends; then it raises the sender's completion flags until
its stream has drained, and the next call raises ExecutorLost.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import Any, Final

import msgspec
import torch

from sglang_ext.offload.dist import (
    IDLE_TIMEOUT_S,
    REPLY,
    SENDER_RANK,
    TAG_CTRL,
    Link,
    LinkError,
    PipelinedBegin,
    _short,
    connect_store,
    local_address_toward,
)
from sglang_ext.offload.executor import GuestSpec
from sglang_ext.offload.gated import ExchangeShape, GatedSenderSide
from sglang_ext.offload.remote import ExecutorLost
from sglang_ext.offload.stage import KVStage, StagedRemote, check_stage
from sglang_ext.offload.watchdog import Watchdog

logger = logging.getLogger(__name__)

IPC_HELLO: Final = 6  # a control message kind after dist.py's LOAD .. REPLY
TAG_WATCH: Final = 3  # the watchdog's channel: the host's goodbye, or an error when the pair breaks
BYE: Final = 7
MAX_ROWS: Final = 1 << 16
MAX_BLOB: Final = 4096
HANDLE_BYTES: Final = 80  # cuda_signal.IpcHandle.to_bytes()
_kept: list[object] = []  # exchange buffers a peer may still write (never freed: rare, and safe)


class IpcHello(msgspec.Struct, forbid_unknown_fields=True):
    """Sender -> host: where the executor pushes outputs (`recv`) and raises `done` flags."""

    max_rows: int
    recv: bytes  # IpcHandle bytes of [max_rows, Hq * D] of the guest's dtype
    done: bytes  # IpcHandle bytes of L int32 flags
    gpu: str = ""  # the sender GPU's UUID


class IpcWelcome(msgspec.Struct, forbid_unknown_fields=True):
    """Host -> sender: where the sender pushes q|k|v (`exec_in`) and rings `doorbell`, or why not."""

    exec_in: bytes = b""  # [max_rows, (Hq + 2 Hkv) * D]
    doorbell: bytes = b""  # L int32 flags
    error: str = ""
    stage: bytes = b""  # whole guest pages, for KV loads (stage.py); empty: loads go over gloo


def exchange_shape(spec: GuestSpec, max_rows: int) -> ExchangeShape:
    g = spec.geometry
    return ExchangeShape(g.num_layers, spec.num_q_heads, g.num_kv_heads, spec.head_dim, g.dtype, max_rows)


def _handle_size(data: bytes, what: str) -> int:
    """The buffer size an IpcHandle's bytes name (ValueError if they are not one)."""
    if len(data) != HANDLE_BYTES:
        raise ValueError(f"{what}: an IPC handle is {HANDLE_BYTES} bytes, got {len(data)}")
    return int.from_bytes(data[72:80], "little")


def check_hello(hello: IpcHello, spec: GuestSpec) -> ExchangeShape:
    """The exchange a hello describes; ValueError when its buffers do not fit the guest's shape."""
    if not 1 <= hello.max_rows <= MAX_ROWS:
        raise ValueError(f"max_rows {hello.max_rows} is not in [1, {MAX_ROWS}]")
    shape = exchange_shape(spec, hello.max_rows)
    elem = torch.empty(0, dtype=shape.dtype).element_size()
    if _handle_size(hello.recv, "recv") != shape.max_rows * shape.width_out * elem:
        raise ValueError(f"recv buffer is not {shape.max_rows} x {shape.width_out} {shape.dtype}")
    if _handle_size(hello.done, "done") != 4 * shape.layers:
        raise ValueError(f"done flags are not {shape.layers} int32")
    return shape


def check_welcome(w: IpcWelcome, shape: ExchangeShape, page_bytes: int) -> int:
    """ValueError when the welcome is an error or its buffers do not fit; returns the stage's bytes."""
    if w.error:
        raise ValueError(w.error)
    elem = torch.empty(0, dtype=shape.dtype).element_size()
    if _handle_size(w.exec_in, "exec_in") != shape.max_rows * shape.width_in * elem:
        raise ValueError(f"exec_in buffer is not {shape.max_rows} x {shape.width_in} {shape.dtype}")
    if _handle_size(w.doorbell, "doorbell") != 4 * shape.layers:
        raise ValueError(f"doorbell flags are not {shape.layers} int32")
    if not w.stage:
        return 0  # a host without a stage (or an older one)
    nbytes = _handle_size(w.stage, "stage")
    check_stage(nbytes, page_bytes)
    return nbytes


def send_blob(link: Link, kind: int, data: bytes, timeout_s: float) -> None:
    link.send_header([kind, len(data)], timeout_s)
    link.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), TAG_CTRL, timeout_s)


def recv_blob(link: Link, kind: int, timeout_s: float) -> bytes:
    got, n = link.recv_header(timeout_s)[:2]
    if got != kind or not 0 < n <= MAX_BLOB:
        raise LinkError(f"expected message kind {kind} of at most {MAX_BLOB} bytes, got kind {got} of {n}")
    buf = torch.empty(n, dtype=torch.uint8)
    link.recv(buf, TAG_CTRL, timeout_s)
    return buf.numpy().tobytes()


def wait_for_goodbye(link: Link) -> str | None:
    """Block on TAG_WATCH: None at the host's goodbye, else why the pair broke. Holds the group
    (`pg`) itself, so it stays alive while this waits even after the sender's Link drops it."""
    pg = link.pg
    buf = torch.zeros(1, dtype=torch.int64)
    try:
        work = pg.recv([buf], link.peer, TAG_WATCH)
        work.wait(timedelta(seconds=IDLE_TIMEOUT_S))
    except RuntimeError as e:
        return _short(e)
    return None if int(buf[0]) == BYE else f"unexpected watch message {int(buf[0])}"


def say_goodbye(link: Link, timeout_s: float) -> None:
    """The host's end of `wait_for_goodbye`."""
    link.send(torch.tensor([BYE], dtype=torch.int64), TAG_WATCH, timeout_s)


def device_idle(device: torch.device, timeout_s: float) -> bool:
    """Wait for every stream of the device (the exchange may run on any of the sender's), at most
    `timeout_s`: the synchronisation runs on a helper thread, so a wait that never ends cannot hold us."""
    t = threading.Thread(target=torch.cuda.synchronize, args=(device,), name="ipc-drain", daemon=True)
    t.start()
    t.join(timeout_s)
    return not t.is_alive()


class IpcRemote(GatedSenderSide, PipelinedBegin, StagedRemote):
    """DistRemote's control messages (load, release, begin, close) with gated.py's GPU-signalled
    per-layer exchange over CUDA IPC mappings, KV loads through the host's stage (StagedRemote), and
    a watchdog for waits on a dead executor."""

    graph_capturable = True  # post/collect are stream operations only
    # As PeerRemote: step t+1 is planned in the host's other plan lane while t's program may still be
    # queued, and all programs run in order on one stream there; BEGIN and RELEASE are handled by the
    # host's thread in the order sent.
    overlap_safe = True

    def __init__(self, link: Link, spec: GuestSpec, executor_id: str, timeout_s: float, device: torch.device,
                 max_rows: int) -> None:
        super().__init__(link, spec, executor_id, timeout_s)
        from sglang_ext.offload.gated import GatedSender

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
            raise ExecutorLost(f"executor {executor_id} at {store_address}: {_short(e)}") from None
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
        from sglang_ext.offload import cuda_signal as cs

        s = self.sender
        hello = IpcHello(self.shape.max_rows, cs.export_tensor(s.recv).to_bytes(), s.done.export().to_bytes(), gpu)
        send_blob(self.link, IPC_HELLO, msgspec.msgpack.encode(hello), self.timeout_s)
        welcome = msgspec.msgpack.decode(recv_blob(self.link, REPLY, self.timeout_s), type=IpcWelcome)
        staged = check_welcome(welcome, self.shape, self.spec.geometry.page_bytes)
        dev = self.device.index or 0
        exec_in = cs.IpcMapping(cs.IpcHandle.from_bytes(welcome.exec_in), dev)
        self._maps.append(exec_in)
        bell = cs.IpcMapping(cs.IpcHandle.from_bytes(welcome.doorbell), dev)
        self._maps.append(bell)
        s.attach(exec_in.ptr, bell.flags(self.shape.layers))
        if staged:
            stage = cs.IpcMapping(cs.IpcHandle.from_bytes(welcome.stage), dev)
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
