"""Overlap scheduling: the CPU prepares decode step t+1 while the GPU still runs step t.

A decode step is *launched* (forward and sampling on the device, the tokens written to the token
table's slots of their requests and copied to pinned host memory behind an event) and lands one
`step()` later, after the next decode has been launched with input ids gathered, on the device, from
the token table (`token_table.py`) by the slots of its requests:

    step() n:    launch D(t+1) [inputs = table[slots], on device] | wait D(t), append tokens, finish
    step() n+1:  launch D(t+2) ...                                 | wait D(t+1) ...

Both loops run the same admission (`admission.py`), sampling and finish code (`results.py`, the finish
rules in `output.py`). What keeps the outputs those of the plain loop (docs/architecture.md, "Model
execution"; constrained rows: "Structured output"; remote rows: docs/remote_attention.md, "Overlap
scheduling"):
  * only decode steps without logprobs overlap, and only while no member needs landed state
    (`Member.needs_landed_state`); anything else drains the step in flight and runs as the plain loop;
  * a request that stops at t ran one extra row in t+1: its token is dropped and its KV write went
    to its own page, never a cached one; requests certain to finish at t (`length_reached`) are left
    out of t+1, and while a queue stands t+1 is launched only if `Admission.blocked` says no
    candidate could be admitted (likewise a running request part-way through its prefill whose next
    chunk gets no pages: `_stalled`);
  * a step with constrained rows is forwarded first and sampled once t's tokens are in the matchers;
  * remote rows are planned on the executor last (at kv_len + 1), so a planned step is always
    launched; a request taken back from its executor meanwhile keeps its step-t token, unless the
    step's results were forged (its executor died mid-step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from sglang_ext.forward_batch import BatchRow, ForwardBatch, ForwardMode
from sglang_ext.offload.remote import ExecutorLost
from sglang_ext.sampling.batch import SampleRow
from sglang_ext.scheduler.admission import Admission
from sglang_ext.scheduler.batch_builder import Entry
from sglang_ext.scheduler.grammar_rows import GrammarRows
from sglang_ext.scheduler.member import Member
from sglang_ext.scheduler.output import StepOutput, length_reached
from sglang_ext.scheduler.remote_residency import RemoteResidency, Sampled
from sglang_ext.scheduler.request import Req, ReqStatus
from sglang_ext.scheduler.results import Results
from sglang_ext.scheduler.token_table import TokenTable
from sglang_ext.scheduler.view import LoopView

# Why `_follow_up` did not launch the next step ahead: the running rows changed (a request finished, joined
# or left; nothing left to run), some member needs landed state, a queue stands that admission is not
# blocked on, a row could not grow without preemption, or the executor was lost.
NOT_OVERLAPPED = ("rows", "landed", "queue", "grow", "executor")


class Loop(LoopView, Protocol):
    """What the overlap loop uses of the scheduler beyond a member's view: the plain loop's
    planning, sampling and finish code, which both loops share."""

    remote_residency: RemoteResidency
    results: Results  # sampling and the finish rules, the plain loop's
    members: list[Member]
    admission: Admission  # the plain loop's

    def needs_landed_state(self, reqs: list[Req]) -> bool: ...

    def ready(self, r: Req) -> bool: ...

    def plan(self, entries: list[Entry], ahead: int = 0) -> list[Entry]: ...


@dataclass
class _Launched:
    entries: list[Entry]
    host: torch.Tensor  # [N] int64 sampled ids on the host, valid once `done` has fired (on the device:
    # the token table's slots of the rows' requests)
    done: torch.cuda.Event | None
    remote: Sampled  # the rows that attended on an executor (checked for forged results on landing)


@dataclass
class _Forwarded:
    """A step whose forward is queued but whose constrained rows' masks wait for the step before it."""

    entries: list[Entry]
    logits: torch.Tensor
    rows: list[SampleRow]  # built before the step before it landed (ahead=1); sampled before its finish rules
    index: torch.Tensor  # its requests' token table slots


class Overlap:
    """The scheduler's step in flight and how the next one is launched beside it."""

    def __init__(self, s: Loop, table: TokenTable) -> None:
        self.s = s
        self.table = table  # a member of the scheduler: a finished request's slot is released
        self.inflight: _Launched | None = None
        self.overlapped_steps = 0  # decode steps launched before their predecessor landed
        # Why a step in flight was not followed by an overlapped one (the next runs plain, its host time not
        # hidden): the step log prints these per interval, what a simulator of the loop must reproduce.
        self.not_overlapped: dict[str, int] = dict.fromkeys(NOT_OVERLAPPED, 0)
        self.grammar_overlapped_steps = 0  # of those, steps with constrained rows (masks filled as t landed)

    def may_launch(self, entries: list[Entry], mode: ForwardMode) -> bool:
        """A step scheduled on landed state may land one step later: a decode without logprobs
        whose rows no member needs landed."""
        return (mode is ForwardMode.DECODE
                and all(e.extend == 1 and e.sample and not e.logprob_positions and not e.req.return_logprob
                        for e in entries)
                and not self.s.needs_landed_state([e.req for e in entries]))

    def launch(self, entries: list[Entry], batch: ForwardBatch) -> None:
        """Forward and sample a step whose constrained rows' matchers are up to date (nothing in flight)."""
        logits = self.s.runner.forward(batch)
        index = self.table.index([e.req for e in entries])
        self.inflight = self._sample(entries, logits, [self.s.results.sample_row(e.req) for e in entries], index)

    def step(self) -> list[StepOutput]:
        """Launch step t+1 (if it may be) and land step t."""
        prev, self.inflight = self.inflight, None
        assert prev is not None
        follow = self._follow_up(prev)
        if follow is not None:
            for m in self.s.members:
                m.end()  # eager copies ride beside the launched step too
        landed = self._take(prev)
        if isinstance(follow, _Forwarded):
            # t's tokens are in the matchers: fill t+1's masks while its forward runs, then sample
            follow = self._sample(follow.entries, follow.logits, follow.rows, follow.index)
        self.inflight = follow
        return self.s.results.finish_or_report(landed)

    def _sample(self, entries: list[Entry], logits: torch.Tensor, rows: list[SampleRow],
                index: torch.Tensor) -> _Launched:
        """Sample (constrained rows masked), write the tokens to the token table's slots `index` of
        the rows' requests, and copy them to the host behind an event."""
        reqs = [e.req for e in entries]
        tokens = self.s.results.draw(reqs, logits, rows)
        self.table.write(index, tokens)
        remote = self.s.remote_residency.transport(reqs)
        if tokens.is_cuda:
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            return _Launched(entries, host, done, remote)
        return _Launched(entries, tokens, None, remote)

    def _admission_blocked(self) -> bool:
        """No waiting request could be admitted now, whatever step t brings (`Admission.blocked`)."""
        return self.s.admission.blocked()

    def _stalled(self, r: Req) -> bool:
        """Running request `r`, out of the step in flight, is part-way through its prefill and the plain loop
        could not continue it now either: no pages for its next chunk (`Scheduler._schedule`'s first rule).
        Where the pool binds this is the common case, and draining for it ran every decode plain while it
        waited. Only the step in flight's finishes could free its pages: it waits one step, as a blocked
        queue does (`Admission.blocked`)."""
        s = self.s
        if r.prefilled or not s.ready(r):
            return False
        return not s.kv.can_grow(r, r.kv_len + min(r.fill_len - r.kv_len, s.chunk))

    def _follow_up(self, prev: _Launched) -> _Launched | _Forwarded | None:
        """Decode step t+1 from step t's in-flight tokens (in the token table): launched, or only
        forwarded when it has constrained rows (sampled once t has landed); None when it needs t's
        results."""
        s = self.s
        entries: list[Entry] = []
        live: set[int] = set()
        for e in prev.entries:
            r = e.req
            if r.status is not ReqStatus.RUNNING:
                continue  # aborted while in flight
            live.add(id(r))
            if length_reached(r, s.runner.context_len, ahead=1):
                continue  # finishes at step t for certain (the finish rule's length clause)
            entries.append(Entry(r, 1, [], True))
        if not entries or any(id(r) not in live and not self._stalled(r) for r in s.running):
            self.not_overlapped["rows"] += 1
            return None
        if any(e.req.token_slot < 0 for e in entries):
            self.not_overlapped["rows"] += 1  # (never: a running request keeps the slot its step-t token went to)
            return None
        if s.needs_landed_state([e.req for e in entries]):
            self.not_overlapped["landed"] += 1  # e.g. admission, resume (and prefill) decisions: on landed state
            return None
        if (s.waiting or s.rotary) and not self._admission_blocked():
            self.not_overlapped["queue"] += 1
            return None
        for e in entries:
            r = e.req
            if not s.admission.pooled(r):
                continue  # its KV grows elsewhere (on the executor)
            if not s.kv.can_grow(r, r.kv_len + 2):
                self.not_overlapped["grow"] += 1  # would need preemption: decide on landed state
                return None
            s.kv.grow(r, r.kv_len + 2)
        try:
            # Planned last, so that once planned the step is launched. Rows the executor drops are
            # requeued now; their step-t tokens are kept when t lands.
            entries = s.plan(entries, ahead=1)
            if not entries:
                self.not_overlapped["rows"] += 1
                return None
            # Each row decodes its in-flight token at kv_len + 1: one new token, whose id the batch
            # gathers from the token table by the slots of its requests.
            ahead = [BatchRow(e.req.kv_len + 1, (0,), e.req.pages, (0,), e.req.remote) for e in entries]
            index = self.table.index([e.req for e in entries])
            batch = ForwardBatch.build(ahead, ForwardMode.DECODE, s.page_size, s.runner.device,
                                       input_ids=self.table.read(index))
            logits = s.runner.forward(batch)
        except ExecutorLost as e:
            # as without overlap: local rows redo t+1 (idempotent KV writes), remote ones are
            # recomputed (with their step-t tokens, kept when t lands)
            s.remote_residency.lose_executor(str(e))
            self.not_overlapped["executor"] += 1
            return None
        self.overlapped_steps += 1
        # Sample rows now: a row that finishes at t releases its penalty slot when t lands.
        sample_rows = [s.results.sample_row(e.req, ahead=1) for e in entries]
        if any(e.req.grammar is not None for e in entries):
            self.grammar_overlapped_steps += 1
            return _Forwarded(entries, logits, sample_rows, index)
        return self._sample(entries, logits, sample_rows, index)

    def _take(self, launched: _Launched) -> list[Req]:
        """Wait for a launched step's tokens and keep them (matchers accept them): the requests that
        landed, then those taken back meanwhile (the finish rules come after)."""
        if launched.done is not None:
            launched.done.synchronize()
        tokens = launched.host.tolist()
        landed: list[Req] = []
        taken_back: list[Req] = []
        forged = self.s.remote_residency.forged(launched.remote, launched.remote.begins)
        for e, t in zip(launched.entries, tokens, strict=True):
            r = e.req
            if id(r) in forged:
                continue  # recomputed without it (it is queued already)
            if r.status is ReqStatus.WAITING:
                # Taken back from its executor while this step was in flight (see the module
                # docstring): the token stands, and the request is recomputed with it.
                taken_back.append(r)
            elif r.status is ReqStatus.RUNNING:
                r.kv_len += 1
                landed.append(r)
            else:
                continue  # finished or aborted meanwhile: the extra row's token is dropped
            GrammarRows.keep(r, t)
        return landed + taken_back
