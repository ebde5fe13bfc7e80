"""Continuous batching with chunked prefill, prefix reuse and preemption.

Each `step()` is one forward: an EXTEND batch of prefill chunks within `chunked_prefill_size`
tokens with every decoding request riding along, or else a DECODE batch of all running requests.
When KV pages run out, running requests are preempted in the policy's victim order (`policy.py`):
parked by a member that keeps their KV (rotation to host memory) or recomputed later. Where a
request's KV lives is answered by the residency member of its home (`Req.home`: local pages,
host memory, an attention executor, a prefill worker's hand-off); the loop asks its members
(`member.py`) and never tests a home itself. With `overlap` (a CUDA worker's default) decode steps
are pipelined (`overlap.py`) over the same admission and finish code. Details: docs/architecture.md,
"Scheduler".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from sglang_ext.forward_batch import ForwardMode
from sglang_ext.kvcache.allocator import PageAllocator
from sglang_ext.kvcache.base import NoPrefixCache, PrefixCache
from sglang_ext.kvcache.holds import HoldingAllocator
from sglang_ext.kvcache.radix_cache import RadixCache
from sglang_ext.offload.remote import ExecutorLost
from sglang_ext.offload.sender import Offloader
from sglang_ext.sampling.batch import SampleRow
from sglang_ext.sampling.sampler import Sampler
from sglang_ext.scheduler.batch_builder import Entry, build_batch
from sglang_ext.scheduler.grammar_rows import GrammarRows
from sglang_ext.scheduler.handoff import Handoff
from sglang_ext.scheduler.kv_manager import KVManager
from sglang_ext.scheduler.local import LocalPages
from sglang_ext.scheduler.logprobs import record_output_logprobs, record_prompt_logprobs
from sglang_ext.scheduler.member import Member, Residency
from sglang_ext.scheduler.output import DecodeFn, LoadStats, StepOutput, check_finish, has_new, report
from sglang_ext.scheduler.overlap import Overlap
from sglang_ext.scheduler.policy import SchedulePolicy, make_policy
from sglang_ext.scheduler.remote_rows import RemoteRows
from sglang_ext.scheduler.request import FinishReason, KVHome, Req, ReqStatus, check_request
from sglang_ext.scheduler.rotary import Rotation
from sglang_ext.scheduler.view import Runner
from sglang_ext.server_args import ServerArgs

logger = logging.getLogger(__name__)


def default_overlap(device: torch.device | str, disable_overlap_schedule: bool) -> bool:
    """A worker's loop overlaps on CUDA unless disabled; elsewhere each step lands at once."""
    return torch.device(device).type == "cuda" and not disable_overlap_schedule


class Scheduler:
    def __init__(
        self,
        args: ServerArgs,
        runner: Runner,
        page_size: int,
        eos_ids: frozenset[int],
        decode_fn: DecodeFn | None = None,
        *,
        vocab_size: int,
        offload: Offloader | None = None,
        overlap: bool = False,
    ) -> None:
        self.args = args
        self.runner = runner
        self.page_size = page_size
        self.eos_ids = eos_ids
        self.decode_fn = decode_fn
        self.vocab_size = vocab_size
        rotate = args.preemption_mode == "rotate"
        self.allocator = HoldingAllocator(runner.num_pages) if rotate else PageAllocator(runner.num_pages)
        cache: PrefixCache = NoPrefixCache(page_size) if args.disable_radix_cache else RadixCache(page_size)
        self.kv = KVManager(self.allocator, cache, page_size)
        self.policy: SchedulePolicy = make_policy(args.schedule_policy, args)
        self.clock: Callable[[], float] = time.monotonic  # VLT and rotation timing; tests inject one
        self.chunk = args.resolved_chunked_prefill_size or args.max_prefill_tokens
        self.max_running = args.max_running_requests or 256
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.rotary: list[Req] = []  # home HOST: KV in host memory (preemption_mode=rotate)
        self._pending: list[StepOutput] = []  # outputs produced outside a forward (aborts)
        # rid -> (tokens, in-logprobs, out-logprobs) reported so far (here, or by a prefill worker: Handoff)
        self.sent: dict[str, tuple[int, int, int]] = {}
        self.num_preemptions = 0
        self.prefill_tokens = 0  # prompt tokens forwarded in chunks of more than one (a step profile's)
        self.forward_rows = 0  # requests in the forwards launched so far (a step profile's)
        self.remote_forward_rows = 0  # ... of which remote rows
        self.deficit = 0  # pages by which all requests' KV exceeds the pool (0: everything fits), per iteration
        self.sampler = Sampler(vocab_size, runner.device, args.random_seed, top_k_window=args.sampling_top_k_window)
        # members (member.py): local pages last, as every release ends there
        self.rot = Rotation.make(self, args) if rotate else None
        self.remote_rows = RemoteRows(self)
        self.handoff = Handoff(self)
        self.grammar = GrammarRows(vocab_size, runner.device, not args.disable_grammar_overlap)
        self.local = LocalPages(self)
        self.members: list[Member] = [m for m in (self.rot, self.remote_rows, self.handoff, self.grammar,
                                                  self.local) if m]
        self.homes: dict[KVHome, Residency] = {m.home: m for m in self.members if isinstance(m, Residency)}
        self.overlap = Overlap(self) if overlap else None
        self.remote_rows.set_offload(offload)

    # ---- requests in and out ------------------------------------------------------------------
    @property
    def max_total_tokens(self) -> int:
        return self.allocator.capacity * self.page_size

    @property
    def offload(self) -> Offloader | None:
        return self.remote_rows.offload

    @property
    def overlapped_steps(self) -> int:
        """Decode steps launched before their predecessor landed."""
        return self.overlap.overlapped_steps if self.overlap is not None else 0

    def validate(self, req: Req) -> None:
        check_request(req, self.vocab_size, self.runner.context_len, self.max_total_tokens)

    def add_request(self, req: Req) -> None:
        self.validate(req)
        if req.return_logprob and req.logprob_start == 0:
            req.input_token_logprobs.append((None, req.input_ids[0]))
            req.input_top_logprobs.append(None)
        self.sent[req.rid] = (0, 0, 0)
        self.waiting.append(req)

    def abort(self, rid: str, message: str = "aborted by the client") -> bool:
        for queue in (self.waiting, self.running, self.rotary):
            for r in queue:
                if r.rid == rid:
                    queue.remove(r)
                    self.finish(r, FinishReason("abort", message=message))
                    self._pending.append(report(r, self.sent))
                    return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.rotary or self._pending
                    or (self.overlap is not None and self.overlap.inflight is not None))

    def flush_cache(self) -> bool:
        """Drop the whole prefix cache; refused while requests are in flight (as in SGLang)."""
        if self.waiting or self.running or self.rotary or any(m.busy() for m in self.members):
            return False
        self.allocator.free(self.kv.cache.reset())
        return True

    def stats(self) -> LoadStats:
        info = self.kv.cache.size_info()
        used = self.allocator.capacity - self.allocator.num_free
        stats = LoadStats(len(self.running), len(self.waiting), used, self.allocator.capacity,
                          info.cached_pages, self.num_preemptions, decode_context_tokens=self.decode_context())
        for m in self.members:
            m.stats(stats)
        return stats

    def decode_context(self) -> float:
        """Mean tokens (prompt + output: its KV, wherever it lives) of the running requests that decode;
        0 with none. The `adaptive` planner keeps a sender's share at 0 while this is short, where
        remote rows cost more than their attention saves. Read on the load report's thread: a copy of
        the list, and token counts rather than kv_len, which a step in flight moves."""
        lens = [r.fill_len for r in list(self.running) if r.output_ids]
        return sum(lens) / len(lens) if lens else 0.0

    def check(self) -> None:
        """Assert every device and host page is in exactly one place (tests call this between steps)."""
        parked = self.allocator.parked if isinstance(self.allocator, HoldingAllocator) else frozenset[int]()
        holders = [r for m in self.members for r in m.holders()]
        self.kv.check(self.running + self.waiting + holders, {p: "in flight" for p in parked})
        for m in self.members:
            m.check()

    # ---- one iteration --------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        outputs, self._pending = self._pending, []
        self.policy.tick(self.clock())
        for m in self.members:
            m.begin()
        if self.overlap is not None and self.overlap.inflight is not None:
            return outputs + self.overlap.step()  # step t+1 launched (if it may be) as t lands
        entries, mode = self._schedule()
        if not entries and any([m.fence_arrivals() for m in self.members]):
            entries, mode = self._schedule()  # the step waits for those copies on the device
        for m in self.members:
            m.end()
        if entries:
            return outputs + self._run(entries, mode)
        if not self.running or self.copies_in_flight():
            return outputs  # nothing to run, or pages come free as copies land: wait, do not preempt
        # Part-prefilled requests hold every page and none can grow: free the policy's first
        # victim so the others progress (never spin on empty steps).
        newest = self.policy.victims(self.running)[0]
        if len(self.running) > 1 or self.waiting or self.rotary:
            self._preempt(newest)
        else:
            self.running.remove(newest)
            self.finish(newest, FinishReason("abort", message="out of KV cache memory"))
            outputs.append(report(newest, self.sent))
        return outputs

    # ---- the members' answers -------------------------------------------------------------------
    def ready(self, r: Req) -> bool:
        """Running request `r` may join this step's batch (no member has its KV on the way)."""
        return all(m.ready(r) for m in self.members)

    def copies_in_flight(self) -> bool:
        return any([m.copies_in_flight() for m in self.members])

    def pooled(self, r: Req) -> bool:
        """`r`'s KV takes (or, once admitted, will take) pages of this worker's pool."""
        return self.homes[r.home].pooled

    def pages_needed(self, r: Req, tokens: int) -> int:
        """Pool pages `r` lacks for `tokens` tokens of KV (0 if its KV lives elsewhere)."""
        return max(self.kv.pages_for(tokens) - len(r.pages), 0) if self.pooled(r) else 0

    def needs_landed_state(self, reqs: list[Req]) -> bool:
        """Some member needs a decode step over `reqs` scheduled and landed with no step in flight."""
        return any(m.needs_landed_state(reqs) for m in self.members)

    def plan(self, entries: list[Entry], ahead: int = 0) -> list[Entry]:
        """The step's rows once its remote rows are planned on the executor (rows it drops are
        recomputed later). Raises ExecutorLost."""
        entries = self.remote_rows.plan(entries, ahead)
        self.forward_rows += len(entries)  # every forward's rows pass here (the step profile's "rows")
        return entries

    def _run(self, entries: list[Entry], mode: ForwardMode) -> list[StepOutput]:
        """One forward of the scheduled entries: landed at once, or launched to land next step."""
        try:
            entries = self.plan(entries)
            if not entries:
                return []
            batch = build_batch(entries, mode, self.page_size, self.runner.device)
            if self.overlap is not None and self.overlap.may_launch(entries, mode):
                self.overlap.launch(entries, batch)
                return []
            logits = self.runner.forward(batch)
        except ExecutorLost as e:
            # Nothing of this step is kept: local rows redo it next step (their KV writes are
            # idempotent and kv_len did not move); remote rows are recomputed from their tokens.
            self.remote_rows.lose_executor(str(e))
            return []
        return self._land(entries, logits)

    def _schedule(self) -> tuple[list[Entry], ForwardMode]:
        entries: list[Entry] = []
        budget = self.chunk
        # 1. requests part-way through prefill continue first
        for r in self.running:
            if r.prefilled or budget <= 0 or not self.ready(r):
                continue
            n = min(r.fill_len - r.kv_len, budget)
            if not self.kv.can_grow(r, r.kv_len + n):
                continue
            self.kv.grow(r, r.kv_len + n)
            entries.append(self._entry(r, n))
            budget -= n
        # 2. admit waiting requests and resume rotary ones, in the policy's order, while the token
        # budget, slots, KV headroom and rotation budget last (the policy may rotate some out)
        if self.policy.wants_fit or any(m.wants_deficit for m in self.members):
            self.deficit = self._kv_deficit()
        self.policy.begin(self.clock(), self.deficit == 0)
        reserve = self.decode_reserve()
        for r in self.policy.candidates(self.waiting, self.rotary, self.kv.cache):
            if budget <= 0:
                break
            if not self.homes[r.home].may_admit(r):
                continue  # e.g. its KV is still on the way out: a copy back would race it
            if self.kv.pages_for(r.fill_len) > self.allocator.capacity:
                # Grown past the whole pool (its KV was elsewhere, or it was preempted late): it can
                # never run here again, and it must not block the queue.
                (self.rotary if r in self.rotary else self.waiting).remove(r)
                self._abort_too_long(r)
                continue
            got = self._try_admit(r, budget, reserve)
            if got is None and any(m.make_room_for(r, {id(e.req) for e in entries}) for m in self.members):
                reserve = self.decode_reserve()
                got = self._try_admit(r, budget, reserve)
            if got is None:
                break
            if got:
                entries.append(self._entry(r, got))
                budget -= got
            else:  # a resumed decoder: keep its next token's page for it (none if its KV is elsewhere)
                reserve += self.pages_needed(r, r.kv_len + 1)
        # 3. decoding requests: alone (DECODE) or riding along a prefill (EXTEND)
        prefill_reqs = {id(e.req) for e in entries}
        decoders = [r for r in self.running if r.prefilled and id(r) not in prefill_reqs and self.ready(r)]
        self.remote_rows.choose(decoders)
        decoders = self._make_room(decoders, protect=prefill_reqs)
        entries.extend(self._entry(r, 1) for r in decoders)
        mode = ForwardMode.EXTEND if prefill_reqs else ForwardMode.DECODE
        return entries, mode

    def _try_admit(self, r: Req, budget: int, reserve: int) -> int | None:
        """Admit a candidate through the residency of its home: the tokens it computes this step (0:
        it decodes with the others, or waits for its KV), or None (nothing changed) if it does not fit."""
        if len(self.running) >= self.max_running:
            return None
        return self.homes[r.home].admit(r, budget, reserve)

    def start_running(self, r: Req, queue: list[Req]) -> None:
        """`r` leaves `queue` (waiting or rotary) for the running batch."""
        queue.remove(r)
        r.start_running(self.clock())
        self.running.append(r)

    def decode_reserve(self) -> int:
        """Pages kept free for running requests' next tokens, so admission does not cause an
        immediate preemption (a short horizon, not the whole max_new_tokens)."""
        horizon = 4 * self.page_size
        total = 0
        for r in self.running:
            left = r.sampling.max_new_tokens - len(r.output_ids)
            total += self.pages_needed(r, r.kv_len + min(left, horizon) + 1)
        return total

    def _kv_deficit(self) -> int:
        """Pages by which every running, rotary and waiting request's KV (and its next token) exceeds
        the pool; 0 if it all fits. Stops counting past twice the pool (then it is at least the pool),
        so a long queue costs no more than the requests that two pools hold."""
        cap = self.allocator.capacity
        demand = 0
        for queue in (self.running, self.rotary, self.waiting):
            for r in queue:
                if self.pooled(r):
                    demand += self.kv.pages_for(r.fill_len + 1)
                    if demand > 2 * cap:
                        return demand - cap
        return max(demand - cap, 0)

    def _make_room(self, decoders: list[Req], protect: set[int]) -> list[Req]:
        """Grow each decoder by one token, preempting the latest arrivals when pages run out."""
        kept = [r for r in decoders if not self.pooled(r)]  # their KV grows elsewhere (an executor)
        # Grown in the reverse of the policy's victim order: the first victims grow last.
        decoders = self.policy.victims([r for r in decoders if self.pooled(r)])[::-1]
        coming = sum(m.pages_coming() for m in self.members)
        while decoders:
            r = decoders.pop(0)
            while not self.kv.can_grow(r, r.kv_len + 1):
                short = self.kv.pages_for(r.kv_len + 1) - len(r.pages) - self.kv.available_pages
                if short <= coming:
                    # Pages come free as copies in flight land (a victim just rotated out): it sits
                    # out this step rather than push out another request the pool does not need.
                    coming -= short
                    break
                victim = decoders.pop() if decoders else None
                if victim is None:
                    others = [x for x in self.running if x is not r and id(x) not in protect and x not in kept
                              and self.pooled(x) and self.ready(x)]
                    victim = self.policy.victims(others)[0] if others else r
                alone = victim is r and len(self.running) == 1
                if alone and self.copies_in_flight():
                    break  # pages still under copies in flight: it grows once they land
                if alone:
                    # Alone and still out of pages: it can never fit, so fail it explicitly.
                    self.running.remove(r)
                    self._abort_too_long(r)
                    break
                self._preempt(victim)
                if victim is r:
                    break
            else:
                self.kv.grow(r, r.kv_len + 1)
                kept.append(r)
        return kept

    def _abort_too_long(self, r: Req) -> None:
        self.finish(r, FinishReason("abort", message=(
            f"out of KV cache memory: the request needs more than {self.max_total_tokens} tokens")))
        self._pending.append(report(r, self.sent))

    def _preempt(self, r: Req) -> None:
        if any(m.park(r) for m in self.members):
            return  # its KV kept elsewhere (rotated out to host memory)
        logger.debug("preempting %s (kv_len=%d)", r.rid, r.kv_len)
        self.running.remove(r)
        self.release_kv(r)
        self.requeue(r)

    def requeue(self, r: Req) -> None:
        """A preempted request (it holds no KV) goes back to the queue's head, to be recomputed."""
        r.status = ReqStatus.WAITING
        r.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, r)

    def _entry(self, r: Req, n: int) -> Entry:
        start, end = r.kv_len, r.kv_len + n
        pos: list[int] = []
        if r.return_logprob:
            # Input entry p is the logprob of input_ids[p] given the tokens before: logits at p - 1.
            first = max(r.logprob_start + len(r.input_token_logprobs), 1)
            pos.extend(range(max(first - 1, start), min(len(r.input_ids) - 1, end)))
        sample = end == r.fill_len and not (r.sampling.max_new_tokens == 0 and not r.output_ids)
        return Entry(r, n, pos, sample)

    # ---- results --------------------------------------------------------------------------------
    def draw(self, reqs: list[Req], logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Sample one token per row of `logits` (masked in place for constrained rows)."""
        rows = self.grammar.mask(reqs, logits, rows)
        return self.sampler.sample(logits, self.sampler.batch(rows))

    def _land(self, entries: list[Entry], logits: torch.Tensor) -> list[StepOutput]:
        """The results of a forward that lands at once: prompt logprobs, sampled tokens, finishes."""
        row = 0
        sample_rows: list[int] = []
        sample_reqs: list[Req] = []
        for e in entries:
            r = e.req
            row += record_prompt_logprobs(e, logits, row)
            r.kv_len += e.extend
            if e.extend > 1:
                self.prefill_tokens += e.extend
                # Publish finished prompt pages now so concurrent requests can share them.
                self.kv.cache_prefix(r)
            if e.sample:
                sample_rows.append(row)
                sample_reqs.append(r)
                row += 1
        if sample_rows:
            rows_logits = logits[sample_rows]  # a copy: masked in place below
            tokens = self.draw(sample_reqs, rows_logits, [self.sample_row(r) for r in sample_reqs]).tolist()
            # (landed) remote rows let through by a watchdog carry no attention results: drop them
            forged = self.remote_rows.forged(self.remote_rows.transport(sample_reqs))
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
        outputs: list[StepOutput] = []
        now = self.clock()
        for r in reqs:
            queued = r.status is ReqStatus.WAITING
            if r.output_ids:
                r.last_token_time = now
                if r.first_token_time is None and not queued:
                    r.first_token_time = now
            done = queued or r.kv_len >= r.fill_len - 1  # mid-prefill chunks cannot finish
            reason = check_finish(r, self.eos_ids, self.runner.context_len, self.decode_fn) if done else None
            if reason is not None:
                (self.waiting if queued else self.running).remove(r)
                self.finish(r, reason)
            if reason is not None or has_new(r, self.sent):
                outputs.append(report(r, self.sent))
        return outputs

    def sample_row(self, r: Req, ahead: int = 0) -> SampleRow:
        """How to sample request r's next token, `ahead` tokens after those already landed."""
        p = r.sampling
        n_out = len(r.output_ids) + ahead
        banned: list[int] = []
        if n_out < p.min_new_tokens:
            banned = sorted(set(self.eos_ids) | set(p.stop_token_ids or []))
        if p.has_penalties and r.penalty_slot < 0:
            r.penalty_slot = self.sampler.penalties.acquire(r.input_ids, r.output_ids, p.frequency_penalty,
                                                             p.presence_penalty)
        return SampleRow(p, n_out, banned, r.penalty_slot)

    def release_kv(self, r: Req) -> None:
        """`r` lets go of its KV wherever it lives: each member gives back what it holds, local pages
        last (full ones published to the prefix cache)."""
        for m in self.members:
            m.release(r)

    def drop_penalties(self, r: Req) -> None:
        """Free r's penalty slot: at its finish, or when a token the device's statistics counted is
        dropped (the slot is rebuilt from its real tokens when it samples again)."""
        if r.penalty_slot >= 0:
            self.sampler.penalties.release(r.penalty_slot)
            r.penalty_slot = -1

    def finish(self, r: Req, reason: FinishReason) -> None:
        r.status = ReqStatus.FINISHED
        r.finish_reason = reason
        self.release_kv(r)
        self.drop_penalties(r)
