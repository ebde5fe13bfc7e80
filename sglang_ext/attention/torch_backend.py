"""Exact attention in plain PyTorch over the paged pool: the reference backend (CPU and GPU).

Prefill runs one request at a time (ragged lengths); decode gathers every request's KV into a
padded [B, S] block and runs one masked softmax. Math is in float32 whatever the KV dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_ext.attention.base import AttentionBackend
from sglang_ext.engine.forward_batch import ForwardBatch

_PAD_LIMIT = 1 << 24  # score elements (B x L x S x heads) below which prefill is batched with padding


@dataclass
class _TorchMeta:
    page_idx: torch.Tensor  # [B, S] page of each KV position (padded with page 0)
    offset: torch.Tensor  # [B, S]
    valid: torch.Tensor  # [B, S] bool
    q_starts: list[int]
    # Prefill of many short requests: one padded attention instead of a loop (None: loop).
    padded_q: torch.Tensor | None = None  # [B, L] row of each padded query in q (-1 = pad)
    padded_mask: torch.Tensor | None = None  # [B, L, S]


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
        meta = _TorchMeta(page_idx, offset, valid, q_starts)
        ext = batch.extend_lens
        if not batch.mode.is_decode and b > 1 and b * max(ext) * max_s * self.num_q_heads <= _PAD_LIMIT:
            l_ = max(ext)
            j = torch.arange(l_, device=dev)
            e_t = torch.tensor(ext, device=dev)
            rows = torch.tensor(q_starts, device=dev).unsqueeze(1) + j
            meta.padded_q = torch.where(j < e_t.unsqueeze(1), rows, -1)
            # query j of request i sits at position seq_i - ext_i + j and sees keys up to it
            qpos = (torch.tensor(seq, device=dev) - e_t).unsqueeze(1) + j  # [B, L]
            meta.padded_mask = (pos.view(1, 1, -1) <= qpos.unsqueeze(2)) & valid.unsqueeze(1)
        batch.attn_meta = meta

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        self.pool.write(layer_id, batch.out_cache_loc, k, v)
        meta: _TorchMeta = batch.attn_meta
        kc = self.pool.k_view(layer_id)[meta.page_idx, meta.offset]  # [B, S, Hkv, D]
        vc = self.pool.v_view(layer_id)[meta.page_idx, meta.offset]
        if batch.mode.is_decode:
            return self._attend(q.unsqueeze(1), kc, vc, meta.valid.unsqueeze(1)).squeeze(1).to(q.dtype)
        if meta.padded_q is not None:
            return self._attend_padded(q, kc, vc, meta)
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

    def _attend_padded(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: _TorchMeta) -> torch.Tensor:
        assert meta.padded_q is not None and meta.padded_mask is not None
        real = meta.padded_q >= 0
        qp = q[meta.padded_q.clamp(min=0)]  # [B, L, Hq, D]
        o = self._attend(qp, kc, vc, meta.padded_mask & real.unsqueeze(2) | ~real.unsqueeze(2))
        out = torch.empty_like(q)
        out[meta.padded_q[real]] = o[real].to(q.dtype)
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
