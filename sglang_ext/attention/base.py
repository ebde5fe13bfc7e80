"""Attention backend interface.

A backend owns no KV memory: it reads and writes the worker's `KVPool` through per-layer views.
`prepare` plans once per forward (not per layer); `forward` is called once per layer.
CUDA-graph hooks let a backend keep its metadata in fixed buffers that are updated in place
before a graph replay.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglang_ext.forward_batch import ForwardBatch
    from sglang_ext.kvcache.pool import KVPool


class AttentionBackend(ABC):
    def __init__(self, pool: KVPool, num_q_heads: int, head_dim: int, scale: float) -> None:
        self.pool = pool
        self.num_q_heads = num_q_heads
        self.head_dim = head_dim
        self.scale = scale

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None:
        """Plan the whole forward (index math, kernel plans) from the batch's host-side layout;
        stores the plan in `batch.attn_meta`. Must not read device tensors back (no sync)."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        """Write k, v ([T, Hkv, D]) at `batch.out_cache_loc`, return attention of q ([T, Hq, D])."""

    # ---- CUDA graphs (decode only). Backends without graph support keep the defaults. ----------
    def supports_cuda_graph(self) -> bool:
        return False

    def init_cuda_graph_state(self, max_bs: int, max_pages: int) -> None:
        raise RuntimeError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_for_capture(self, batch: ForwardBatch) -> None:
        raise RuntimeError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_for_replay(self, batch: ForwardBatch, padded_bs: int) -> None:
        raise RuntimeError(f"{type(self).__name__} does not support CUDA graphs")
