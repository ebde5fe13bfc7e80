"""CUDA graphs for decode forwards, one per captured batch size.

A DECODE batch of `bs` rows replays the graph of the smallest captured size >= bs. Its inputs
are copied into static buffers first; padding rows get token 0 at position 0, write their KV to
the reserved page 0 and attend to one token there, and their outputs are dropped. An MoE model's
graphs also read `row_mask` (False on padding rows), so padding is routed to no expert: at 12 rows
in the graph of 16, its top-k would otherwise read experts that no real row needs. The graph
covers embedding -> all layers -> final norm; the LM head runs after it on the rows that need
logits (it is one GEMM, and keeping it out saves a [bs, vocab] buffer per graph).

    static buffers (max_bs rows)      graph(bs)                     after replay
    input_ids / positions / loc  -->  model(batch_bs) -> hidden  -->  lm_head(hidden[logits_indices])
    attention: backend.prepare_for_replay re-plans into its fixed index buffers
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Final

import torch

from sglang_ext.engine import sm_partition
from sglang_ext.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

    from sglang_ext.attention.base import AttentionBackend
    from sglang_ext.engine.split_graph import SplitGraphs
    from sglang_ext.models.decoder import DecoderForCausalLM

logger = logging.getLogger(__name__)

DEFAULT_MAX_BS: Final = 256


def capture_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 to 64, every 16 to 256, every 32 beyond (as fine as padding warrants)."""
    sizes = [1, 2, 4, *range(8, 65, 8), *range(80, 257, 16), *range(288, max_bs + 1, 32)]
    return sorted({s for s in sizes if s <= max_bs} | {max_bs})


def padded_size(sizes: list[int], bs: int) -> int | None:
    for s in sizes:
        if s >= bs:
            return s
    return None


class CudaGraphRunner:
    def __init__(
        self, model: DecoderForCausalLM, attn: AttentionBackend, device: torch.device,
        max_bs: int, max_pages_per_req: int,
    ) -> None:
        self.model = model
        self.attn = attn
        self.device = device
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        n = self.max_bs
        # twice the rows: split graphs hold up to max_bs local rows plus up to max_bs remote rows
        self.input_ids = torch.zeros(2 * n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(2 * n, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=device)  # slot 0 of page 0
        self.rows = torch.arange(2 * n, dtype=torch.int64, device=device)
        # only an MoE reads it (the routed experts skip padding rows); dense graphs leave it out
        self.row_mask = torch.ones(2 * n, dtype=torch.bool, device=device) if model.cfg.moe is not None else None
        self.split: SplitGraphs | None = None
        attn.init_cuda_graph_state(n, n * max_pages_per_req)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.batches: dict[int, ForwardBatch] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool: _POOL_HANDLE | None = None
        self.capture()

    def _static_batch(self, bs: int) -> ForwardBatch:
        """The graph's inputs: the static buffers; every row attends to one token in page 0."""
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs], logits_indices=self.rows[:bs],
            extend_lens=[1] * bs, seq_lens=[1] * bs, page_table=[[0]] * bs,
            kv_indptr=torch.arange(bs + 1, dtype=torch.int32), kv_last_page_len=torch.ones(bs, dtype=torch.int32),
            kv_indices=torch.zeros(bs, dtype=torch.int32, device=self.device), attn_backend=self.attn,
            row_mask=None if self.row_mask is None else self.row_mask[:bs],
        )

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        self.pool = torch.cuda.graph_pool_handle()
        # In an SM partition the graphs are captured on the model's stream there, so that they replay in it.
        stream = sm_partition.stream_for(self.device) or torch.cuda.Stream(self.device)
        for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its pool memory
            batch = self._static_batch(bs)
            self.attn.prepare_for_capture(batch)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up: Triton/FlashInfer JIT, cuBLAS handles
                    self.model(batch)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                out = self.model(batch)
            self.graphs[bs], self.batches[bs], self.outputs[bs] = graph, batch, out
        torch.cuda.synchronize(self.device)
        logger.info("captured %d decode CUDA graphs (bs %d..%d) in %.1f s",
                    len(self.sizes), self.sizes[0], self.max_bs, time.perf_counter() - t0)

    def can_run(self, batch: ForwardBatch) -> bool:
        if not batch.mode.is_decode or batch.batch_size > self.max_bs:
            return False
        return batch.split is None or (self.split is not None and self.split.can_run(batch))

    def mark_real(self, spans: tuple[tuple[int, int], ...], rows: int) -> None:
        """Set `row_mask[:rows]` True on the [start, end) spans of real rows and False elsewhere."""
        if self.row_mask is None:
            return
        if len(spans) == 1 and spans[0][0] == 0:  # the plain graphs' case: one launch a step
            torch.lt(self.rows[:rows], spans[0][1], out=self.row_mask[:rows])
            return
        self.row_mask[:rows].fill_(False)
        for start, end in spans:
            self.row_mask[start:end].fill_(True)

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states (final-normed) of `batch.logits_indices`, like `model(batch)`."""
        if batch.split is not None:
            assert self.split is not None
            return self.split.replay(batch)
        bs = batch.batch_size
        pbs = padded_size(self.sizes, bs)
        assert pbs is not None
        self.input_ids[:bs].copy_(batch.input_ids, non_blocking=True)
        self.positions[:bs].copy_(batch.positions, non_blocking=True)
        self.out_cache_loc[:bs].copy_(batch.out_cache_loc, non_blocking=True)
        if pbs > bs:
            self.input_ids[bs:pbs].zero_()
            self.positions[bs:pbs].zero_()
            self.out_cache_loc[bs:pbs].zero_()
        self.mark_real(((0, bs),), pbs)
        self.attn.prepare_for_replay(batch, pbs)
        self.graphs[pbs].replay()
        return self.outputs[pbs][batch.logits_indices]
