"""FlashInfer attention over the block-first paged pool (GPU only; imported lazily by name).

    prefill (EXTEND):  new K/V are written into the pool first, then one paged prefill kernel
                       attends each request's queries to its whole KV (cached prefix + new
                       tokens), causal with the diagonal aligned to the end of the KV
    decode (DECODE):   one batch-decode kernel; for GQA groups >= 4 the tensor-core variant
                       (FlashInfer runs its prefill kernel with the group's heads as rows)

Planning happens once per forward in `prepare`; every layer reuses the plan. The per-layer KV is
the pool's strided `layer_view` ([pages, 2, P, Hkv, D], page stride = all layers), which FlashInfer
reads in place. Plans use the batch's host copies of indptr / last-page lengths, so planning
never waits on the GPU.

CUDA graphs: one graph-mode decode wrapper per captured batch size, all sharing fixed index
buffers; `prepare_for_replay` re-plans into those buffers (padding rows point at page 0 with one
token) before the graph runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import flashinfer
import torch

from sglang_ext import ops
from sglang_ext.attention.base import AttentionBackend
from sglang_ext.forward_batch import AttentionMetadata, ForwardBatch
from sglang_ext.kvcache.pool import KVPool

WORKSPACE_BYTES: Final = 256 * 1024 * 1024
# The fa2 kernels serve both prefill and tensor-core decode from one JIT module per head size;
# fa3 ("auto" on Hopper) would be a second, slower-to-build module (not measured here; prefill
# already runs at ~70-75 % of the dense-FLOP roofline, see docs/benchmarks.md).
PREFILL_KERNEL: Final = "fa2"


def pad_layout(batch: ForwardBatch, pad_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch's (indptr, indices, last_page_len) plus `pad_rows` rows of one token in page 0."""
    if not pad_rows:
        return batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len
    n = int(batch.kv_indptr[-1])
    indptr = torch.cat([batch.kv_indptr, torch.arange(n + 1, n + pad_rows + 1, dtype=torch.int32)])
    last = torch.cat([batch.kv_last_page_len, torch.ones(pad_rows, dtype=torch.int32)])
    indices = torch.cat([batch.kv_indices, batch.kv_indices.new_zeros(pad_rows)])
    return indptr, indices, last


@dataclass
class FlashInferMeta(AttentionMetadata):
    wrapper: Any  # a planned BatchPrefill/BatchDecode wrapper; `run(q, kv)` per layer


def default_decode_tensor_cores(num_q_heads: int, num_kv_heads: int) -> bool:
    """Measured on the H200 (Llama-3-8B, group 4): faster at every batch size inside CUDA graphs."""
    return num_q_heads // num_kv_heads >= 4


class FlashInferAttentionBackend(AttentionBackend):
    def __init__(
        self, pool: KVPool, num_q_heads: int, head_dim: int, scale: float,
        decode_tensor_cores: bool | None = None,
    ) -> None:
        super().__init__(pool, num_q_heads, head_dim, scale)
        self.num_kv_heads = pool.geometry.num_kv_heads
        self.dtype = pool.geometry.dtype
        self.decode_tc = (default_decode_tensor_cores(num_q_heads, self.num_kv_heads)
                          if decode_tensor_cores is None else decode_tensor_cores)
        dev = pool.device
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=PREFILL_KERNEL)
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.decode_tc)
        self._graph_wrappers: dict[int, Any] = {}
        self._plan_done: torch.cuda.Event | None = None

    # ---- planning ---------------------------------------------------------------------------------
    def _plan_decode(self, wrapper: Any, indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor) -> None:
        self._wait_previous_plan()
        wrapper.plan(
            indptr, indices, last, self.num_q_heads, self.num_kv_heads, self.head_dim, self.pool.page_size,
            q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale,
        )
        self._mark_plan()

    def _wait_previous_plan(self) -> None:
        # A plan stages its work split in a pinned host buffer and copies it to the GPU
        # asynchronously; with overlap scheduling the CPU may plan step t+1 while step t's copy is
        # still queued, so wait for that copy (not for step t's kernels) before reusing the buffer.
        if self._plan_done is not None:
            self._plan_done.synchronize()

    def _mark_plan(self) -> None:
        if self._plan_done is None:
            self._plan_done = torch.cuda.Event()
        self._plan_done.record()

    def prepare(self, batch: ForwardBatch) -> None:
        if batch.mode.is_decode:
            self._plan_decode(self.decode_wrapper, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len)
            batch.attn_meta = FlashInferMeta(self.decode_wrapper)
            return
        qo = [0]
        for e in batch.extend_lens:
            qo.append(qo[-1] + e)
        self._wait_previous_plan()
        self.prefill_wrapper.plan(
            torch.tensor(qo, dtype=torch.int32), batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len,
            self.num_q_heads, self.num_kv_heads, self.head_dim, self.pool.page_size, causal=True,
            sm_scale=self.scale, q_data_type=self.dtype, kv_data_type=self.dtype,
        )
        self._mark_plan()
        batch.attn_meta = FlashInferMeta(self.prefill_wrapper)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        ops.store_kv(self.pool, layer_id, batch.out_cache_loc, k, v)
        q = q.to(self.dtype)
        if not q.is_contiguous():
            q = q.contiguous()
        meta = batch.attn_meta
        assert isinstance(meta, FlashInferMeta)
        return meta.wrapper.run(q, self.pool.layer_view(layer_id))

    # ---- CUDA graphs (decode) -------------------------------------------------------------------------
    def supports_cuda_graph(self) -> bool:
        return True

    def init_cuda_graph_state(self, max_bs: int, max_pages: int) -> None:
        dev = self.pool.device
        self._g_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
        self._g_indices = torch.zeros(max_pages + max_bs, dtype=torch.int32, device=dev)
        self._g_last = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self._graph_wrappers = {}

    def _graph_wrapper(self, bs: int) -> Any:
        w = self._graph_wrappers.get(bs)
        if w is None:
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.decode_tc,
                paged_kv_indptr_buffer=self._g_indptr[: bs + 1], paged_kv_indices_buffer=self._g_indices,
                paged_kv_last_page_len_buffer=self._g_last[:bs],
            )
            self._graph_wrappers[bs] = w
        return w

    def prepare_for_capture(self, batch: ForwardBatch) -> None:
        """Plan the capture batch's layout (every row: page 0, one token) for its graph."""
        w = self._graph_wrapper(batch.batch_size)
        self._plan_decode(w, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len)
        batch.attn_meta = FlashInferMeta(w)

    def prepare_for_replay(self, batch: ForwardBatch, padded_bs: int) -> None:
        """Re-plan the captured wrapper for `batch` padded to `padded_bs` rows (in-place buffers)."""
        w = self._graph_wrapper(padded_bs)
        self._plan_decode(w, *pad_layout(batch, padded_bs - batch.batch_size))
        batch.attn_meta = FlashInferMeta(w)
