"""Exact attention in plain PyTorch over the paged pool: the reference backend (CPU and GPU).

Each request's KV pages are gathered with whole-page copies (into reused buffers) into a padded
[B, S] block, and torch's fused SDPA runs on it. Requests with one new token (decode rows, also
when they ride along a prefill) share one masked call; prefill requests share one padded causal
call while that stays small, else run one at a time. Math is in float32 whatever the KV dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sglang_ext.attention.base import AttentionBackend
from sglang_ext.forward_batch import AttentionMetadata, ForwardBatch
from sglang_ext.kvcache.pool import KVPool

_PAD_LIMIT = 1 << 24  # score elements (B x L x S x heads) below which prefills are batched with padding


@dataclass
class _Group:
    """Requests attended together: their page tables and the KV positions each may see."""

    pages: torch.Tensor  # [G, max_pages] page ids, padded with page 0
    valid: torch.Tensor  # [G, max_pages * page_size] bool

    def gather(self, view: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
        """[G, S, Hkv, D] from a per-layer [pages, P, Hkv, D] view: whole-page copies, not per token,
        into a reused buffer (a fresh multi-MB tensor per layer costs more in page faults than the copy)."""
        g, n = self.pages.shape
        out = scratch[: g * n * view[0].numel()].view(g * n, *view.shape[1:])
        torch.index_select(view, 0, self.pages.reshape(-1), out=out)
        return out.view(g, n * view.shape[1], *view.shape[2:])


@dataclass
class _TorchMeta(AttentionMetadata):
    single: _Group | None  # requests with one new token (decode rows)
    single_rows: torch.Tensor  # their rows in q
    multi: list[int]  # requests with several new tokens
    multi_group: _Group | None
    q_starts: list[int]
    # Batched prefill (None: one request at a time): rows of q per padded query (-1 = pad), and mask.
    padded_q: torch.Tensor | None = None  # [M, L]
    padded_mask: torch.Tensor | None = None  # [M, L, S]


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, pool: KVPool, num_q_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(pool, num_q_heads, head_dim, scale)
        self._scratch: dict[str, torch.Tensor] = {}

    def _buf(self, name: str, group: _Group) -> torch.Tensor:
        """A reusable flat buffer big enough for one gather of `group` (grows, never shrinks)."""
        pool = self.pool.data
        need = group.pages.numel() * pool[0, 0, 0].numel()
        buf = self._scratch.get(name)
        if buf is None or buf.numel() < need:
            buf = self._scratch[name] = torch.empty(need, dtype=pool.dtype, device=pool.device)
        return buf

    def _gather(self, group: _Group, layer: int, tag: str) -> tuple[torch.Tensor, torch.Tensor]:
        k = group.gather(self.pool.k_view(layer), self._buf("k" + tag, group))
        v = group.gather(self.pool.v_view(layer), self._buf("v" + tag, group))
        return k, v

    def _group(self, idx: list[int], batch: ForwardBatch) -> _Group:
        dev = self.pool.device
        n = max(len(batch.page_table[i]) for i in idx)
        table = [list(batch.page_table[i]) + [0] * (n - len(batch.page_table[i])) for i in idx]
        pos = torch.arange(n * self.pool.page_size, device=dev)
        valid = pos.unsqueeze(0) < torch.tensor([batch.seq_lens[i] for i in idx], device=dev).unsqueeze(1)
        return _Group(torch.tensor(table, dtype=torch.long, device=dev), valid)

    def prepare(self, batch: ForwardBatch) -> None:
        dev = self.pool.device
        b = batch.batch_size
        seq = batch.seq_lens
        ext = batch.extend_lens
        q_starts, acc = [], 0
        for e in ext:
            q_starts.append(acc)
            acc += e
        single = [i for i in range(b) if ext[i] == 1]
        multi = [i for i in range(b) if ext[i] > 1]
        meta = _TorchMeta(
            self._group(single, batch) if single else None,
            torch.tensor([q_starts[i] for i in single], dtype=torch.long, device=dev),
            multi,
            self._group(multi, batch) if multi else None,
            q_starts,
        )
        if len(multi) > 1:
            assert meta.multi_group is not None
            l_ = max(ext[i] for i in multi)
            max_s = meta.multi_group.valid.shape[1]
            if len(multi) * l_ * max_s * self.num_q_heads <= _PAD_LIMIT:
                j = torch.arange(l_, device=dev)
                e_t = torch.tensor([ext[i] for i in multi], device=dev).unsqueeze(1)
                rows = torch.tensor([q_starts[i] for i in multi], device=dev).unsqueeze(1) + j
                real = j < e_t
                meta.padded_q = torch.where(real, rows, -1)
                # query j of request i sits at position seq_i - ext_i + j and sees keys up to it
                qpos = torch.tensor([seq[i] for i in multi], device=dev).unsqueeze(1) - e_t + j  # [M, L]
                kpos = torch.arange(max_s, device=dev).view(1, 1, -1)
                mask = (kpos <= qpos.unsqueeze(2)) & meta.multi_group.valid.unsqueeze(1)
                meta.padded_mask = mask | ~real.unsqueeze(2)  # pad rows see everything (no NaN)
        batch.attn_meta = meta

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        self.pool.write(layer_id, batch.out_cache_loc, k, v)
        meta = batch.attn_meta
        assert isinstance(meta, _TorchMeta)
        if meta.single is not None:
            g = meta.single
            ks, vs = self._gather(g, layer_id, "single")
            o = self._attend(q[meta.single_rows].unsqueeze(1), ks, vs, g.valid.unsqueeze(1)).squeeze(1).to(q.dtype)
            if not meta.multi:  # pure decode: rows are already in order
                return o
            out = torch.empty_like(q)
            out[meta.single_rows] = o
        else:
            out = torch.empty_like(q)
        assert meta.multi_group is not None
        kc, vc = self._gather(meta.multi_group, layer_id, "multi")
        if meta.padded_q is not None:
            assert meta.padded_mask is not None
            real = meta.padded_q >= 0
            o = self._attend(q[meta.padded_q.clamp(min=0)], kc, vc, meta.padded_mask)
            out[meta.padded_q[real]] = o[real].to(q.dtype)
            return out
        for gi, i in enumerate(meta.multi):
            e, s, qs = batch.extend_lens[i], batch.seq_lens[i], meta.q_starts[i]
            qpos = torch.arange(s - e, s, device=q.device).unsqueeze(1)
            mask = (torch.arange(s, device=q.device).unsqueeze(0) <= qpos).unsqueeze(0)  # [1, e, s]
            o = self._attend(q[qs : qs + e].unsqueeze(0), kc[gi : gi + 1, :s], vc[gi : gi + 1, :s], mask)
            out[qs : qs + e] = o.squeeze(0).to(q.dtype)
        return out

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [B, L, Hq, D], k/v [B, S, Hkv, D], mask [B, L, S] (True = attend) -> [B, L, Hq, D] float32.

        torch's fused SDPA reads the head-strided views directly (no transposed copies of K/V)."""
        o = F.scaled_dot_product_attention(
            q.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2),
            attn_mask=mask.unsqueeze(1), scale=self.scale, enable_gqa=True,
        )
        return o.transpose(1, 2)
