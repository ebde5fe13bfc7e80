"""`PeerRemote`: an executor on another GPU of this process, signalled on the GPU (no host on the
per-layer path).

Per decode step the host plans the executor's rows once (`begin_step`) and queues the executor's
whole gated program on a stream of the executor's GPU; per layer the sender's stream pushes its
remote rows' q|k|v into the executor's buffer, rings a doorbell there, and awaits a completion flag
the executor raises in the sender's memory. The two ends are transport/gated.py's `GatedSender` and
program.py's `GatedProgram` (the cross-process transport, ipc.py, uses the same two over CUDA IPC
mappings).
"""

from __future__ import annotations

import torch

from sglang_ext.offload.executor import AttentionExecutor, GuestSpec
from sglang_ext.offload.program import GatedProgram
from sglang_ext.offload.remote import LocalRemote
from sglang_ext.transport import cuda_signal as cs
from sglang_ext.transport.gated import ExchangeShape, GatedSender, GatedSenderSide


class PeerRemote(GatedSenderSide, LocalRemote):
    """LocalRemote's per-request calls (load, release) with a GPU-signalled per-layer exchange."""

    graph_capturable = True  # post/collect are stream operations only: decode graphs can hold them
    # Overlap: step t+1 is planned in the other lane while step t's program may still be queued; all
    # programs run in order on one stream, so pages released meanwhile and allocated again by a later
    # plan are written only after the programs that read them, and a load (on another stream) waits
    # on the GPU for the last queued program.

    def __init__(self, executor: AttentionExecutor, guest: str, spec: GuestSpec, sender_device: torch.device,
                 num_q_heads: int, max_rows: int = 1024, executor_id: str = "peer") -> None:
        super().__init__(executor, guest, spec, executor_id)
        g = spec.geometry
        self.dev_s, self.dev_e = torch.device(sender_device), executor.device
        a, b = self.dev_s.index or 0, self.dev_e.index or 0
        cs.enable_peer_access(a, b)
        cs.enable_peer_access(b, a)
        shape = ExchangeShape(g.num_layers, num_q_heads, g.num_kv_heads, g.head_dim, g.dtype, max_rows)
        self.max_rows = max_rows
        self.sender = GatedSender(shape, self.dev_s)
        self.program = GatedProgram(executor, guest, shape, self.sender.recv.data_ptr(), self.sender.done)
        self.sender.attach(self.program.exec_in.data_ptr(), self.program.doorbell)
        self.rows = 0  # the step's remote rows (wait_s stays 0: the waiting happens on the GPU)

    def load(self, handle: int, kv: torch.Tensor, length: int, reserve_tokens: int = 0) -> bool:
        self.program.before_load()
        return super().load(handle, kv, length, reserve_tokens)

    def begin_step(self, handles: list[int], positions: list[int]) -> list[int]:
        self._check()
        failed = self.program.step(handles, positions)
        self._planned(self.program.rows)
        return failed
