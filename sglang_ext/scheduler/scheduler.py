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
from sglang_ext.kvcache.base import NoPrefixCache, PrefixCache
from sglang_ext.kvcache.radix_cache import RadixCache
from sglang_ext.offload.remote import ExecutorLost
from sglang_ext.offload.sender import RemoteSender
from sglang_ext.sampling.sampler import Sampler
from sglang_ext.scheduler.admission import Admission
from sglang_ext.scheduler.batch_builder import Entry, build_batch
from sglang_ext.scheduler.grammar_rows import GrammarRows
from sglang_ext.scheduler.handoff import Handoff
from sglang_ext.scheduler.kv_manager import KVManager
from sglang_ext.scheduler.local import LocalPages
from sglang_ext.scheduler.member import Member
from sglang_ext.scheduler.output import DecodeFn, LoadStats, StepOutput, report
from sglang_ext.scheduler.overlap import Overlap
from sglang_ext.scheduler.policy import SchedulePolicy, make_policy
from sglang_ext.scheduler.remote_residency import RemoteResidency
from sglang_ext.scheduler.request import FinishReason, Req, ReqStatus, check_request
from sglang_ext.scheduler.results import Results
from sglang_ext.scheduler.rotary import Rotation
from sglang_ext.scheduler.token_table import TokenTable
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
        remote_sender: RemoteSender | None = None,
        overlap: bool = False,
    ) -> None:
        self.args = args
        self.runner = runner
        self.page_size = page_size
        self.eos_ids = eos_ids
        self.decode_fn = decode_fn
        self.vocab_size = vocab_size
        self.allocator = Rotation.allocator(args, runner.num_pages)
        cache: PrefixCache = NoPrefixCache(page_size) if args.disable_radix_cache else RadixCache(page_size)
        self.kv = KVManager(self.allocator, cache, page_size)
        self.policy: SchedulePolicy = make_policy(args.schedule_policy, args)
        self.clock: Callable[[], float] = time.monotonic  # VLT and rotation timing; tests inject one
        self.chunk = args.prefill_budget
        self.max_running = args.resolved_max_running_requests
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.rotary: list[Req] = []  # home HOST: KV in host memory (preemption_mode=rotate)
        self._pending: list[StepOutput] = []  # outputs produced outside a forward (aborts)
        # rid -> (tokens, in-logprobs, out-logprobs) reported so far (here, or by a prefill worker: Handoff)
        self.sent: dict[str, tuple[int, int, int]] = {}
        self.num_preemptions = 0
        self.prefill_tokens = 0  # prompt tokens forwarded in chunks of more than one (a step profile's)
        self.forward_rows = 0  # requests in the forwards launched so far (a step profile's)
        self.forward_context = 0  # ... and the KV tokens their rows attend over (context after the forward)
        self._count_context = args.step_log_interval_s > 0  # a sum over the rows: only for the step profile
        # ... of those rows, the prompt chunks (more than one token): how many, their context after the forward
        # and their causal query-key pairs (a chunk after a prefix attends over it: what its attention costs)
        self.prefill_chunks = 0
        self.prefill_chunk_context = 0
        self.prefill_pairs = 0
        self.remote_forward_rows = 0  # ... of which remote rows
        self.deficit = 0  # pages by which all requests' KV exceeds the pool (0: everything fits), per iteration
        self.sampler = Sampler(vocab_size, runner.device, args.random_seed, top_k_window=args.sampling_top_k_window)
        # members (member.py): local pages last, as every release ends there
        self.rot = Rotation.make(self, args)  # None unless preemption_mode is rotate
        self.remote_residency = RemoteResidency(self)
        self.handoff = Handoff(self)
        self.grammar = GrammarRows(vocab_size, runner.device, not args.disable_grammar_overlap)
        self.local = LocalPages(self)
        table = TokenTable(runner.device) if overlap else None  # the overlap loop's input ids
        self.results = Results(self, self.sampler, self.grammar, self.remote_residency)
        self.members: list[Member] = [m for m in (self.rot, self.remote_residency, self.handoff, self.grammar,
                                                  table, self.local) if m]
        self.admission = Admission(self, self.members, self._abort_too_long)
        self.homes = self.admission.homes
        self.overlap = Overlap(self, table) if table is not None else None
        self.remote_residency.set_sender(remote_sender)

    # ---- requests in and out ------------------------------------------------------------------
    @property
    def max_total_tokens(self) -> int:
        return self.allocator.capacity * self.page_size

    @property
    def remote_sender(self) -> RemoteSender | None:
        return self.remote_residency.sender

    @property
    def overlapped_steps(self) -> int:
        """Decode steps launched before their predecessor landed."""
        return self.overlap.overlapped_steps if self.overlap is not None else 0

    @property
    def not_overlapped(self) -> dict[str, int]:
        """Why steps in flight were not followed by an overlapped one, counted by reason (overlap.py)."""
        return dict(self.overlap.not_overlapped) if self.overlap is not None else {}

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
        holders = [r for m in self.members for r in m.holders()]
        self.kv.check(self.running + self.waiting + holders, {p: "in flight" for p in self.allocator.parked})
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

    def needs_landed_state(self, reqs: list[Req]) -> bool:
        """Some member needs a decode step over `reqs` scheduled and landed with no step in flight."""
        return any(m.needs_landed_state(reqs) for m in self.members)

    def plan(self, entries: list[Entry], ahead: int = 0) -> list[Entry]:
        """The step's rows once its remote rows are planned on the executor (rows it drops are
        recomputed later). Raises ExecutorLost."""
        entries = self.remote_residency.plan(entries, ahead)
        self.forward_rows += len(entries)  # every forward's rows pass here (the step profile's "rows")
        if self._count_context:  # one pass over the rows, for the step profile only
            for e in entries:
                end = e.req.kv_len + e.extend
                self.forward_context += end
                if e.extend > 1:
                    self.prefill_chunks += 1
                    self.prefill_chunk_context += end
                    self.prefill_pairs += e.extend * e.req.kv_len + e.extend * (e.extend + 1) // 2
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
            self.remote_residency.lose_executor(str(e))
            return []
        return self.results.land(entries, logits)

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
            entries.append(Entry.of(r, n))
            budget -= n
        # 2. admit waiting requests and resume rotary ones, in the policy's order (admission.py)
        self.admission.admit(entries, budget)
        # 3. decoding requests: alone (DECODE) or riding along a prefill (EXTEND)
        prefill_reqs = {id(e.req) for e in entries}
        decoders = [r for r in self.running if r.prefilled and id(r) not in prefill_reqs and self.ready(r)]
        self.remote_residency.choose(decoders)
        decoders = self._make_room(decoders, protect=prefill_reqs)
        entries.extend(Entry.of(r, 1) for r in decoders)
        mode = ForwardMode.EXTEND if prefill_reqs else ForwardMode.DECODE
        return entries, mode

    def start_running(self, r: Req, queue: list[Req]) -> None:
        """`r` leaves `queue` (waiting or rotary) for the running batch."""
        queue.remove(r)
        r.start_running()
        self.running.append(r)

    def decode_reserve(self) -> int:
        """Pages kept free for running requests' next tokens (`Admission.decode_reserve`)."""
        return self.admission.decode_reserve()

    def _make_room(self, decoders: list[Req], protect: set[int]) -> list[Req]:
        """Grow each decoder by one token, preempting the latest arrivals when pages run out."""
        kept = [r for r in decoders if not self.admission.pooled(r)]  # their KV grows elsewhere (an executor)
        # Grown in the reverse of the policy's victim order: the first victims grow last.
        decoders = self.policy.victims([r for r in decoders if self.admission.pooled(r)])[::-1]
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
                              and self.admission.pooled(x) and self.ready(x)]
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

    # ---- leaving: releases and finishes (what a forward produces: results.py) -----------------
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
