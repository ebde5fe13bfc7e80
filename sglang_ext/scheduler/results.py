"""What a landed forward produces, the same for the plain and the overlap loop: prompt and output
logprobs, sampled tokens (constrained rows masked), and the finish rules applied (`output.py`)."""

from __future__ import annotations

import torch

from sglang_ext.sampling.batch import SampleRow
from sglang_ext.sampling.sampler import Sampler
from sglang_ext.scheduler.batch_builder import Entry
from sglang_ext.scheduler.grammar_rows import GrammarRows
from sglang_ext.scheduler.logprobs import record_output_logprobs, record_prompt_logprobs
from sglang_ext.scheduler.output import StepOutput, check_finish, has_new, report
from sglang_ext.scheduler.remote_residency import RemoteResidency
from sglang_ext.scheduler.request import Req, ReqStatus
from sglang_ext.scheduler.view import LoopView


class Results:
    def __init__(self, s: LoopView, sampler: Sampler, grammar: GrammarRows, remote_residency: RemoteResidency) -> None:
        self.s = s  # its eos_ids and decode_fn are read at each use (tests set them after construction)
        self.sampler = sampler
        self.grammar = grammar
        self.remote_residency = remote_residency

    def sample_row(self, r: Req, ahead: int = 0) -> SampleRow:
        """How to sample request r's next token, `ahead` tokens after those already landed."""
        p = r.sampling
        n_out = len(r.output_ids) + ahead
        banned: list[int] = []
        if n_out < p.min_new_tokens:
            banned = sorted(set(self.s.eos_ids) | set(p.stop_token_ids or []))
        if p.has_penalties and r.penalty_slot < 0:
            r.penalty_slot = self.sampler.penalties.acquire(r.input_ids, r.output_ids, p.frequency_penalty,
                                                             p.presence_penalty)
        return SampleRow(p, n_out, banned, r.penalty_slot)

    def draw(self, reqs: list[Req], logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Sample one token per row of `logits` (masked in place for constrained rows)."""
        rows = self.grammar.mask(reqs, logits, rows)
        return self.sampler.sample(logits, self.sampler.batch(rows))

    def land(self, entries: list[Entry], logits: torch.Tensor) -> list[StepOutput]:
        """The results of a forward that lands at once: prompt logprobs, sampled tokens, finishes."""
        s = self.s
        row = 0
        sample_rows: list[int] = []
        sample_reqs: list[Req] = []
        for e in entries:
            r = e.req
            row += record_prompt_logprobs(e, logits, row)
            r.kv_len += e.extend
            if e.extend > 1:
                s.prefill_tokens += e.extend
                # Publish finished prompt pages now so concurrent requests can share them.
                s.kv.cache_prefix(r)
            if e.sample:
                sample_rows.append(row)
                sample_reqs.append(r)
                row += 1
        if sample_rows:
            rows_logits = logits[sample_rows]  # a copy: masked in place below
            tokens = self.draw(sample_reqs, rows_logits, [self.sample_row(r) for r in sample_reqs]).tolist()
            # (landed) remote rows let through by a watchdog carry no attention results: drop them
            forged = self.remote_residency.forged(self.remote_residency.transport(sample_reqs))
            if forged:
                keep = [i for i, r in enumerate(sample_reqs) if id(r) not in forged]
                sample_reqs, tokens = [sample_reqs[i] for i in keep], [tokens[i] for i in keep]
                rows_logits = rows_logits[keep]
                entries = [e for e in entries if id(e.req) not in forged]
            record_output_logprobs(sample_reqs, tokens, rows_logits)
            for r, t in zip(sample_reqs, tokens, strict=True):
                GrammarRows.keep(r, t)
        return self.finish_or_report([e.req for e in entries])

    def finish_or_report(self, reqs: list[Req]) -> list[StepOutput]:
        """Apply the finish rules to requests whose forward just landed; report what is new. A
        request back in the waiting queue (taken back from its executor while its step was in
        flight: it holds no KV anywhere) that stops here leaves the queue."""
        s = self.s
        outputs: list[StepOutput] = []
        now = s.clock()
        for r in reqs:
            queued = r.status is ReqStatus.WAITING
            if r.output_ids:
                r.last_token_time = now
                if r.first_token_time is None and not queued:
                    r.first_token_time = now
            done = queued or r.kv_len >= r.fill_len - 1  # mid-prefill chunks cannot finish
            reason = check_finish(r, s.eos_ids, s.runner.context_len, s.decode_fn) if done else None
            if reason is not None:
                (s.waiting if queued else s.running).remove(r)
                s.finish(r, reason)
            if reason is not None or has_new(r, s.sent):
                outputs.append(report(r, s.sent))
        return outputs
