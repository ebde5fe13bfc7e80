"""The host's end of a `cuda_ipc` pairing (ipc.py has the protocol and the sender's end): an
ExecutorService thread that, after the IPC handshake, plans each step and queues the guest's gated
program on its GPU instead of exchanging layers over the control channel.

    handshake   IpcHello -> open the sender's recv and done flags here, make exec_in, exec_out,
                doorbell (GatedProgram) and the KV stage (transport/stage.py), export them ->
                IpcWelcome (or its error: the pairing fails)
    load        LoadStaged (LoadMore for further chunks): the sender pushed the KV into our stage;
                host.py copies it into the partition
    step        plan + queue the program (one graph launch per step with FlashInfer)
    end         drain: every queued program is let through by raising our own doorbells (the sender
                may be dead), then the guest's KV is released. A program that will not drain keeps
                the guest's pages (never handed to another guest while a program may write them).
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any, Final

import msgspec
import torch

from sglang_ext.offload.executor import AttentionExecutor, GuestSpec
from sglang_ext.offload.ipc import exchange_shape
from sglang_ext.transport.ipc import check_hello
from sglang_ext.transport.link import Link, recv_blob, send_blob
from sglang_ext.transport.protocol import Hello, IpcHandle, IpcHello, IpcWelcome, LinkError, Reply
from sglang_ext.transport.stage import stage_bytes

logger = logging.getLogger(__name__)
DRAIN_TIMEOUT_S: Final = 10.0
PROGRAM_TIMEOUT_S: Final = 60.0  # a step's program two steps back, still not done: the pairing ends


class IpcHostEnd:
    """One guest's GPU exchange on the host: the sender's mapped buffers and our GatedProgram."""

    def __init__(self, executor: AttentionExecutor, guest: str, spec: GuestSpec, hello: IpcHello,
                 staged_loads: bool = True) -> None:
        from sglang_ext.offload.program import GatedProgram
        from sglang_ext.transport import cuda_signal as cs

        shape = check_hello(hello, partial(exchange_shape, spec))
        dev = executor.device.index or 0
        self._maps: list[Any] = []
        self.stage: torch.Tensor | None = None  # KV loads land here (stage.py); lives as long as exec_in
        try:
            recv = cs.IpcMapping(IpcHandle.from_bytes(hello.recv), dev)
            self._maps.append(recv)
            done_map = cs.IpcMapping(IpcHandle.from_bytes(hello.done), dev)
            self._maps.append(done_map)
            with torch.cuda.device(executor.device):
                self.program = GatedProgram(executor, guest, shape, recv.ptr, done_map.flags(shape.layers))
            self.program.wait_timeout_s = PROGRAM_TIMEOUT_S
            nbytes = stage_bytes(executor.partition.total_bytes, spec.geometry.page_bytes) if staged_loads else 0
            if nbytes:
                try:
                    self.stage = torch.empty(nbytes, dtype=torch.uint8, device=executor.device)
                except torch.cuda.OutOfMemoryError:
                    # It is allocated beside the partition: without room for it, loads go over gloo.
                    logger.warning("guest %s: no GPU memory for a %d MiB KV stage; its loads go over gloo",
                                   guest, nbytes >> 20)
            stage = cs.export_tensor(self.stage).to_bytes() if self.stage is not None else b""
        except BaseException:
            self.close()
            raise
        self.welcome = IpcWelcome(cs.export_tensor(self.program.exec_in).to_bytes(),
                                  self.program.doorbell.export().to_bytes(), stage=stage)

    @classmethod
    def handshake(cls, link: Link, executor: AttentionExecutor, lock: Any, guest: str, spec: GuestSpec,
                  timeout_s: float, staged_loads: bool = True) -> IpcHostEnd:
        """Answer the sender's Hello; a hello that cannot be served is answered with its error and
        raised (the pairing ends). `staged_loads`: offer a KV stage (loads GPU to GPU), else loads
        go over gloo (--disable-ipc-staged-loads)."""

        def welcome(w: IpcWelcome) -> None:
            data = msgspec.msgpack.encode(w)
            send_blob(link, Reply(len(data)), data, timeout_s)

        try:
            hello = msgspec.msgpack.decode(recv_blob(link, Hello, timeout_s), type=IpcHello)
        except msgspec.DecodeError as e:
            welcome(IpcWelcome(error=f"bad hello: {e}"))
            raise LinkError(f"cuda_ipc handshake: bad hello: {e}") from None
        try:
            with lock:
                end = cls(executor, guest, spec, hello, staged_loads)
        except (ValueError, RuntimeError) as e:  # CudaSignalError is a RuntimeError
            welcome(IpcWelcome(error=str(e)))
            raise LinkError(f"cuda_ipc handshake: {e}") from None
        welcome(end.welcome)
        return end

    def drain(self, timeout_s: float = DRAIN_TIMEOUT_S) -> bool:
        """Let every queued program finish: the sender may never ring its doorbells again (it closed,
        or died), so ring them ourselves -- they are in our memory -- until the programs are done.
        False when they did not finish in time."""
        p = self.program
        if p.idle():
            return True
        side = torch.cuda.Stream(p.dev)  # not the program's stream, which is blocked
        deadline = time.monotonic() + timeout_s
        while not p.idle():
            if time.monotonic() > deadline:
                return False
            p.doorbell.fill(side, 1)
            time.sleep(1e-3)
        p.doorbell.fill(side, 0)
        return True

    def close(self) -> None:
        for m in self._maps:
            try:
                m.close()
            except RuntimeError as e:
                logger.warning("closing an IPC mapping of a guest: %s", e)
        self._maps.clear()
