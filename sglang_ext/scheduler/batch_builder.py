"""Turns the scheduler's choice (requests + how many new tokens each) into a ForwardBatch."""

from __future__ import annotations

from typing import NamedTuple

import torch

from sglang_ext.forward_batch import BatchRow, ForwardBatch, ForwardMode
from sglang_ext.scheduler.request import Req


class Entry(NamedTuple):
    req: Req
    extend: int  # new tokens this forward, from req.kv_len
    logprob_positions: list[int]  # positions whose logits give prompt logprobs
    sample: bool  # this forward reaches the end of fill_ids: sample from its last position

    @classmethod
    def of(cls, r: Req, n: int) -> Entry:
        """`r`'s next `n` tokens, with the prompt positions whose logprobs are still to report."""
        start, end = r.kv_len, r.kv_len + n
        pos: list[int] = []
        if r.return_logprob:
            # Input entry p is the logprob of input_ids[p] given the tokens before: logits at p - 1.
            first = max(r.logprob_start + len(r.input_token_logprobs), 1)
            pos.extend(range(max(first - 1, start), min(len(r.input_ids) - 1, end)))
        sample = end == r.fill_len and not (r.sampling.max_new_tokens == 0 and not r.output_ids)
        return cls(r, n, pos, sample)

    def row(self) -> BatchRow:
        r = self.req
        start = r.kv_len
        offsets = [p - start for p in self.logprob_positions]
        if self.sample:
            offsets.append(self.extend - 1)
        return BatchRow(start, r.token_slice(start, start + self.extend), r.pages, offsets, r.remote)


def build_batch(entries: list[Entry], mode: ForwardMode, page_size: int, device: torch.device) -> ForwardBatch:
    return ForwardBatch.build([e.row() for e in entries], mode, page_size, device)
