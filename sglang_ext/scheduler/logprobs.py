"""Logprobs of a landed forward, recorded on its requests as SGLang returns them."""

from __future__ import annotations

import torch

from sglang_ext.sampling.sampler import logprobs_of
from sglang_ext.scheduler.batch_builder import Entry
from sglang_ext.scheduler.request import Req


def record_prompt_logprobs(e: Entry, logits: torch.Tensor, row: int) -> int:
    """Record the prompt logprobs of entry `e`, whose rows of `logits` start at `row`; the rows used."""
    r = e.req
    n_in = len(e.logprob_positions)
    if n_in:
        # Input entry p is the logprob of input_ids[p] given the tokens before: logits at p - 1.
        targets = torch.tensor([r.input_ids[q + 1] for q in e.logprob_positions], device=logits.device)
        lps, tops = logprobs_of(logits[row : row + n_in], targets, r.top_logprobs_num)
        for i, q in enumerate(e.logprob_positions):
            r.input_token_logprobs.append((lps[i], r.input_ids[q + 1]))
            r.input_top_logprobs.append(tops[i] if tops else None)
    return n_in


def record_output_logprobs(reqs: list[Req], tokens: list[int], logits: torch.Tensor) -> None:
    """Record the logprobs of the tokens sampled for `reqs` (row i of `logits` is reqs[i]'s)."""
    want = [i for i, r in enumerate(reqs) if r.return_logprob]
    if not want:
        return
    top_n = max(reqs[i].top_logprobs_num for i in want)
    lps, tops = logprobs_of(logits[want], torch.tensor([tokens[i] for i in want], device=logits.device), top_n)
    for j, i in enumerate(want):
        r = reqs[i]
        r.output_token_logprobs.append((lps[j], tokens[i]))
        r.output_top_logprobs.append(tops[j][: r.top_logprobs_num] if tops else [])
