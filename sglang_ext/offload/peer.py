"""`PeerRemote`: an executor on another GPU of this process, signalled on the GPU (no host on the
per-layer path).

Per decode step the host plans the executor's rows once (`begin_step`) and enqueues the executor's
whole 32-layer program on a stream of the executor's GPU; every layer of it first waits for a
doorbell in the executor's memory. Per layer the sender's stream pushes the packed q|k|v of its
remote rows into the executor's buffer and rings the doorbell; the executor attends, pushes o back
into the sender's buffer and raises `done[l]` in the sender's memory, which the sender's stream
awaits before it scatters o. Flags are reset by whoever consumed them (reset-after-consume), so the
same operations can later be replayed from CUDA graphs.

    sender stream (GPU a)                           executor stream (GPU b)
    pack q|k|v -> send; push send -> exec_in
    doorbell[l] := 1  ───────────────────────────>  wait doorbell[l] == 1; doorbell[l] := 0
    local rows' attention                           attention over the guest's pages -> exec_out
    wait done[l] == 1; done[l] := 0  <────────────  push exec_out -> recv; done[l] := 1
    scatter recv into the layer's output

With a backend that supports CUDA graphs (FlashInfer), the executor's whole gated 32-layer program
is one graph per padded row count, so queueing it costs the host one launch, not hundreds.

Buffers are reused every layer safely: the sender writes `exec_in` for layer l+1 only after
`done[l]`, by which time the executor has read layer l's; the executor writes `recv` for l+1 only
after the doorbell of l+1, which the sender rings after consuming layer l's output.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang_ext.attention.base import AttentionBackend
from sglang_ext.engine.cuda_graph import padded_size
from sglang_ext.engine.forward_batch import ForwardBatch
from sglang_ext.engine.split_graph import REMOTE_SIZES
from sglang_ext.offload import cuda_signal as cs
from sglang_ext.offload.executor import AttentionExecutor, GuestSpec
from sglang_ext.offload.remote import LocalRemote


@dataclass(eq=False)
class _Lane:
    """One set of executor plan buffers and the graphs captured over them."""

    backend: AttentionBackend
    loc: torch.Tensor  # KV slots of the step's rows (the graphs read it)
    mempool: Any
    graphs: dict[int, torch.cuda.CUDAGraph] = field(default_factory=dict)
    done: torch.cuda.Event | None = None  # end of this lane's last queued program


class PeerRemote(LocalRemote):
    """LocalRemote's per-request calls (load, release) with a GPU-signalled per-layer exchange."""

    graph_capturable = True  # post/collect are stream operations only: decode graphs can hold them
    # Overlap: step t+1 is planned in the other lane while step t's program may still be queued; all
    # programs run in order on one stream, so pages released meanwhile and allocated again by a later
    # plan are written only after the programs that read them, and a load (on another stream) waits
    # on the GPU for the last queued program.
    overlap_safe = True

    def __init__(self, executor: AttentionExecutor, guest: str, spec: GuestSpec, sender_device: torch.device,
                 num_q_heads: int, max_rows: int = 1024, executor_id: str = "peer") -> None:
        super().__init__(executor, guest, spec, executor_id)
        g = spec.geometry
        self.layers = g.num_layers
        self.hq, self.hkv, self.d = num_q_heads, g.num_kv_heads, g.head_dim
        self.dtype = g.dtype
        self.dev_s, self.dev_e = torch.device(sender_device), executor.device
        a, b = self.dev_s.index or 0, self.dev_e.index or 0
        cs.enable_peer_access(a, b)
        cs.enable_peer_access(b, a)
        width_in = (self.hq + 2 * self.hkv) * self.d
        self.max_rows = max_rows
        self.send = torch.empty(max_rows, width_in, dtype=self.dtype, device=self.dev_s)
        self.recv = torch.empty(max_rows, self.hq * self.d, dtype=self.dtype, device=self.dev_s)
        self.exec_in = torch.empty(max_rows, width_in, dtype=self.dtype, device=self.dev_e)
        self.exec_out = torch.empty(max_rows, self.hq * self.d, dtype=self.dtype, device=self.dev_e)
        self.doorbell = cs.FlagArray.allocate(self.layers, b)
        self.done = cs.FlagArray.allocate(self.layers, a)
        self.stream = torch.cuda.Stream(self.dev_e, priority=-1)  # ahead of the host model's kernels
        self.rows = 0  # the step's remote rows (wait_s stays 0: the waiting happens on the GPU)
        self._warm: set[int] = set()  # row counts whose executor kernels ran once ungated
        self._posted = 0  # rows the sender moves per layer: `rows`, or its padded size in a graph
        self._program_done: torch.cuda.Event | None = None  # end of the last queued executor program
        # Executor-side graphs, one per padded row count, in two lanes that alternate by step: planning
        # step t+1 rewrites only its own lane's plan buffers, which step t-1 used, so it need not wait
        # for step t's program (still queued behind the sender's doorbells).
        self.sizes = [n for n in REMOTE_SIZES if n < max_rows] + [max_rows]
        self._lanes: list[_Lane] = []
        self._step = 0
        first = executor.guests[guest].backend
        if first.supports_cuda_graph():
            with torch.cuda.device(self.dev_e):
                pages = executor.partition.total_bytes // g.page_bytes + 1
                mempool = torch.cuda.graph_pool_handle()  # shared: programs run one after another on `stream`
                for backend in (first, type(first)(first.pool, spec.num_q_heads, spec.head_dim, spec.scale)):
                    backend.init_cuda_graph_state(max_rows, pages)
                    loc = torch.zeros(max_rows, dtype=torch.int64, device=self.dev_e)  # pads: slot 0 of page 0
                    self._lanes.append(_Lane(backend, loc, mempool))

    def load(self, handle: int, kv: torch.Tensor, length: int) -> bool:
        # The pages it gets may have been freed by a request whose last queued program still reads and
        # writes them on `stream`: the copy in waits for that program on the GPU (no host wait).
        if self._program_done is not None:
            torch.cuda.current_stream(self.dev_e).wait_event(self._program_done)
        return super().load(handle, kv, length)

    # ---- per step --------------------------------------------------------------------------------
    def begin_step(self, handles: list[int], positions: list[int]) -> list[int]:
        self._check()
        if len(handles) > self.max_rows:
            raise ValueError(f"{len(handles)} remote rows; the exchange buffers hold {self.max_rows}")
        lane = self._lanes[self._step % 2] if self._lanes else None
        self._step += 1
        last = lane.done if lane is not None else self._program_done
        if last is not None:
            # Planning rewrites plan buffers (and their pinned host staging) and frees a page table that
            # a queued program may still read: with lanes, the program two steps back (long finished
            # in practice); without, the last one. A caller that read the last step's tokens has
            # waited for it anyway.
            last.synchronize()
        failed = self.executor.plan(self.guest, handles, positions, prepare=lane is None)
        self.rows = len(handles) - len(failed)
        if not self.rows:  # every row was dropped: the sender posts nothing this step, so queue nothing
            self._program_done = None
        elif lane is not None:
            self._replay_executor_step(lane)
        else:
            if self.rows not in self._warm:
                self._warm_up()
            self._enqueue_executor_step()
        elem = self.send.element_size()
        self.bytes_out += self.rows * self.layers * self.send.shape[1] * elem  # counted here: graph
        self.bytes_in += self.rows * self.layers * self.recv.shape[1] * elem  # replays run no Python
        return failed

    def _warm_up(self) -> None:
        """Run this row count's executor kernels once, ungated, and wait for them. A kernel's first
        launch may load its module, which can wait for the whole GPU to go idle; queued behind a
        doorbell wait that only the sender will ring, that is a deadlock. (What this step writes
        at the planned KV slots is overwritten by the real step at the same positions.)"""
        g = self.executor.guests[self.guest]
        assert g.batch is not None
        with torch.cuda.device(self.dev_e):
            self.exec_in[: self.rows].zero_()
            self._program(g.backend, self.rows, g.batch, gated=False)
            torch.cuda.synchronize(self.dev_e)
        self._warm.add(self.rows)

    def _enqueue_executor_step(self) -> None:
        """The executor's program for this step (eager: a backend without CUDA graphs), queued now,
        gated layer by layer on the GPU."""
        g = self.executor.guests[self.guest]
        assert g.batch is not None
        s = self.stream
        # plans and KV loads were issued on the executor GPU's current stream
        s.wait_stream(torch.cuda.current_stream(self.dev_e))
        with torch.cuda.device(self.dev_e), torch.cuda.stream(s):
            self._program(g.backend, self.rows, g.batch, gated=True)
            self._program_done = torch.cuda.Event()
            self._program_done.record(s)

    # ---- the executor's program as CUDA graphs -----------------------------------------------------
    def _replay_executor_step(self, lane: _Lane) -> None:
        batch = self.executor.guests[self.guest].batch
        assert batch is not None
        n = self.rows
        rp = padded_size(self.sizes, n)
        assert rp is not None
        s = self.stream
        with torch.cuda.device(self.dev_e):
            lane.backend.prepare_for_replay(batch, rp)  # re-plans the lane's captured buffers in place
            lane.loc[:n].copy_(batch.out_cache_loc, non_blocking=True)
            lane.loc[n:rp].zero_()
            s.wait_stream(torch.cuda.current_stream(self.dev_e))
            graph = lane.graphs.get(rp)
            if graph is None:
                graph = self._capture(lane, rp, dataclasses.replace(batch, out_cache_loc=lane.loc[:rp]))
            with torch.cuda.stream(s):
                graph.replay()
            lane.done = self._program_done = torch.cuda.Event()
            lane.done.record(s)

    def _capture(self, lane: _Lane, rp: int, static: ForwardBatch) -> torch.cuda.CUDAGraph:
        """Capture the gated program for `rp` rows, after running it once ungated (kernel modules load
        and JIT happens outside the capture and outside any doorbell wait; what the warm run writes at
        the planned slots is overwritten by the real step at the same positions). The device sync
        may wait for the other lane's queued program: the sender's already queued step rings it."""
        s = self.stream
        with torch.cuda.stream(s):
            self._program(lane.backend, rp, static, gated=False)
        torch.cuda.synchronize(self.dev_e)
        graph = torch.cuda.CUDAGraph()
        # Not `torch.cuda.graph(...)`: it empties the allocator's cache, and a cudaFree waits for the
        # GPU to go idle (see split_graph.py).
        with torch.cuda.stream(s):
            graph.capture_begin(pool=lane.mempool)
            try:
                self._program(lane.backend, rp, static, gated=True)
            finally:
                graph.capture_end()
        lane.graphs[rp] = graph
        return graph

    def _program(self, backend: AttentionBackend, n: int, batch: ForwardBatch, gated: bool) -> None:
        """The executor's step for `n` (padded) rows on the current stream: per layer, wait for the
        sender's q|k|v, attend, push o back and signal."""
        hq, hkv, d = self.hq, self.hkv, self.d
        s = self.stream
        qkv = self.exec_in[:n]
        q = qkv[:, : hq * d].view(n, hq, d)
        k = qkv[:, hq * d : (hq + hkv) * d].view(n, hkv, d)
        v = qkv[:, (hq + hkv) * d :].view(n, hkv, d)
        out = self.exec_out[:n]
        nbytes = out.numel() * out.element_size()
        for layer in range(self.layers):
            if gated:
                self.doorbell.wait(s, layer, 1)
                self.doorbell.write(s, layer, 0)
            out.copy_(backend.forward(q, k, v, layer, batch).reshape(n, hq * d))
            if gated:
                cs.peer_copy(self.recv.data_ptr(), out.data_ptr(), nbytes, s)
                self.done.write(s, layer, 1)

    def post(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        n = self._posted = q.shape[0]  # in a graph: the padded size; the first `rows` are real
        s = torch.cuda.current_stream(self.dev_s)
        buf = self.send[:n]
        torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=1, out=buf)
        cs.peer_copy(self.exec_in.data_ptr(), buf.data_ptr(), buf.numel() * buf.element_size(), s)
        self.doorbell.write(s, layer, 1)

    def collect(self, layer: int) -> torch.Tensor:
        n = self._posted
        s = torch.cuda.current_stream(self.dev_s)
        self.done.wait(s, layer, 1)
        self.done.write(s, layer, 0)
        return self.recv[:n].view(n, self.hq, self.d)
