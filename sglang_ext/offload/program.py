"""`GatedProgram`: the executor's end of the GPU-signalled exchange (transport/gated.py has the
protocol and the sender's end), used by the in-process `PeerRemote` (peer.py) and by a cuda_ipc host
(ipc_host.py). Per step it plans the guest's rows on the AttentionExecutor and queues the guest's
whole gated program on a high-priority stream of the executor's GPU.

With a backend that supports CUDA graphs (FlashInfer), the executor's whole gated program is one
graph per padded row count, in two plan lanes that alternate by step: planning step t+1 rewrites
only its own lane's plan buffers, which step t-1 used, so it need not wait for step t's program
(still queued behind the sender's doorbells).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang_ext.attention.base import AttentionBackend
from sglang_ext.engine import sm_partition
from sglang_ext.engine.cuda_graph import padded_size
from sglang_ext.engine.split_graph import REMOTE_SIZES
from sglang_ext.forward_batch import ForwardBatch
from sglang_ext.offload.executor import AttentionExecutor
from sglang_ext.transport import cuda_signal as cs
from sglang_ext.transport.gated import ExchangeShape
from sglang_ext.transport.stage import wait_event


@dataclass(eq=False)
class _Lane:
    """One set of executor plan buffers and the graphs captured over them."""

    backend: AttentionBackend
    loc: torch.Tensor  # KV slots of the step's rows (the graphs read it)
    mempool: Any
    graphs: dict[int, torch.cuda.CUDAGraph] = field(default_factory=dict)
    done: torch.cuda.Event | None = None  # end of this lane's last queued program


class GatedProgram:
    """The executor's end: per step, plan the guest's rows and queue its whole gated program on a
    high-priority stream of the executor's GPU. `exec_in`/`exec_out` and `doorbell` are in the
    executor's memory (made here); `recv` (an address) and `done` are the sender's (a peer GPU's,
    or mapped from another process)."""

    def __init__(self, executor: AttentionExecutor, guest: str, shape: ExchangeShape, recv_ptr: int,
                 done: cs.FlagArray) -> None:
        self.executor, self.guest, self.shape = executor, guest, shape
        self.dev = executor.device
        self.exec_in = torch.empty(shape.max_rows, shape.width_in, dtype=shape.dtype, device=self.dev)
        self.exec_out = torch.empty(shape.max_rows, shape.width_out, dtype=shape.dtype, device=self.dev)
        self.doorbell = cs.FlagArray.allocate(shape.layers, self.dev.index or 0)
        self.recv_ptr, self.done = recv_ptr, done
        # Ahead of the host model's kernels; in the executor's SM partition where it has one (executor_max_sms).
        self.stream = sm_partition.executor_stream(self.dev) or torch.cuda.Stream(self.dev, priority=-1)
        self.rows = 0  # the step's rows the executor computes
        self._warm: set[int] = set()  # row counts whose kernels ran once ungated
        self.program_done: torch.cuda.Event | None = None  # end of the last queued program
        self._loads: list[torch.cuda.Event] = []  # copies on other streams the next program waits for
        # None: wait as long as it takes (in one process, the sender is this process). A host serving
        # another process sets a bound: a program that never finishes then fails the step, not the thread.
        self.wait_timeout_s: float | None = None
        self.sizes = [n for n in REMOTE_SIZES if n < shape.max_rows] + [shape.max_rows]
        self._lanes: list[_Lane] = []
        self._lane: _Lane | None = None  # the planned step's lane, between plan() and queue()
        self._step = 0
        g = executor.guests[guest]
        first, spec = g.backend, g.spec
        if first.supports_cuda_graph():
            with torch.cuda.device(self.dev):
                pages = executor.partition.total_bytes // spec.geometry.page_bytes + 1
                mempool = torch.cuda.graph_pool_handle()  # shared: programs run one after another on `stream`
                for backend in (first, type(first)(first.pool, spec.num_q_heads, spec.head_dim, spec.scale)):
                    backend.init_cuda_graph_state(shape.max_rows, pages)
                    loc = torch.zeros(shape.max_rows, dtype=torch.int64, device=self.dev)  # pads: slot 0 of page 0
                    self._lanes.append(_Lane(backend, loc, mempool))

    def before_load(self) -> None:
        """A KV load gets pages that a request freed meanwhile may still be read and written by its
        last queued program on `stream`: the copy in (on the current stream) waits for that program
        on the GPU (no host wait)."""
        if self.program_done is not None:
            torch.cuda.current_stream(self.dev).wait_event(self.program_done)

    def after_load(self, stream: torch.cuda.Stream) -> None:
        """A load ran on `stream`, not on the thread that queues programs (an Adrenaline adoption, on
        a side stream of the prefill worker's forward thread): the next program waits for it."""
        ev = torch.cuda.Event()
        ev.record(stream)
        self._loads.append(ev)

    def _after_loads(self, s: torch.cuda.Stream) -> None:
        for ev in self._loads:
            s.wait_event(ev)
        self._loads.clear()

    def step(self, handles: list[int], positions: list[int]) -> list[int]:
        """Plan a step and queue its program; returns the handles the executor dropped."""
        failed = self.plan(handles, positions)
        self.queue()
        return failed

    def plan(self, handles: list[int], positions: list[int]) -> list[int]:
        """The first half of `step`: plan the rows (the handles the executor dropped are known now).
        A host in another process answers the sender between the halves: once `queue` has put a
        program behind doorbells on this GPU, nothing may wait for this process's next CUDA call
        (a kernel's first launch elsewhere in the process can hold every CUDA call until the GPU is
        idle), so the sender must not need anything more from us to ring them."""
        if len(handles) > self.shape.max_rows:
            raise ValueError(f"{len(handles)} remote rows; the exchange buffers hold {self.shape.max_rows}")
        lane = self._lanes[self._step % 2] if self._lanes else None
        self._step += 1
        last = lane.done if lane is not None else self.program_done
        if last is not None:
            # Planning rewrites plan buffers (and their pinned host staging) and frees a page table that
            # a queued program may still read: with lanes, the program two steps back (long finished
            # in practice); without, the last one.
            self._wait(last)
        failed = self.executor.plan(self.guest, handles, positions, prepare=lane is None)
        self.rows = len(handles) - len(failed)
        self._lane = lane
        return failed

    def queue(self) -> None:
        """The second half of `step`: queue the planned step's program behind its doorbells."""
        lane = self._lane
        if not self.rows:  # every row was dropped: the sender posts nothing this step, so queue nothing
            self.program_done = None
        elif lane is not None:
            self._replay(lane)
        else:
            if self.rows not in self._warm:
                self._warm_up()
            self._enqueue()

    def _wait(self, event: torch.cuda.Event, what: str = "the executor's previous program") -> None:
        if self.wait_timeout_s is None:
            event.synchronize()
            return
        wait_event(event, self.wait_timeout_s, what, RuntimeError)

    def _wait_stream(self, stream: torch.cuda.Stream, what: str) -> None:
        """Wait for what is queued on `stream` -- not for the whole GPU: the host's own model runs
        there too, and a device-wide wait ties this thread to every stream's progress."""
        done = torch.cuda.Event()
        done.record(stream)
        self._wait(done, what)

    def idle(self) -> bool:
        """Every queued program has finished (the host may then release the guest's pages)."""
        events = [ln.done for ln in self._lanes] + [self.program_done]
        return all(e is None or e.query() for e in events)

    def _warm_up(self) -> None:
        """Run this row count's kernels once, ungated, and wait for them. A kernel's first launch may
        load its module, which can wait for the whole GPU to go idle; queued behind a doorbell wait
        that only the sender will ring, that is a deadlock. (What this writes at the planned KV slots
        is overwritten by the real step at the same positions.)"""
        g = self.executor.guests[self.guest]
        assert g.batch is not None
        with torch.cuda.device(self.dev):
            self.exec_in[: self.rows].zero_()
            self._program(g.backend, self.rows, g.batch, gated=False)
            self._wait_stream(torch.cuda.current_stream(self.dev), f"the ungated warm-up for {self.rows} rows")
        self._warm.add(self.rows)

    def _enqueue(self) -> None:
        """The step's program, eager (a backend without CUDA graphs), gated layer by layer."""
        g = self.executor.guests[self.guest]
        assert g.batch is not None
        s = self.stream
        s.wait_stream(torch.cuda.current_stream(self.dev))  # plans and KV loads ran on the current stream
        self._after_loads(s)
        with torch.cuda.device(self.dev), torch.cuda.stream(s):
            self._program(g.backend, self.rows, g.batch, gated=True)
            self.program_done = torch.cuda.Event()
            self.program_done.record(s)

    def _replay(self, lane: _Lane) -> None:
        batch = self.executor.guests[self.guest].batch
        assert batch is not None
        n = self.rows
        rp = padded_size(self.sizes, n)
        assert rp is not None
        s = self.stream
        with torch.cuda.device(self.dev):
            lane.backend.prepare_for_replay(batch, rp)  # re-plans the lane's captured buffers in place
            lane.loc[:n].copy_(batch.out_cache_loc, non_blocking=True)
            lane.loc[n:rp].zero_()
            s.wait_stream(torch.cuda.current_stream(self.dev))
            self._after_loads(s)
            graph = lane.graphs.get(rp)
            if graph is None:
                graph = self._capture(lane, rp, dataclasses.replace(batch, out_cache_loc=lane.loc[:rp]))
            with torch.cuda.stream(s):
                graph.replay()
            lane.done = self.program_done = torch.cuda.Event()
            lane.done.record(s)

    def _capture(self, lane: _Lane, rp: int, static: ForwardBatch) -> torch.cuda.CUDAGraph:
        """Capture the gated program for `rp` rows, after running it once ungated (modules load and JIT
        happens outside the capture and outside any doorbell wait). The wait after it includes the
        other lane's queued program: the sender's already queued step rings it."""
        s = self.stream
        with torch.cuda.stream(s):
            self._program(lane.backend, rp, static, gated=False)
        self._wait_stream(s, f"the ungated run before capturing {rp} rows")
        graph = torch.cuda.CUDAGraph()
        # Not `torch.cuda.graph(...)`: it empties the allocator's cache, and a cudaFree waits for the
        # GPU to go idle (see split_graph.py). Thread-local: this runs on the host's executor thread while
        # the host's own model runs on its forward thread, whose stream syncs a global capture would
        # forbid (the host died with "operation not permitted when stream is capturing").
        with torch.cuda.stream(s):
            graph.capture_begin(pool=lane.mempool, capture_error_mode="thread_local")
            try:
                self._program(lane.backend, rp, static, gated=True)
            finally:
                graph.capture_end()
        lane.graphs[rp] = graph
        return graph

    def _program(self, backend: AttentionBackend, n: int, batch: ForwardBatch, gated: bool) -> None:
        """The executor's step for `n` (padded) rows on the current stream: per layer, wait for the
        sender's q|k|v, attend, push o back and signal; the doorbells are lowered once, after the last
        layer's wait."""
        sh = self.shape
        hq, hkv, d = sh.hq, sh.hkv, sh.d
        s = self.stream
        qkv = self.exec_in[:n]
        q = qkv[:, : hq * d].view(n, hq, d)
        k = qkv[:, hq * d : (hq + hkv) * d].view(n, hkv, d)
        v = qkv[:, (hq + hkv) * d :].view(n, hkv, d)
        out = self.exec_out[:n]
        nbytes = out.numel() * out.element_size()
        last = sh.layers - 1
        for layer in range(sh.layers):
            if gated:
                self.doorbell.wait(s, layer, 1)
                if layer == last:
                    # The step's one reset (transport/gated.py): every doorbell of the step has rung, and
                    # the sender rings the next step's only after done[last], raised below.
                    self.doorbell.fill(s, 0)
            out.copy_(backend.forward(q, k, v, layer, batch).reshape(n, hq * d))
            if gated:
                cs.peer_copy(self.recv_ptr, out.data_ptr(), nbytes, s)
                self.done.write(s, layer, 1)
