"""Hand-built forward batches for model-level tests, without a scheduler.

`PagedSeqs` plays the scheduler's part: it gives each sequence pool pages (in a scrambled order,
so attention must really follow the page table) and turns new tokens into a `ForwardBatch`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from sglang_ext.attention.torch_backend import TorchAttentionBackend
from sglang_ext.engine.forward_batch import ForwardBatch, ForwardMode
from sglang_ext.kvcache.pool import KVGeometry, KVPool
from sglang_ext.models.config import ModelConfig
from sglang_ext.models.decoder import DecoderForCausalLM


def make_pool_and_backend(
    cfg: ModelConfig,
    num_pages: int = 64,
    page_size: int = 4,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> tuple[KVPool, TorchAttentionBackend]:
    geo = KVGeometry(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, page_size, dtype)
    pool = KVPool(geo, num_pages, device)
    return pool, TorchAttentionBackend(pool, cfg.num_heads, cfg.head_dim, cfg.head_dim**-0.5)


@dataclass
class Seq:
    pages: list[int] = field(default_factory=list)
    length: int = 0  # tokens already in the KV cache


class PagedSeqs:
    def __init__(self, pool: KVPool, seed: int = 0) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self._free = list(range(1, pool.num_pages))  # page 0 is reserved
        random.Random(seed).shuffle(self._free)

    def new_seq(self) -> Seq:
        return Seq()

    def _reserve(self, seq: Seq, total: int) -> None:
        while len(seq.pages) * self.page_size < total:
            if not self._free:
                raise RuntimeError("test KV pool is too small")
            seq.pages.append(self._free.pop())

    def batch(
        self, mode: ForwardMode, seqs: list[Seq], new_tokens: list[list[int]], all_logits: bool = False
    ) -> ForwardBatch:
        """Batch appending `new_tokens[i]` to `seqs[i]`; advances each `seq.length`.

        Logits are produced for every new row (`all_logits`) or for each sequence's last row.
        """
        assert len(seqs) == len(new_tokens) and all(new_tokens)
        if mode.is_decode:
            assert all(len(t) == 1 for t in new_tokens), "decode appends exactly one token"
        ps = self.page_size
        ids: list[int] = []
        pos: list[int] = []
        locs: list[int] = []
        seq_lens: list[int] = []
        indptr = [0]
        indices: list[int] = []
        last_page_len: list[int] = []
        logit_rows: list[int] = []
        for seq, toks in zip(seqs, new_tokens, strict=True):
            start, end = seq.length, seq.length + len(toks)
            self._reserve(seq, end)
            for p in range(start, end):
                locs.append(seq.pages[p // ps] * ps + p % ps)
            pos.extend(range(start, end))
            rows = range(len(ids), len(ids) + len(toks))
            logit_rows.extend(rows if all_logits else [rows[-1]])
            ids.extend(toks)
            n_pages = -(-end // ps)
            indices.extend(seq.pages[:n_pages])
            indptr.append(len(indices))
            last_page_len.append(end - (n_pages - 1) * ps)
            seq_lens.append(end)
        batch = ForwardBatch(
            mode=mode,
            batch_size=len(seqs),
            input_ids=_t(ids, torch.int64),
            positions=_t(pos, torch.int64),
            out_cache_loc=_t(locs, torch.int64),
            seq_lens=_t(seq_lens, torch.int32),
            extend_lens=[len(t) for t in new_tokens],
            prefix_lens=[s.length for s in seqs],
            kv_page_indptr=_t(indptr, torch.int32),
            kv_page_indices=_t(indices, torch.int32),
            kv_last_page_len=_t(last_page_len, torch.int32),
            logits_indices=_t(logit_rows, torch.int64),
            seq_lens_cpu=seq_lens,
        )
        for seq, toks in zip(seqs, new_tokens, strict=True):
            seq.length += len(toks)
        return batch


def _t(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


@torch.no_grad()
def run_logits(
    model: DecoderForCausalLM, backend: TorchAttentionBackend, batch: ForwardBatch
) -> torch.Tensor:
    """Float32 logits of `batch.logits_indices` rows."""
    dev = backend.pool.device
    for name in ("input_ids", "positions", "out_cache_loc", "seq_lens", "logits_indices"):
        setattr(batch, name, getattr(batch, name).to(dev))
    backend.prepare(batch)
    batch.attn_backend = backend
    return model.compute_logits(model(batch))
