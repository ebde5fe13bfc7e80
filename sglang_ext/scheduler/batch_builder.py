"""Turns the scheduler's choice (requests + how many new tokens each) into a ForwardBatch."""

from __future__ import annotations

from typing import NamedTuple

import torch

from sglang_ext.engine.forward_batch import ForwardBatch, ForwardMode
from sglang_ext.scheduler.request import Req


class Entry(NamedTuple):
    req: Req
    extend: int  # new tokens this forward, from req.kv_len
    logprob_positions: list[int]  # positions whose logits give prompt logprobs
    sample: bool  # this forward reaches the end of fill_ids: sample from its last position


def build_batch(entries: list[Entry], mode: ForwardMode, page_size: int, device: torch.device) -> ForwardBatch:
    ids: list[int] = []
    pos: list[int] = []
    loc: list[int] = []
    seq_lens: list[int] = []
    indptr = [0]
    indices: list[int] = []
    last_len: list[int] = []
    logit_rows: list[int] = []
    for e in entries:
        r = e.req
        start, end = r.kv_len, r.kv_len + e.extend
        fill = r.fill_ids
        row0 = len(ids)
        ids.extend(fill[start:end])
        pos.extend(range(start, end))
        loc.extend(r.pages[p // page_size] * page_size + p % page_size for p in range(start, end))
        n_pages = -(-end // page_size)
        indices.extend(r.pages[:n_pages])
        indptr.append(len(indices))
        seq_lens.append(end)
        last_len.append(end - (n_pages - 1) * page_size)
        logit_rows.extend(row0 + p - start for p in e.logprob_positions)
        if e.sample:
            logit_rows.append(row0 + end - 1 - start)

    def t(x: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(x, dtype=dtype).to(device, non_blocking=True)

    return ForwardBatch(
        mode=mode,
        batch_size=len(entries),
        input_ids=t(ids, torch.long),
        positions=t(pos, torch.long),
        out_cache_loc=t(loc, torch.long),
        seq_lens=t(seq_lens, torch.int32),
        extend_lens=[e.extend for e in entries],
        prefix_lens=[e.req.kv_len for e in entries],
        kv_page_indptr=t(indptr, torch.int32),
        kv_page_indices=t(indices, torch.int32),
        kv_last_page_len=t(last_len, torch.int32),
        logits_indices=t(logit_rows, torch.long),
        seq_lens_cpu=seq_lens,
    )
