"""The tensors one model forward needs, built by the scheduler and read by the model and attention.

KV addressing is FlashInfer's paged layout, so GPU backends take it as is:

    request i's pages   = kv_page_indices[kv_page_indptr[i] : kv_page_indptr[i+1]]
    its KV length       = seq_lens[i]  (prefix + tokens written by this forward)
    new token j's slot  = out_cache_loc[j] = page * page_size + offset
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from sglang_ext.attention.base import AttentionBackend


class ForwardMode(enum.IntEnum):
    EXTEND = 1  # prefill chunks (possibly on top of a cached prefix)
    DECODE = 2  # one new token per request

    @property
    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


@dataclass
class ForwardBatch:
    mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [T] int64, new tokens of all requests, request-major
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64 slot of each new token
    seq_lens: torch.Tensor  # [B] int32, KV length after this forward (device)
    extend_lens: list[int]  # new tokens per request (1 for decode)
    prefix_lens: list[int]  # KV already present per request
    kv_page_indptr: torch.Tensor  # [B+1] int32
    kv_page_indices: torch.Tensor  # [sum pages] int32
    kv_last_page_len: torch.Tensor  # [B] int32
    logits_indices: torch.Tensor  # [N] rows of the hidden states that need logits
    attn_backend: AttentionBackend | None = None
    # Rows (request indices) whose attention runs elsewhere; empty until remote attention exists.
    remote_rows: list[int] = field(default_factory=list)
    attn_meta: Any = None  # backend-private planning state
    seq_lens_cpu: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
