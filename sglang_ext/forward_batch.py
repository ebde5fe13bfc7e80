"""The tensors one model forward needs, built once per step and read by the model and attention.

KV addressing is FlashInfer's paged layout, so GPU backends take it as is:

    request i's pages   = kv_indices[kv_indptr[i] : kv_indptr[i+1]]
    its KV length       = seq_lens[i]  (prefix + tokens written by this forward)
    new token j's slot  = out_cache_loc[j] = page * page_size + offset

Every piece of layout is computed here, once, on the host (`build`); the per-token tensors go to
the device without a sync. Backends plan from the host copies (`kv_indptr`, `kv_last_page_len`,
`page_table`) and never read device tensors back.

Rows whose KV lives on an attention executor (`BatchRow.remote`, decode only) have no pages here:
the batch's layout then describes its local rows alone, and `split` says which tokens are whose.
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch


class ForwardMode(enum.IntEnum):
    EXTEND = 1  # prefill chunks (possibly on top of a cached prefix)
    DECODE = 2  # one new token per request

    @property
    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


class BatchRow(NamedTuple):
    """What the batch needs of one request: nothing else of the scheduler's state."""

    start: int  # tokens whose KV is already present (the new tokens' first position)
    tokens: Sequence[int]  # ids of the new tokens (with `build(input_ids=...)` only their number counts)
    pages: Sequence[int]  # the request's page table, covering start + len(tokens)
    logit_offsets: Sequence[int] = ()  # offsets within the new tokens whose logits are wanted
    remote: int | None = None  # the executor's handle of a request whose attention runs there


class AttentionMetadata:
    """A backend's plan for one forward (kernel wrappers, gathered page tables); each backend
    subclasses it, and only that backend reads it."""


class Attention(Protocol):
    """What a model layer calls for its attention: any backend, or the split of a batch's local and
    remote rows (the batch sits below both, so it names neither)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor: ...


@dataclass
class SplitPlan:
    """Which tokens attend locally and which remotely (remote rows decode one token each)."""

    local_tokens: torch.Tensor  # [T_local] indices into the batch's tokens (device)
    remote_tokens: torch.Tensor  # [R] (device)
    remote_handles: list[int]  # per remote row, in token order
    remote_positions: list[int]  # the position each remote row writes


@dataclass
class ForwardBatch:
    mode: ForwardMode
    # per new token, request-major (device)
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64
    logits_indices: torch.Tensor  # [N] rows of the hidden states that need logits
    # per request (host)
    extend_lens: list[int]  # new tokens
    seq_lens: list[int]  # KV length after this forward
    page_table: list[Sequence[int]]  # each request's pages, exactly those covering seq_lens
    kv_indptr: torch.Tensor  # [B+1] int32, CPU
    kv_last_page_len: torch.Tensor  # [B] int32, CPU
    kv_indices: torch.Tensor  # [sum pages] int32 (device): the page tables, concatenated
    attn_backend: Attention | None = None
    attn_meta: AttentionMetadata | None = None  # the backend's plan for this forward
    split: SplitPlan | None = None  # set when some rows attend on an executor
    # [T] bool (device): the rows that are real tokens, set by the decode CUDA graphs (False on their
    # padding rows) so that an MoE routes padding to no expert; None: every row is real
    row_mask: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        """Rows attending locally (remote rows are counted in `split`)."""
        return len(self.extend_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(cls, rows: Sequence[BatchRow], mode: ForwardMode, page_size: int,
              device: torch.device | str, input_ids: torch.Tensor | None = None) -> ForwardBatch:
        """`input_ids`: the new tokens' ids already on the device (the overlap loop's, read from its
        token table), in place of the rows' `tokens`."""
        ids: list[int] = []
        pos: list[int] = []
        loc: list[int] = []
        seq_lens: list[int] = []
        table: list[Sequence[int]] = []
        indptr = [0]
        indices: list[int] = []
        last: list[int] = []
        logit_rows: list[int] = []
        ext: list[int] = []
        local_tok: list[int] = []
        remote_tok: list[int] = []
        handles: list[int] = []
        remote_pos: list[int] = []
        for r in rows:
            end = r.start + len(r.tokens)
            row0 = len(ids)
            ids.extend(r.tokens)
            pos.extend(range(r.start, end))
            logit_rows.extend(row0 + o for o in r.logit_offsets)
            if r.remote is not None:
                assert len(r.tokens) == 1, "remote rows decode one token"
                remote_tok.append(row0)
                handles.append(r.remote)
                remote_pos.append(r.start)
                continue
            local_tok.extend(range(row0, row0 + len(r.tokens)))
            _slots(loc, r.pages, r.start, end, page_size)
            n_pages = -(-end // page_size)
            pages = r.pages[:n_pages]
            table.append(pages)
            indices.extend(pages)
            indptr.append(len(indices))
            seq_lens.append(end)
            last.append(end - (n_pages - 1) * page_size)
            ext.append(len(r.tokens))

        def dev(x: list[int], dtype: torch.dtype) -> torch.Tensor:
            return _host_tensor(x, dtype).to(device, non_blocking=True)

        batch = cls(
            mode=mode,
            input_ids=dev(ids, torch.long) if input_ids is None else input_ids,
            positions=dev(pos, torch.long),
            out_cache_loc=dev(loc, torch.long),
            logits_indices=dev(logit_rows, torch.long),
            extend_lens=ext,
            seq_lens=seq_lens,
            page_table=table,
            kv_indptr=_host_tensor(indptr, torch.int32),
            kv_last_page_len=_host_tensor(last, torch.int32),
            kv_indices=dev(indices, torch.int32),
        )
        if remote_tok:
            batch.split = SplitPlan(dev(local_tok, torch.long), dev(remote_tok, torch.long), handles, remote_pos)
        return batch


# array typecodes of the integer dtypes a batch uses: a list goes to a tensor through one C-level copy
_TYPECODES = {torch.long: "q", torch.int32: "i"}


def _host_tensor(x: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of `x`. `torch.tensor` of a Python list converts element by element (~0.6 ms for a
    prefill chunk's 8K positions on the CPU machine); packing into an `array` first is ~4x cheaper, and a
    prefill step runs plain in the overlap loop, so its host time adds to the forward's."""
    if not x:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array(_TYPECODES[dtype], x), dtype=dtype)  # the tensor keeps the array alive


def _slots(out: list[int], pages: Sequence[int], start: int, end: int, page_size: int) -> None:
    """Append the KV slots of positions [start, end) (page * page_size + offset): one `range` a page rather
    than one expression a token (a prefill chunk spans hundreds of pages, a decode row one)."""
    p = start
    while p < end:
        page, off = divmod(p, page_size)
        take = min(page_size - off, end - p)
        base = pages[page] * page_size + off
        out.extend(range(base, base + take))
        p += take
