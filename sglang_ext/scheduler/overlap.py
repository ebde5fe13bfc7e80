"""Overlap scheduling: the CPU prepares decode step t+1 while the GPU still runs step t.

A plain `Scheduler.step` runs forward(t) and then waits for its tokens before it can build t+1, so
the GPU idles while the CPU samples, checks stop conditions, schedules and plans. Here a decode
step is *launched* (forward + sampling on the device, tokens copied to pinned host memory behind
an event) and its results are taken one `step()` later, after the next decode has been launched
with the in-flight tokens as its input ids:

    step() n:    launch D(t+1) [inputs = D(t) tokens, on device] | wait D(t), append tokens, finish
    step() n+1:  launch D(t+2) ...                                | wait D(t+1) ...

Step t+1 is built before step t's stop checks, so a request that stops at t (EOS, stop string)
runs one extra row at t+1 whose token is dropped; its KV write lands in its own, then freed, page
(never in a prefix-cache page: cached pages hold only positions < kv_len), and anything that
reuses the page later is ordered after it on the stream. Requests that certainly finish at t
(max_new_tokens, context length) are left out of t+1.

Only decode batches without logprobs overlap, also while requests wait if none of them could be
admitted now (the running batch full, or the first candidate's first chunk does not fit beside the
decoders' reserve: under load a queue stands and the pool binds). Sampling needs nothing of step t on the host:
penalty statistics live on the device and are updated as each token is drawn, min_new_tokens
bans count the in-flight token, and seeded rows number their draws by output position. Anything
else (prefill, admissions, preemption, logprobs) first drains the in-flight step and then runs
exactly as `Scheduler.step`, so the outputs are the same as without overlap (an admission that
only the pages freed at step t make possible waits one step).

Constrained rows (structured output) overlap too, but their mask for t+1 needs token t in their
grammar matcher, so a step t+1 with constrained rows is launched in two halves around t's landing:

    step() n:  forward D(t+1) queued | wait D(t), append tokens, matchers accept them |
               fill t+1's masks (host, while the forward runs), copy, mask, sample D(t+1) | finish
               rules of t

Every row of the batch keeps overlap; the fill overlaps the forward instead of following it. A row
that finishes at t (its grammar ended, a stop, an abort meanwhile) was launched into t+1 all the
same: its mask is not filled (its matcher may be done), its t+1 token is sampled unmasked and
dropped when t+1 lands, like any row that finishes at t, and no dropped token reaches a matcher.
`disable_grammar_overlap` keeps the older behaviour (constrained rows drain the loop and run as
`Scheduler.step`), for comparison (bench/structured.py) and as a fallback.

Remote rows (remote attention, `offload/`) overlap too when their transport is `overlap_safe`
(every transport here is; one that is not drains the loop before each step with remote rows). Step
t+1 plans its remote rows on the executor (`begin_step`) at kv_len + 1 -- known on the host, since
each decode step adds one token -- after every local decision of t+1 is made, so a planned step is
always launched. A remote request that stops at t was planned into t+1 all the same: the executor
wrote its extra KV row, and releasing the request when t lands frees that row with the rest (the
executor's length is never compared again). A request the executor drops while planning t+1 (no
room), or every remote request when the executor is lost, goes back to the waiting queue at once,
but its step-t token is still in flight: it is kept when t lands (the device's penalty statistics
already count it), the finish rules see it, and the request is recomputed with it -- unless the
executor died while t ran: a GPU-signalled transport's watchdog then let t's remote rows through
without results (`RemoteAttention.results_forged`), so their tokens are dropped on landing and the
requests recomputed without them (also in the plain loop, whose steps land at once).

KV rotation (`preemption_mode=rotate`) keeps to the same rule: while any request is rotary, or a
rotation or resume is to be decided, the in-flight step is drained first and the iteration runs as
`Scheduler.step` (decisions on landed state). Eager copies also go out beside overlapped steps:
they copy only pages that are full by the landed length, which no step in flight writes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_ext.engine.forward_batch import BatchRow, ForwardBatch, ForwardMode
from sglang_ext.offload.remote import ExecutorLost, RemoteAttention
from sglang_ext.sampling.batch import SampleRow
from sglang_ext.scheduler.batch_builder import Entry, build_batch
from sglang_ext.scheduler.output import StepOutput, check_finish
from sglang_ext.scheduler.request import Req, ReqStatus
from sglang_ext.scheduler.scheduler import Scheduler


@dataclass
class _Launched:
    entries: list[Entry]
    tokens: torch.Tensor  # [N] int64 on the device: input ids of the follow-up step
    host: torch.Tensor  # [N] int64 on the host, valid once `done` has fired
    done: torch.cuda.Event | None
    remote: list[Req]  # the rows that attended on the executor (checked for forged results on landing)
    via: RemoteAttention | None  # that executor's transport
    planned: int = 0  # its `begins` when this step was planned


@dataclass
class _Forwarded:
    """A step whose forward is queued but whose constrained rows' masks wait for the step before it."""

    entries: list[Entry]
    logits: torch.Tensor
    rows: list[SampleRow]  # built before the step before it landed (ahead=1); sampled before its finish rules


class OverlapScheduler(Scheduler):
    _inflight: _Launched | None = None
    overlapped_steps = 0  # decode steps launched before their predecessor landed
    grammar_overlapped_steps = 0  # of those, steps with constrained rows (masks filled as t landed)

    def has_work(self) -> bool:
        return super().has_work() or self._inflight is not None

    def step(self) -> list[StepOutput]:
        prev, self._inflight = self._inflight, None
        if prev is None:
            return super().step()  # schedules on landed state; `_run` may launch a decode
        outputs, self._pending = self._pending, []
        self._rot_begin()
        follow = self._launch_follow_up(prev)
        if follow is not None:
            self._rot_end()  # eager copies ride beside the launched step too
        landed, taken_back = self._take(prev)
        if isinstance(follow, _Forwarded):
            # t's tokens are in the matchers: fill t+1's masks while its forward runs, then sample
            follow = self._sample(follow.entries, follow.logits, follow.rows)
        self._inflight = follow
        return outputs + self._finish_or_report(landed) + self._finish_taken_back(taken_back)

    def _run(self, entries: list[Entry], mode: ForwardMode) -> list[StepOutput]:
        if mode is ForwardMode.DECODE and all(self._plain(e) for e in entries):
            try:
                entries = self._plan_remote(entries)
                if entries:
                    batch = build_batch(entries, mode, self.page_size, self.runner.device)
                    self._inflight = self._launch(entries, batch, ahead=0)
            except ExecutorLost as e:
                self._lose_executor(str(e))  # as in the plain loop: nothing of this step is kept
            return []
        return super()._run(entries, mode)

    def _admission_blocked(self) -> bool:
        """No waiting request could be admitted now, whatever step t brings: the loop may keep
        overlapping decode steps while a queue stands (a KV-bound pool under load) instead of
        draining every step. True only where it cannot be wrong: the running batch is full, or the
        first candidate -- `_schedule` tries candidates in the policy's order and stops at the first
        that does not fit -- cannot have its first chunk's pages beyond the running requests' decode
        reserve, even counting the pages its cached prefix may lend (before it locks them, so at
        most an admission-less step drains, as before). Without that second test the loop drained
        whenever a single page was spare, nearly every step of a KV-bound pool with offload (~11 %
        of steps overlapped on two H200s). Pages freed by requests that finish at step t are seen one
        step later, so such an admission waits one step; rotation (whose policy may rotate requests
        out to admit one) keeps deciding on landed state."""
        if self.rot is not None:
            return False
        if len(self.running) >= self.max_running:
            return True
        reserve = self._decode_reserve()
        available = self.kv.available_pages
        if available - reserve < 1:
            return True
        head = next(iter(self.policy.candidates(self.waiting, self.rotary, self.kv.cache)), None)
        if head is None or head.admitted or head.remote is not None:
            return False  # adopted (its KV on an executor): admitted without pages
        match = self.kv.cache.match_prefix(head.fill_ids[: self.kv.match_limit(head)])
        if head.staged_kv is not None:  # its prompt's KV came from a prefill worker (_admit_staged)
            need = self.kv.pages_for(len(head.input_ids) + 1) - len(match.pages)
        else:
            first = min(head.fill_len - match.num_tokens, self.chunk)
            need = self.kv.pages_for(match.num_tokens + max(first, 1)) - len(match.pages)
        return need + reserve > available

    # ---- launching ----------------------------------------------------------------------------
    def _plain(self, e: Entry) -> bool:
        r = e.req
        return (e.extend == 1 and e.sample and not e.logprob_positions and not r.return_logprob
                and (r.grammar is None or not self.args.disable_grammar_overlap)
                and (r.remote is None or self.offload is not None))

    def _launch(self, entries: list[Entry], batch: ForwardBatch, ahead: int) -> _Launched:
        """Forward and sample a step whose constrained rows' matchers are up to date (nothing in flight)."""
        logits = self.runner.forward(batch)
        return self._sample(entries, logits, [self._sample_row(e.req, ahead) for e in entries])

    def _sample(self, entries: list[Entry], logits: torch.Tensor, rows: list[SampleRow]) -> _Launched:
        """Mask the constrained rows (their matchers hold every token before this step), sample, and
        copy the tokens to the host behind an event."""
        if any(e.req.grammar is not None for e in entries):
            # A row whose request ended (aborted, or its grammar done at the step before) is not
            # masked: its matcher may allow nothing, and its token is dropped when this step lands.
            states = [g if (g := e.req.grammar) is not None and e.req.status is ReqStatus.RUNNING and g.live
                      else None for e in entries]
            with torch.inference_mode():  # masked in place: the runner's logits are inference tensors
                rows = self.grammar_masks.constrain(logits, states, rows)
        tokens = self.sampler.sample(logits, self.sampler.batch(rows))
        remote = [e.req for e in entries if e.req.remote is not None]
        via = self.offload.remote if remote and self.offload is not None else None
        planned = via.begins if via is not None else 0
        if tokens.is_cuda:
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            return _Launched(entries, tokens, host, done, remote, via, planned)
        return _Launched(entries, tokens, tokens, None, remote, via, planned)

    def _launch_follow_up(self, prev: _Launched) -> _Launched | _Forwarded | None:
        """Decode step t+1 from step t's in-flight tokens: launched, or only forwarded when it has
        constrained rows (sampled once t has landed); None when it needs t's results."""
        if self.rotary or (self.waiting and not self._admission_blocked()):
            return None  # admission, resume (and prefill) decisions are made on landed state
        rows: list[int] = []
        live: set[int] = set()
        for i, e in enumerate(prev.entries):
            r = e.req
            if r.status is not ReqStatus.RUNNING:
                continue  # aborted while in flight
            live.add(id(r))
            n_out = len(r.output_ids) + 1
            if n_out >= r.sampling.max_new_tokens or r.fill_len + 1 >= self.runner.context_len:
                continue  # finishes at step t for certain
            rows.append(i)
        if not rows or any(id(r) not in live for r in self.running):
            return None
        entries = [Entry(prev.entries[i].req, 1, [], True) for i in rows]
        if not all(self._plain(e) for e in entries):
            return None  # remote rows whose transport cannot overlap
        for e in entries:
            r = e.req
            if r.remote is not None:
                continue  # its KV grows on the executor
            if not self.kv.can_grow(r, r.kv_len + 2):
                return None  # would need preemption: decide on landed state
            self.kv.grow(r, r.kv_len + 2)
        try:
            # Last, so that once planned the step is launched. Rows the executor drops are requeued
            # now; their step-t tokens are kept when t lands.
            kept = self._plan_remote(entries, ahead=1)
        except ExecutorLost as e:
            self._lose_executor(str(e))
            return None
        if len(kept) < len(entries):
            keep = {id(e.req) for e in kept}
            rows = [i for i in rows if id(prev.entries[i].req) in keep]
            entries = kept
            if not rows:
                return None
        # Each row decodes its in-flight token (id filled in on the device below) at kv_len + 1.
        ahead = [BatchRow(e.req.kv_len + 1, (0,), e.req.pages, (0,), e.req.remote) for e in entries]
        batch = ForwardBatch.build(ahead, ForwardMode.DECODE, self.page_size, self.runner.device)
        if len(rows) == len(prev.entries):
            batch.input_ids = prev.tokens
        else:
            idx = torch.tensor(rows, dtype=torch.int64).to(prev.tokens.device, non_blocking=True)
            batch.input_ids = prev.tokens[idx]
        try:
            logits = self.runner.forward(batch)
        except ExecutorLost as e:
            # as in the plain loop: local rows redo t+1 (idempotent KV writes), remote ones are
            # recomputed (with their step-t tokens, kept when t lands)
            self._lose_executor(str(e))
            return None
        self.overlapped_steps += 1
        # Sample rows now: a row that finishes at t releases its penalty slot when t lands.
        rows = [self._sample_row(e.req, ahead=1) for e in entries]
        if any(e.req.grammar is not None for e in entries):
            self.grammar_overlapped_steps += 1
            return _Forwarded(entries, logits, rows)
        return self._sample(entries, logits, rows)

    # ---- landing ------------------------------------------------------------------------------
    def _take(self, launched: _Launched) -> tuple[list[Req], list[Req]]:
        """Wait for a launched step's tokens and keep them (matchers accept them): the requests that
        landed, and those taken back meanwhile; the finish rules come after."""
        if launched.done is not None:
            launched.done.synchronize()
        tokens = launched.host.tolist()
        landed: list[Req] = []
        taken_back: list[Req] = []
        forged = self._forged(launched.remote, launched.via, launched.planned)
        for e, t in zip(launched.entries, tokens, strict=True):
            r = e.req
            if id(r) in forged:
                self._drop_forged(r)  # recomputed without it (it is queued already)
                continue
            if r.status is ReqStatus.WAITING:
                # Taken back from its executor while this step was in flight (see the module
                # docstring): the token stands, and the request is recomputed with it.
                taken_back.append(r)
            elif r.status is ReqStatus.RUNNING:
                r.kv_len += 1
                landed.append(r)
            else:
                continue  # finished or aborted meanwhile: the extra row's token is dropped
            r.output_ids.append(t)
            if r.grammar is not None:
                r.grammar.accept(t)
        return landed, taken_back

    def _finish_taken_back(self, reqs: list[Req]) -> list[StepOutput]:
        """The finish rules for requests that wait to be recomputed: one that stops here leaves the
        queue (it holds no KV anywhere)."""
        outputs: list[StepOutput] = []
        now = self.clock()
        for r in reqs:
            r.last_token_time = now
            reason = check_finish(r, self.eos_ids, self.runner.context_len, self.decode_fn)
            if reason is not None:
                self.waiting.remove(r)
                self._finish(r, reason)
            if reason is not None or self._has_new(r):
                outputs.append(self._output(r))
        return outputs


def scheduler_class(device: torch.device | str, disable_overlap_schedule: bool) -> type[Scheduler]:
    """The worker's scheduler: overlap on CUDA unless disabled; the plain loop everywhere else."""
    if torch.device(device).type == "cuda" and not disable_overlap_schedule:
        return OverlapScheduler
    return Scheduler
