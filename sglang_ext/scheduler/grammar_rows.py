"""Structured output, a scheduler member: masks for constrained rows and their matchers' tokens.

A step's masks need every token before it in the matchers: an overlapped step with constrained rows
is sampled once the step before it has landed (`Overlap._follow_up`), or with
`disable_grammar_overlap` such steps land at once.
"""

from __future__ import annotations

import torch

from sglang_ext.grammar.masks import GrammarMasks
from sglang_ext.sampling.batch import SampleRow
from sglang_ext.scheduler.member import Member
from sglang_ext.scheduler.request import Req, ReqStatus


class GrammarRows(Member):
    def __init__(self, vocab_size: int, device: torch.device, overlap: bool) -> None:
        self.masks = GrammarMasks(vocab_size, device)  # imports xgrammar only when used
        self.overlap = overlap

    def needs_landed_state(self, reqs: list[Req]) -> bool:
        return not self.overlap and any(r.grammar is not None for r in reqs)

    def mask(self, reqs: list[Req], logits: torch.Tensor, rows: list[SampleRow]) -> list[SampleRow]:
        """Mask the constrained rows of `logits` in place (their matchers hold every token before this
        step); the rows to sample with. A row whose request ended (aborted, or its grammar done at the
        step before, still in flight) is not masked: its matcher may allow nothing, and its token is
        dropped when the step lands."""
        if all(r.grammar is None for r in reqs):
            return rows
        states = [g if (g := r.grammar) is not None and r.status is ReqStatus.RUNNING and g.live else None
                  for r in reqs]
        with torch.inference_mode():  # the runner's logits are inference tensors
            return self.masks.constrain(logits, states, rows)

    @staticmethod
    def keep(r: Req, token: int) -> None:
        """A token the request keeps: it joins its output and its matcher."""
        r.output_ids.append(token)
        if r.grammar is not None:
            r.grammar.accept(token)
