"""What the scheduler reports: per request per step, its load, and the finish rules (the one place
they live: the plain and the overlap loop both apply `check_finish`, and the overlap loop leaves out
of step t+1 the requests `length_reached` says step t finishes)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sglang_ext.scheduler.request import FinishReason, Req

DecodeFn = Callable[[list[int]], str]


@dataclass
class LoadStats:
    num_running: int
    num_waiting: int
    kv_used_pages: int
    kv_total_pages: int
    cached_pages: int
    num_preemptions: int
    # rotation (preemption_mode=rotate): cumulative over the scheduler's life but num_rotary / host_*
    num_rotary: int = 0
    host_used_bytes: int = 0
    host_total_bytes: int = 0
    rotations_out: int = 0
    rotations_in: int = 0
    rotation_bytes_out: int = 0
    rotation_bytes_in: int = 0
    unhidden_iterations: int = 0
    # mean context (prompt + output tokens) of the running requests that decode, offloaded ones included
    decode_context_tokens: float = 0.0


@dataclass
class StepOutput:
    rid: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    attention_executor: str | None = None  # the executor's id once the request's attention ran there
    rotations: int = 0  # times its KV went to host memory and came back
    # logprob entries produced since the last output of this request
    input_token_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    output_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)


def length_reached(req: Req, context_len: int, ahead: int = 0) -> bool:
    """`req` reaches its max_new_tokens or the context length once `ahead` more tokens land: it
    finishes then, whatever those tokens are."""
    n = len(req.output_ids) + ahead
    return n >= req.sampling.max_new_tokens or req.fill_len + ahead >= context_len


def check_finish(req: Req, eos_ids: frozenset[int], context_len: int, decode: DecodeFn | None) -> FinishReason | None:
    p = req.sampling
    n = len(req.output_ids)
    if n == 0:
        return FinishReason("length", length=0) if p.max_new_tokens == 0 else None
    last = req.output_ids[-1]
    if req.grammar is not None:
        if req.grammar.error is not None:
            return FinishReason("abort", message=req.grammar.error)
        if req.grammar.terminated:  # it accepted a stop token: nothing may follow (even with ignore_eos)
            return FinishReason("stop", matched=last)
    if n >= p.min_new_tokens:
        if (not p.ignore_eos and last in eos_ids) or last in (p.stop_token_ids or ()):
            return FinishReason("stop", matched=last)
        if p.stop and decode is not None:
            window = max(len(s) for s in p.stop) + 8
            tail = decode(req.output_ids[-window:])
            for s in p.stop:
                if s in tail:
                    return FinishReason("stop", matched=s)
    if length_reached(req, context_len):
        return FinishReason("length", length=n)
    return None


def has_new(r: Req, sent: dict[str, tuple[int, int, int]]) -> bool:
    """`r` has tokens or prompt logprobs not reported yet (`sent`: rid -> what was reported)."""
    t0, i0, _ = sent.get(r.rid, (0, 0, 0))
    return len(r.output_ids) > t0 or len(r.input_token_logprobs) > i0


def report(r: Req, sent: dict[str, tuple[int, int, int]]) -> StepOutput:
    """What is new of `r` since its last report (`sent` is updated; a finished request leaves it)."""
    t0, i0, o0 = sent.get(r.rid, (0, 0, 0))
    out = StepOutput(
        rid=r.rid,
        new_token_ids=r.output_ids[t0:],
        finished=r.finished,
        finish_reason=r.finish_reason.to_dict() if r.finish_reason else None,
        prompt_tokens=len(r.input_ids),
        completion_tokens=len(r.output_ids),
        cached_tokens=r.cached_tokens,
        attention_executor=r.attention_executor,
        rotations=r.rotations,
        input_token_logprobs=r.input_token_logprobs[i0:],
        input_top_logprobs=r.input_top_logprobs[i0:],
        output_token_logprobs=r.output_token_logprobs[o0:],
        output_top_logprobs=r.output_top_logprobs[o0:],
    )
    if r.finished:
        sent.pop(r.rid, None)
    else:
        sent[r.rid] = (len(r.output_ids), len(r.input_token_logprobs), len(r.output_token_logprobs))
    return out
