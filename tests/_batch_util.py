"""Hand-built forward batches for model-level tests, without a scheduler.

`PagedSeqs` plays the scheduler's part: it gives each sequence pool pages (in a scrambled order,
so attention must really follow the page table) and turns new tokens into a `ForwardBatch`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from sglang_ext.attention.torch_backend import TorchAttentionBackend
from sglang_ext.forward_batch import BatchRow, ForwardBatch, ForwardMode
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
        rows = []
        for seq, toks in zip(seqs, new_tokens, strict=True):
            self._reserve(seq, seq.length + len(toks))
            offsets = range(len(toks)) if all_logits else [len(toks) - 1]
            rows.append(BatchRow(seq.length, toks, list(seq.pages), offsets))
        batch = ForwardBatch.build(rows, mode, self.page_size, "cpu")
        for seq, toks in zip(seqs, new_tokens, strict=True):
            seq.length += len(toks)
        return batch


@torch.no_grad()
def run_logits(
    model: DecoderForCausalLM, backend: TorchAttentionBackend, batch: ForwardBatch
) -> torch.Tensor:
    """Float32 logits of `batch.logits_indices` rows."""
    dev = backend.pool.device
    for name in ("input_ids", "positions", "out_cache_loc", "kv_indices", "logits_indices"):
        setattr(batch, name, getattr(batch, name).to(dev))
    backend.prepare(batch)
    batch.attn_backend = backend
    return model.compute_logits(model(batch))
