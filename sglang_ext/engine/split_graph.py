"""Decode CUDA graphs for batches split between local rows and an attention executor.

Adrenaline's 2-D graphs: one graph per (local rows, remote rows) pair, both padded to a captured
size, captured on first use (a pair costs one capture, then replays). In the graph the tokens are
ordered [local rows | remote rows]; the remote side is the transport's stream operations (peer
copies, doorbell and completion flags), which graphs capture as nodes, so only transports that work
without the host on the per-layer path can be captured (`RemoteAttentionRows.graph_capturable`). The
executor's own per-step program is queued by `begin_step` before the replay, for the real rows;
padded remote rows carry garbage that nobody reads.

    static tokens  | local 0..nl-1 | pad .. lp-1 | remote lp..lp+nr-1 | pad .. lp+rp-1 |
    outputs        hidden[order[i]] for each original token i (order = where each token went)
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Final

import torch

from sglang_ext.engine import sm_partition
from sglang_ext.engine.cuda_graph import padded_size
from sglang_ext.forward_batch import ForwardBatch, ForwardMode, SplitPlan

if TYPE_CHECKING:
    from sglang_ext.engine.cuda_graph import CudaGraphRunner
    from sglang_ext.engine.split_attention import SplitAttention

logger = logging.getLogger(__name__)
REMOTE_SIZES: Final = (4, 8, 16, 32, 64, 96, 128, 160, 192, 224, 256)


class SplitGraphs:
    def __init__(self, runner: CudaGraphRunner, split: SplitAttention) -> None:
        self.r = runner
        self.split = split
        self.remote_sizes = [s for s in REMOTE_SIZES if s <= runner.max_bs] or [runner.max_bs]
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._capture_stream: torch.cuda.Stream | None = None

    def can_run(self, batch: ForwardBatch) -> bool:
        assert batch.split is not None
        return len(batch.split.remote_handles) <= self.remote_sizes[-1]

    def _static_batch(self, lp: int, rp: int) -> ForwardBatch:
        r = self.r
        dev = r.device
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=r.input_ids[: lp + rp], positions=r.positions[: lp + rp],
            out_cache_loc=r.out_cache_loc[:lp], logits_indices=r.rows[: lp + rp],
            extend_lens=[1] * lp, seq_lens=[1] * lp, page_table=[[0]] * lp,
            kv_indptr=torch.arange(lp + 1, dtype=torch.int32), kv_last_page_len=torch.ones(lp, dtype=torch.int32),
            kv_indices=torch.zeros(lp, dtype=torch.int32, device=dev), attn_backend=self.split,
            split=SplitPlan(r.rows[:lp], r.rows[lp : lp + rp], [0] * rp, [0] * rp),
            row_mask=None if r.row_mask is None else r.row_mask[: lp + rp],
        )

    @torch.inference_mode()
    def _capture(self, lp: int, rp: int) -> None:
        t0 = time.perf_counter()
        batch = self._static_batch(lp, rp)
        if lp:
            self.r.attn.prepare_for_capture(batch)
        stream = self._stream()
        stream.wait_stream(torch.cuda.current_stream(self.r.device))
        # No eager warm-up of the model: it would need the executor to answer; the kernels were warmed
        # by the local-only graphs, and a capture runs nothing. (cuBLAS is set up by _stream.)
        graph = torch.cuda.CUDAGraph()
        # Not `torch.cuda.graph(...)`: it empties the allocator's cache first, and a cudaFree on the
        # executor's GPU waits for that GPU to go idle -- while its step program waits on doorbells
        # that only this graph's replay will ring (a deadlock, seen on two H200s). Thread-local: the
        # offload threads (the watchdog, the transport's control) keep making CUDA calls meanwhile.
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=self.r.pool, capture_error_mode="thread_local")
            try:
                out = self.r.model(batch)
            finally:
                graph.capture_end()
        torch.cuda.current_stream(self.r.device).wait_stream(stream)
        self.graphs[lp, rp], self.outputs[lp, rp] = graph, out
        logger.info("captured the split decode graph for %d local + %d remote rows in %.2f s",
                    lp, rp, time.perf_counter() - t0)

    def _stream(self) -> torch.cuda.Stream:
        """The capture stream, with cuBLAS ready on it for this thread. The first capture may be this
        thread's first cuBLAS use (a PD decode worker whose first request arrives already remote runs
        no eager forward before it): cuBLAS would create its handle and workspace inside the capture,
        which fails (CUBLAS_STATUS_NOT_INITIALIZED, seen on two H200s). A tiny matmul does it first."""
        if self._capture_stream is None:
            dev = self.r.device
            self._capture_stream = sm_partition.stream_for(dev) or torch.cuda.Stream(dev)
            with torch.cuda.stream(self._capture_stream):
                a = torch.zeros(8, 8, dtype=next(self.r.model.parameters()).dtype, device=dev)
                torch.mm(a, a)
            self._capture_stream.synchronize()
        return self._capture_stream

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        sp = batch.split
        assert sp is not None
        r = self.r
        nl, nr = batch.batch_size, len(sp.remote_handles)
        lp = (padded_size(r.sizes, nl) or 0) if nl else 0
        rp = padded_size(self.remote_sizes, nr)
        assert rp is not None
        if (lp, rp) not in self.graphs:
            self._capture(lp, rp)
        lt, rt = sp.local_tokens, sp.remote_tokens
        r.input_ids[: lp + rp].zero_()
        r.positions[: lp + rp].zero_()
        r.input_ids[:nl].copy_(batch.input_ids[lt])
        r.positions[:nl].copy_(batch.positions[lt])
        r.input_ids[lp : lp + nr].copy_(batch.input_ids[rt])
        r.positions[lp : lp + nr].copy_(batch.positions[rt])
        if lp:
            r.out_cache_loc[:lp].zero_()
            r.out_cache_loc[:nl].copy_(batch.out_cache_loc)
            r.attn.prepare_for_replay(batch, lp)
        r.mark_real(((0, nl), (lp, lp + nr)), lp + rp)
        self.graphs[lp, rp].replay()
        order = torch.empty(nl + nr, dtype=torch.int64, device=r.device)
        order[lt] = r.rows[:nl]
        order[rt] = r.rows[lp : lp + nr]
        return self.outputs[lp, rp][order[batch.logits_indices]]
