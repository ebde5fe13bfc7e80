"""`SplitAttention`: a batch's local rows on the worker's own backend, its remote rows on an executor.

    q, k, v ──┬─ remote tokens ─> RemoteAttentionRows.post ·································· collect ─┐
              └─ local tokens ──> local backend (writes KV in the local pool) ── o_local    ├─> o by row

The engine sees the executor only through `RemoteAttentionRows`; offload/remote.py's `RemoteAttention`
(every transport) provides it.
"""

from __future__ import annotations

from typing import Protocol

import torch

from sglang_ext.attention.base import AttentionBackend
from sglang_ext.forward_batch import ForwardBatch


class RemoteAttentionRows(Protocol):
    """The attention of a step's remote rows, computed elsewhere, one layer at a time."""

    # post/collect are stream operations only, so decode CUDA graphs may hold them (split_graph.py)
    graph_capturable: bool

    def post(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Send one layer's q, k, v ([R, H, D]) of the planned rows."""

    def collect(self, layer: int) -> torch.Tensor:
        """That layer's attention output [R, Hq, D], on the sender's device."""


class SplitAttention(AttentionBackend):
    def __init__(self, local: AttentionBackend, remote: RemoteAttentionRows) -> None:
        super().__init__(local.pool, local.num_q_heads, local.head_dim, local.scale)
        self.local = local
        self.remote = remote

    def prepare(self, batch: ForwardBatch) -> None:
        if batch.batch_size:
            self.local.prepare(batch)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        sp = batch.split
        assert sp is not None
        rt = sp.remote_tokens
        self.remote.post(layer_id, q[rt], k[rt], v[rt])
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if batch.batch_size:
            lt = sp.local_tokens
            out.index_copy_(0, lt, self.local.forward(q[lt], k[lt], v[lt], layer_id, batch).to(q.dtype))
        out.index_copy_(0, rt, self.remote.collect(layer_id).to(q.dtype))
        return out
