"""The token masks of a step's constrained rows: filled on the host, applied to the logits on the device.

    matchers of the constrained rows ── batch fill (xgrammar, threads) ── int32 bitmask [C, ceil(V/32)]
        ── one copy to the device ── unpack bits ── logits[rows] = -inf where a bit is 0

Only constrained rows are filled, copied and masked; a batch without any skips all of it. The mask
goes on the logits the model returned (outside any CUDA graph), before the sampler and before
logprobs are read, so logprobs of a constrained row are of the masked distribution, as SGLang's.
Ids past the bitmask (logits wider than the vocabulary the grammar knows) are masked too.

`min_new_tokens` bans (EOS and stop ids) are folded into the mask: a constrained row keeps them out
while its grammar allows anything else, and is allowed to end when its grammar allows nothing but
its end (a mask with no token left would leave nothing to sample).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from sglang_ext.grammar.backend import GrammarState
from sglang_ext.sampling.batch import SampleRow

if TYPE_CHECKING:
    import xgrammar as xgr

assert sys.byteorder == "little", "the bitmask is read as bytes: bit k of byte b is token 8 * b + k"


class GrammarMasks:
    def __init__(self, vocab_size: int, device: torch.device | str, threads: int | None = None) -> None:
        self.vocab = vocab_size
        self.words = (vocab_size + 31) // 32
        self.device = torch.device(device)
        self.threads = threads or min(8, max(1, (os.cpu_count() or 2) // 2))  # the fill is parallel per row
        self._batch: xgr.BatchGrammarMatcher | None = None  # on first use
        self._shifts = torch.arange(8, dtype=torch.uint8, device=self.device)

    def constrain(self, logits: torch.Tensor, states: Sequence[GrammarState | None],
                  rows: list[SampleRow]) -> list[SampleRow]:
        """Mask `logits` ([B, V], in place) for the rows with a grammar state; the rows to sample
        with, their bans folded into the masks."""
        live = [(i, s) for i, s in enumerate(states) if s is not None]
        if not live:
            return rows
        idx = [i for i, _ in live]
        mask = self.fill([s for _, s in live])
        rows = list(rows)
        bits = mask.numpy().view(np.uint32)
        for j, i in enumerate(idx):
            if rows[i].banned:
                _ban(bits[j], rows[i].banned)
                rows[i] = rows[i]._replace(banned=())
        # pinned like the mask: a copy from pageable memory may wait for the stream
        rows_t = (None if len(idx) == logits.shape[0]
                  else torch.tensor(idx, dtype=torch.int64, pin_memory=self.device.type == "cuda"))
        if self.device.type == "cuda":
            dev = mask.to(self.device, non_blocking=True)
            rows_t = rows_t.to(self.device, non_blocking=True) if rows_t is not None else None
        else:
            dev = mask
        apply_bitmask(logits, dev, rows_t, self._shifts)
        return rows

    def fill(self, states: Sequence[GrammarState]) -> torch.Tensor:
        """The next-token bitmask of each state ([C, words] int32 on the host; pinned on a GPU worker)."""
        if self._batch is None:
            import xgrammar as xgr

            self._batch = xgr.BatchGrammarMatcher(max_threads=self.threads)
        mask = torch.empty((len(states), self.words), dtype=torch.int32, pin_memory=self.device.type == "cuda")
        self._batch.batch_fill_next_token_bitmask([s.matcher for s in states], mask)
        return mask


def _ban(bits: np.ndarray, banned: Sequence[int]) -> None:
    """Clear the banned ids' bits of one row, unless that would leave no token at all."""
    ids = np.asarray(banned, dtype=np.int64)
    ids = ids[ids < bits.shape[0] * 32]
    kept = bits.copy()
    np.bitwise_and.at(kept, ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))
    if kept.any():
        bits[:] = kept


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor | None,
                  shifts: torch.Tensor | None = None) -> None:
    """logits[rows] (all rows when None) = -inf where the row's bit is 0, and past the mask's width."""
    v = logits.shape[1]
    if shifts is None:
        shifts = torch.arange(8, dtype=torch.uint8, device=logits.device)
    allowed = ((mask.view(torch.uint8).unsqueeze(-1) >> shifts) & 1).view(mask.shape[0], -1)
    if allowed.shape[1] >= v:
        allowed = allowed[:, :v]
    else:
        allowed = torch.nn.functional.pad(allowed, (0, v - allowed.shape[1]))
    banned = allowed == 0
    if rows is None:
        logits.masked_fill_(banned, float("-inf"))
    else:
        sub = logits.index_select(0, rows)
        sub.masked_fill_(banned, float("-inf"))
        logits.index_copy_(0, rows, sub)
