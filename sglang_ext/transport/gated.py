"""The sender's end of the GPU-signalled exchange (`GatedSender`); the executor's end is
offload/program.py's `GatedProgram`. Neither end cares whether the other end's memory is a peer GPU's
of this process or another process's mapped with CUDA IPC: both only hold raw addresses (`exec_in`,
`recv`) and flag arrays: `done` (one flag per layer) in the sender's memory, `doorbell` in the
executor's. One decode step of L layers, on the sender's stream s and the executor's stream x:

    GatedSender  (sender's GPU, stream s)           GatedProgram  (executor's GPU, stream x)
    pack q|k|v -> send; push send -> exec_in
    doorbell[l] := 1  ───────────────────────────>  wait doorbell[l] == 1
                                                    l = L-1 only: doorbell[*] := 0   (one memset)
    local rows' attention                           attention over the guest's pages -> exec_out
    wait done[l] == 1  <─────────────────────────   push exec_out -> recv; done[l] := 1
    l = L-1 only: done[*] := 0   (one memset)
    scatter recv into the layer's output

Flags reset once per step ("lean"): each flag is raised once per step by its producer and awaited once
by its consumer, and each consumer zeroes its whole array with one memset right after its last wait of
the step (layer L-1), instead of zeroing every flag after its wait (a stream write per layer per side).
Between steps every flag is 0, as when it was allocated, so a step is the same operations with the same
values every time: it replays from a CUDA graph (values are baked at capture), and eager and replayed
steps, and graphs of different row counts, follow each other in any order.

Why no signal is lost or consumed twice (per pairing; stream order is the only ordering relied on):
- Nothing is zeroed before it is consumed: a consumer's reset follows, on its own stream, its waits on
  every flag of the step (flags 0..L-2 were awaited before flag L-1).
- No step-n signal outlives its step: every flag of the array was raised by step n before the reset
  (the consumer saw each), and step n raises none again.
- A reset cannot erase a step n+1 signal (no late reset): the sender rings step n+1's first doorbell
  only after its wait on done[L-1] of step n, which the executor raises after its doorbell memset (the
  memset precedes that write on x, and the write's memory fence makes it visible first). The executor
  raises step n+1's done[l] only after step n+1's doorbell[l], which the sender rings after its done
  memset of step n (both on s). So each reset lies after the last wait of its step and before the
  first signal of the next step that writes the same array.
- A step the executor has no rows for queues nothing on either side (the sender posts nothing: the
  rows were dropped at begin_step), so the flags stay 0. A cuda_ipc sender that already launched the
  step learns of the drop later and the pairing ends, as for any failure below.
Preconditions, unchanged by the lean reset: a step runs all L layers in order on one sender stream,
and the executor's programs run in order on one stream. A step that stops mid-way (an error between
layers) leaves the pair out of step in either scheme, so the pairing ends: the cuda_ipc watchdog raises
done[*] again and again until the sender's stream drains (each raise lets one queued step through, its
memset lowers them, the next raise lets the next one through), and a host drains its queued programs
by raising its own doorbells the same way (ipc_host.py). Several senders: each pairing has its own
doorbells, done flags and program stream, so a reset only ever touches its own pairing's flags.

Buffers are reused every layer safely: the sender writes `exec_in` for layer l+1 only after
`done[l]`, by which time the executor has read layer l's; the executor writes `recv` for l+1 only
after the doorbell of l+1, which the sender rings after consuming layer l's output.
tests/test_gated_protocol.py checks these orders over every interleaving of the two streams, and
tests/test_gpu_gated_exchange.py runs them on a GPU.
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
        if layer == self.shape.layers - 1:
            self.done.fill(s, 0)  # the step's one reset, after its last wait (module docstring)
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
