"""Per-request penalty state, kept on the device and updated as tokens are sampled.

Only requests with a frequency, presence or repetition penalty hold a slot. Because frequency and
presence penalties are linear in a token's output count, the table keeps their sum ready to
subtract: `additive[slot, v] = frequency * count(v) + presence * [count(v) > 0]`, and a sampled
token updates it in place. `seen[slot, v]` marks tokens of the prompt or the output (what the
repetition penalty looks at). Sampling records each new token on the device right away, so the
overlap loop can launch step t+1 before step t's tokens reach the host.

Nothing here reads the device back or copies from pageable memory: a slot's tokens go over in one
staged copy (`to_device`), and what a recorded token adds comes with the step's `SamplingBatch`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from sglang_ext.sampling.batch import to_device


class PenaltyTable:
    def __init__(self, vocab_size: int, device: torch.device | str, capacity: int = 8) -> None:
        self.vocab = vocab_size
        self.device = torch.device(device)
        self.additive = torch.zeros(capacity, vocab_size, dtype=torch.float32, device=self.device)
        self.in_output = torch.zeros(capacity, vocab_size, dtype=torch.bool, device=self.device)
        self.seen = torch.zeros(capacity, vocab_size, dtype=torch.bool, device=self.device)
        self._free = list(range(capacity - 1, -1, -1))

    @property
    def capacity(self) -> int:
        return int(self.additive.shape[0])

    def _grow(self) -> None:
        old = self.capacity
        for name in ("additive", "in_output", "seen"):
            t = getattr(self, name)
            setattr(self, name, torch.cat([t, torch.zeros_like(t)]))
        self._free = list(range(2 * old - 1, old - 1, -1)) + self._free

    def acquire(self, prompt_ids: Sequence[int], output_ids: Sequence[int], frequency: float,
                presence: float) -> int:
        """A slot initialised from the tokens so far (outputs survive preemption, so count them)."""
        if not self._free:
            self._grow()
        slot = self._free.pop()
        ids = to_device(np.array([*prompt_ids, *output_ids], dtype=np.int64), self.device)
        self.seen[slot].zero_().index_fill_(0, ids, True)
        counts = torch.zeros(self.vocab, dtype=torch.float32, device=self.device)
        if output_ids:
            out = ids[len(prompt_ids):]
            counts.index_add_(0, out, torch.ones_like(out, dtype=torch.float32))
        self.in_output[slot] = counts > 0
        self.additive[slot] = frequency * counts + presence * self.in_output[slot].float()
        return slot

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def record(self, offsets: torch.Tensor, tokens: torch.Tensor, again: torch.Tensor,
               first: torch.Tensor) -> None:
        """Count `tokens[i]` for the slot at `offsets[i]` (= slot * vocab; each slot at most once):
        its additive penalty grows by `first[i]` (frequency + presence) if the token is new to the
        output, else by `again[i]` (frequency). Device tensors, from the step's SamplingBatch."""
        flat = offsets + tokens
        inc = torch.where(self.in_output.view(-1)[flat], again, first)
        self.additive.view(-1).index_add_(0, flat, inc)
        self.in_output.view(-1).index_fill_(0, flat, True)
        self.seen.view(-1).index_fill_(0, flat, True)
