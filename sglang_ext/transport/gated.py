"""The sender's end of the GPU-signalled exchange (`GatedSender`); the executor's end is
offload/program.py's `GatedProgram`. Neither end cares whether the other end's memory is a peer GPU's
of this process or another process's mapped with CUDA IPC: both only hold raw addresses (`exec_in`,
`recv`) and flag arrays.

    GatedSender  (sender's GPU)                     GatedProgram  (executor's GPU)
    pack q|k|v -> send; push send -> exec_in
    doorbell[l] := 1  ───────────────────────────>  wait doorbell[l] == 1; doorbell[l] := 0
    local rows' attention                           attention over the guest's pages -> exec_out
    wait done[l] == 1; done[l] := 0  <────────────  push exec_out -> recv; done[l] := 1
    scatter recv into the layer's output

Flags are reset by whoever consumed them (reset-after-consume), so the same operations replay from
CUDA graphs. Buffers are reused every layer safely: the sender writes `exec_in` for layer l+1 only
after `done[l]`, by which time the executor has read layer l's; the executor writes `recv` for l+1
only after the doorbell of l+1, which the sender rings after consuming layer l's output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_ext.transport import cuda_signal as cs


@dataclass(frozen=True)
class ExchangeShape:
    """What moves per layer: R rows of q|k|v ([Hq + 2 Hkv] x D) out, R rows of o (Hq x D) back."""

    layers: int
    hq: int
    hkv: int
    d: int
    dtype: torch.dtype
    max_rows: int

    @property
    def width_in(self) -> int:
        return (self.hq + 2 * self.hkv) * self.d

    @property
    def width_out(self) -> int:
        return self.hq * self.d

    @property
    def elem(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()


class GatedSender:
    """The sender's end: per layer, stream operations only (so decode graphs can hold them).
    `send`, `recv` and `done` are in the sender's memory (made here); `exec_in` (an address) and
    `doorbell` are the executor's (`attach`)."""

    def __init__(self, shape: ExchangeShape, device: torch.device) -> None:
        self.shape, self.dev = shape, device
        self.send = torch.empty(shape.max_rows, shape.width_in, dtype=shape.dtype, device=device)
        self.recv = torch.empty(shape.max_rows, shape.width_out, dtype=shape.dtype, device=device)
        self.done = cs.FlagArray.allocate(shape.layers, device.index or 0)
        self.exec_in_ptr = 0
        self.doorbell: cs.FlagArray | None = None
        self._posted = 0  # rows moved per layer: the step's rows, or their padded size in a graph

    def attach(self, exec_in_ptr: int, doorbell: cs.FlagArray) -> None:
        """The executor's end, once it exists (its buffers are made after it has the sender's)."""
        self.exec_in_ptr, self.doorbell = exec_in_ptr, doorbell

    def step_bytes(self, rows: int) -> tuple[int, int]:
        """Bytes out and in for a step of `rows` rows (counted at begin_step: graph replays run no Python)."""
        sh, elem = self.shape, self.send.element_size()
        return rows * sh.layers * sh.width_in * elem, rows * sh.layers * sh.width_out * elem

    def post(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        n = self._posted = q.shape[0]  # in a graph: the padded size; the first rows are real
        s = torch.cuda.current_stream(self.dev)
        buf = self.send[:n]
        torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=1, out=buf)
        assert self.doorbell is not None, "post before attach"
        cs.peer_copy(self.exec_in_ptr, buf.data_ptr(), buf.numel() * buf.element_size(), s)
        self.doorbell.write(s, layer, 1)

    def collect(self, layer: int) -> torch.Tensor:
        n = self._posted
        s = torch.cuda.current_stream(self.dev)
        self.done.wait(s, layer, 1)
        self.done.write(s, layer, 0)
        return self.recv[:n].view(n, self.shape.hq, self.shape.d)


class GatedSenderSide:
    """The remote-attention calls a transport with a `GatedSender` makes the same way (PeerRemote in
    one process, IpcRemote across processes): per layer post/collect are the sender's stream
    operations, and a step's bytes are counted when it is planned (graph replays run no Python)."""

    sender: GatedSender
    rows: int
    bytes_out: int
    bytes_in: int

    def _planned(self, rows: int) -> None:
        self.rows = rows
        out, into = self.sender.step_bytes(rows)
        self.bytes_out += out
        self.bytes_in += into

    def post(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.sender.post(layer, q, k, v)

    def collect(self, layer: int) -> torch.Tensor:
        return self.sender.collect(layer)
