"""Batched sampling with per-request parameters and optional per-request seeds.

Greedy rows take the argmax of the logits (after `logit_bias`, bans and penalties), so a request's
greedy tokens never depend on what else is in the batch. Penalties follow SGLang/OpenAI: frequency
and presence count output tokens; repetition divides positive (multiplies negative) logits of any
token seen in prompt or output.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sglang_ext.sampling.params import SamplingParams


class RowInfo(NamedTuple):
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator | None
    banned_ids: list[int]  # masked until min_new_tokens is reached (eos / stop ids)


def apply_penalties(logits: torch.Tensor, rows: list[RowInfo]) -> torch.Tensor:
    for i, r in enumerate(rows):
        p = r.params
        if not p.has_penalties:
            continue
        dev = logits.device
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.prompt_ids) | set(r.output_ids)), dtype=torch.long, device=dev)
            if seen.numel():
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if r.output_ids and (p.frequency_penalty or p.presence_penalty):
            ids = torch.tensor(r.output_ids, dtype=torch.long, device=dev)
            ones = torch.ones_like(ids, dtype=torch.float)
            counts = torch.zeros(logits.shape[1], device=dev).scatter_add_(0, ids, ones)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return logits


def _filter(probs: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """top-k, top-p and min-p on one row of probabilities (renormalised)."""
    if p.top_k > 0 and p.top_k < probs.shape[-1]:
        kth = torch.topk(probs, p.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if p.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop = (cum - sorted_p) > p.top_p  # keep the smallest set whose mass reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    if p.min_p > 0.0:
        probs = torch.where(probs >= p.min_p * probs.max(), probs, torch.zeros_like(probs))
    return probs / probs.sum()


def sample(logits: torch.Tensor, rows: list[RowInfo], default_gen: torch.Generator | None) -> list[int]:
    """logits [N, V] float32 -> one token id per row."""
    logits = logits.clone()
    for i, r in enumerate(rows):
        if r.params.logit_bias:
            ids = [int(k) for k in r.params.logit_bias]
            logits[i, ids] += torch.tensor(list(r.params.logit_bias.values()), device=logits.device)
        if r.banned_ids:
            logits[i, r.banned_ids] = float("-inf")
    logits = apply_penalties(logits, rows)
    greedy = torch.argmax(logits, dim=-1)
    out = greedy.tolist()
    for i, r in enumerate(rows):
        p = r.params
        if p.is_greedy:
            continue
        probs = torch.softmax(logits[i] / p.temperature, dim=-1)
        probs = _filter(probs, p)
        gen = r.generator if r.generator is not None else default_gen
        out[i] = int(torch.multinomial(probs, 1, generator=gen).item())
    return out


def logprobs_of(
    logits: torch.Tensor, token_ids: torch.Tensor, top_n: int
) -> tuple[list[float], list[list[tuple[float, int]]]]:
    """Log-probabilities (raw logits, before temperature/penalties) of `token_ids`, plus top-n."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, token_ids.view(-1, 1)).squeeze(1).tolist()
    tops: list[list[tuple[float, int]]] = []
    if top_n > 0:
        v, ix = torch.topk(lp, min(top_n, lp.shape[1]), dim=-1)
        tops = [list(zip(vr, ir, strict=True)) for vr, ir in zip(v.tolist(), ix.tolist(), strict=True)]
    return chosen, tops
