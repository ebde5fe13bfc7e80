"""Exact attention in plain PyTorch over the paged pool: the reference backend (CPU and GPU).

Prefill runs one request at a time (ragged lengths); decode gathers every request's KV into a
padded [B, S] block and runs one masked softmax. Math is in float32 whatever the KV dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_ext.attention.base import AttentionBackend
from sglang_ext.engine.forward_batch import ForwardBatch


@dataclass
class _TorchMeta:
    page_idx: torch.Tensor  # [B, S] page of each KV position (padded with page 0)
    offset: torch.Tensor  # [B, S]
    valid: torch.Tensor  # [B, S] bool
    q_starts: list[int]


class TorchAttentionBackend(AttentionBackend):
    def prepare(self, batch: ForwardBatch) -> None:
        ps = self.pool.page_size
        dev = self.pool.device
        b = batch.batch_size
        seq = batch.seq_lens_cpu
        max_s = max(seq) if seq else 0
        indptr = batch.kv_page_indptr.tolist()
        pages = batch.kv_page_indices.to(dev, torch.int64)
        pos = torch.arange(max_s, device=dev)
        page_idx = torch.zeros((b, max_s), dtype=torch.int64, device=dev)
        for i in range(b):
            n = seq[i]
            row_pages = pages[indptr[i] : indptr[i + 1]]
            page_idx[i, :n] = row_pages[pos[:n] // ps]
        offset = (pos % ps).expand(b, max_s)
        valid = pos.unsqueeze(0) < torch.tensor(seq, device=dev).unsqueeze(1)
        q_starts, acc = [], 0
        for e in batch.extend_lens:
            q_starts.append(acc)
            acc += e
        batch.attn_meta = _TorchMeta(page_idx, offset, valid, q_starts)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        self.pool.write(layer_id, batch.out_cache_loc, k, v)
        meta: _TorchMeta = batch.attn_meta
        kc = self.pool.k_view(layer_id)[meta.page_idx, meta.offset]  # [B, S, Hkv, D]
        vc = self.pool.v_view(layer_id)[meta.page_idx, meta.offset]
        if batch.mode.is_decode:
            return self._attend(q.unsqueeze(1), kc, vc, meta.valid.unsqueeze(1)).squeeze(1).to(q.dtype)
        out = torch.empty_like(q)
        for i, e in enumerate(batch.extend_lens):
            s = batch.seq_lens_cpu[i]
            qs = meta.q_starts[i]
            # Query j sits at absolute position s - e + j and sees keys 0 .. s - e + j.
            qpos = torch.arange(s - e, s, device=q.device).unsqueeze(1)
            kpos = torch.arange(s, device=q.device).unsqueeze(0)
            mask = (kpos <= qpos).unsqueeze(0)  # [1, e, s]
            o = self._attend(q[qs : qs + e].unsqueeze(0), kc[i : i + 1, :s], vc[i : i + 1, :s], mask)
            out[qs : qs + e] = o.squeeze(0).to(q.dtype)
        return out

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """q [B, L, Hq, D], k/v [B, S, Hkv, D], mask [B, L, S] -> [B, L, Hq, D] (float32)."""
        b, l_, hq, d = q.shape
        hkv = k.shape[2]
        g = hq // hkv
        qf = q.float().reshape(b, l_, hkv, g, d)
        scores = torch.einsum("blhgd,bshd->bhgls", qf, k.float()) * self.scale
        scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("bhgls,bshd->blhgd", probs, v.float())
        return o.reshape(b, l_, hq, d)
