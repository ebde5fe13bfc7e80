"""Continuous batching with chunked prefill, prefix reuse and preemption.

Each `step()` is one forward:
  * if any request needs prefill, an EXTEND batch: prefill chunks within `chunked_prefill_size`
    tokens, with every decoding request riding along as a one-token extend (so long prompts never
    stall running streams);
  * otherwise a DECODE batch of all running requests (the shape CUDA graphs capture).
When KV pages run out, running requests are preempted in the policy's victim order (fcfs: the most
recently arrived first): their computed pages go to the prefix cache and they re-enter the waiting
queue (recompute), or with `preemption_mode=rotate` their KV goes to host memory and they wait as
rotary requests to be resumed (`rotary.py`). Who is admitted or resumed next, who is preempted and
whether anyone is rotated out voluntarily are the policy's answers (`policy.py`).

With remote attention (`offload`), a share of the decoding requests keep their KV on an attention
executor: they need no local pages, are never preemption victims, and ride in every decode batch
as remote rows. If the executor drops one or is lost, it is recomputed like a preempted request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from sglang_ext.engine.forward_batch import ForwardBatch, ForwardMode
from sglang_ext.grammar.masks import GrammarMasks
from sglang_ext.kvcache.allocator import PageAllocator
from sglang_ext.kvcache.base import NoPrefixCache, PrefixCache
from sglang_ext.kvcache.holds import HoldingAllocator
from sglang_ext.kvcache.pool import KVPool
from sglang_ext.kvcache.radix_cache import RadixCache
from sglang_ext.offload.remote import ExecutorLost
from sglang_ext.offload.sender import Offloader
from sglang_ext.sampling.batch import SampleRow
from sglang_ext.sampling.params import InvalidRequest
from sglang_ext.sampling.sampler import Sampler, logprobs_of
from sglang_ext.scheduler.admission import Admission
from sglang_ext.scheduler.batch_builder import Entry, build_batch
from sglang_ext.scheduler.handoff import Handoff
from sglang_ext.scheduler.kv_manager import KVManager
from sglang_ext.scheduler.output import DecodeFn, StepOutput, check_finish
from sglang_ext.scheduler.policy import make_policy
from sglang_ext.scheduler.remote_rows import RemoteRows
from sglang_ext.scheduler.request import FinishReason, Req, ReqStatus
from sglang_ext.scheduler.rotary import RotaryRows, make_rotation
from sglang_ext.server_args import ServerArgs

logger = logging.getLogger(__name__)


class Runner(Protocol):
    device: torch.device
    num_pages: int
    context_len: int
    pool: KVPool

    def forward(self, batch: ForwardBatch) -> torch.Tensor: ...


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


class Scheduler(Admission, RotaryRows, RemoteRows, Handoff):
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
        self.policy = make_policy(args.schedule_policy, args)
        self.clock: Callable[[], float] = time.monotonic  # VLT and rotation timing; tests inject one
        self.chunk = args.resolved_chunked_prefill_size or args.max_prefill_tokens
        self.max_running = args.max_running_requests or 256
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.rotary: list[Req] = []  # KV in host memory (preemption_mode=rotate)
        self.handing: dict[str, Req] = {}  # disaggregation: prefilled, pages held while their KV is sent
        self.rot = make_rotation(args, runner.pool) if rotate else None
        self._pending: list[StepOutput] = []  # outputs produced outside a forward (aborts)
        self._sent: dict[str, tuple[int, int, int]] = {}  # rid -> (tokens, in-logprobs, out-logprobs) sent
        self.num_preemptions = 0
        self.prefill_tokens = 0  # prompt tokens forwarded in chunks of more than one (a step profile's)
        self.forward_rows = 0  # requests in the forwards launched so far (a step profile's)
        self.remote_forward_rows = 0  # ... of which remote rows
        self.sampler = Sampler(vocab_size, runner.device, args.random_seed)
        self.grammar_masks = GrammarMasks(vocab_size, runner.device)  # imports xgrammar only when used
        self.offload = None
        self.set_offload(offload)

    # ---- requests in and out ------------------------------------------------------------------
    @property
    def max_total_tokens(self) -> int:
        return self.allocator.capacity * self.page_size

    def validate(self, req: Req) -> None:
        if not req.input_ids:
            raise InvalidRequest("the prompt is empty: give text or input_ids with at least one token")
        if any(not 0 <= t < self.vocab_size for t in req.input_ids):
            raise InvalidRequest(f"input_ids must be token ids in [0, {self.vocab_size})")
        req.sampling.validate(self.vocab_size)
        n = len(req.input_ids)
        ctx = self.runner.context_len
        if n >= ctx:
            raise InvalidRequest(f"the prompt has {n} tokens; this model's context length is {ctx}")
        if n + 1 > self.max_total_tokens:
            raise InvalidRequest(f"the prompt has {n} tokens; the KV cache holds {self.max_total_tokens}")
        if req.top_logprobs_num < 0 or req.top_logprobs_num > 64:
            raise InvalidRequest(f"top_logprobs_num must be in [0, 64], got {req.top_logprobs_num}")

    def add_request(self, req: Req) -> None:
        self.validate(req)
        if req.return_logprob and req.logprob_start == 0:
            req.input_token_logprobs.append((None, req.input_ids[0]))
            req.input_top_logprobs.append(None)
        self._sent[req.rid] = (0, 0, 0)
        self.waiting.append(req)

    def abort(self, rid: str, message: str = "aborted by the client") -> bool:
        for queue in (self.waiting, self.running, self.rotary):
            for r in queue:
                if r.rid == rid:
                    queue.remove(r)
                    self._finish(r, FinishReason("abort", message=message))
                    self._pending.append(self._output(r))
                    return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.rotary or self._pending)

    def flush_cache(self) -> bool:
        """Drop the whole prefix cache; refused while requests are in flight (as in SGLang)."""
        if self.waiting or self.running or self.rotary or self.handing:
            return False
        if self.rot is not None:
            self._rot_poll()
            if self.rot.inflight:
                return False  # rotation copies still read cache pages
        self.allocator.free(self.kv.cache.reset())
        return True

    def stats(self) -> LoadStats:
        info = self.kv.cache.size_info()
        used = self.allocator.capacity - self.allocator.num_free
        stats = LoadStats(len(self.running), len(self.waiting), used, self.allocator.capacity,
                          info.cached_pages, self.num_preemptions)
        if (rot := self.rot) is not None:
            stats.num_rotary, stats.host_used_bytes = len(self.rotary), rot.host.used_bytes
            stats.host_total_bytes = rot.host.allocator.capacity * rot.engine.page_bytes
            stats.rotations_out, stats.rotations_in = rot.rotations_out, rot.rotations_in
            stats.rotation_bytes_out, stats.rotation_bytes_in = rot.engine.bytes_out, rot.engine.bytes_in
            stats.unhidden_iterations = rot.unhidden_iterations
        return stats

    def check(self) -> None:
        """Assert every device and host page is in exactly one place (tests call this between steps)."""
        parked = getattr(self.allocator, "parked", frozenset())
        self.kv.check(self.running + self.waiting + list(self.handing.values()), {p: "in flight" for p in parked})
        self._rot_check()

    # ---- one iteration --------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        outputs, self._pending = self._pending, []
        self._rot_begin()
        entries, mode = self._schedule()
        if not entries and self._fence_arrivals():
            entries, mode = self._schedule()  # the step waits for those copies on the device
        self._rot_end()
        if not entries and self.running and self._copies_in_flight():
            return outputs  # pages come free as rotation copies land: wait, do not preempt
        if not entries and self.running:
            # Part-prefilled requests hold every page and none can grow: free the policy's first
            # victim so the others progress (never spin on empty steps).
            newest = self.policy.victims(self.running)[0]
            if len(self.running) > 1 or self.waiting or self.rotary:
                self._preempt(newest)
            else:
                self.running.remove(newest)
                self._finish(newest, FinishReason("abort", message="out of KV cache memory"))
                outputs.append(self._output(newest))
            return outputs
        if not entries:
            return outputs
        return outputs + self._run(entries, mode)

    def _run(self, entries: list[Entry], mode: ForwardMode) -> list[StepOutput]:
        """One forward of the scheduled entries and its results (`OverlapScheduler` defers them)."""
        try:
            entries = self._plan_remote(entries)
            if not entries:
                return []
            batch = build_batch(entries, mode, self.page_size, self.runner.device)
            logits = self.runner.forward(batch)
        except ExecutorLost as e:
            # Nothing of this step is kept: local rows redo it next step (their KV writes are
            # idempotent and kv_len did not move); remote rows are recomputed from their tokens.
            self._lose_executor(str(e))
            return []
        return self._process(entries, logits)

    def _schedule(self) -> tuple[list[Entry], ForwardMode]:
        entries: list[Entry] = []
        budget = self.chunk
        # 1. requests part-way through prefill continue first
        for r in self.running:
            if r.prefilled or budget <= 0 or not self._ready(r):
                continue
            n = min(r.fill_len - r.kv_len, budget)
            if not self.kv.can_grow(r, r.kv_len + n):
                continue
            self.kv.grow(r, r.kv_len + n)
            entries.append(self._entry(r, n))
            budget -= n
        # 2. admit waiting requests and resume rotary ones, in the policy's order, while the token
        # budget, slots, KV headroom and rotation budget last (the policy may rotate some out)
        if self.rot is not None or self.policy.wants_fit:
            self._deficit = self._kv_deficit()
        self.policy.begin(self.clock(), self._deficit == 0)
        reserve = self._decode_reserve()
        for r in self.policy.candidates(self.waiting, self.rotary, self.kv.cache):
            if budget <= 0:
                break
            if r.status is ReqStatus.ROTARY and any(not f.landed for f in r.transfers):
                continue  # its KV is still on the way out: a copy back would race it
            if self.kv.pages_for(r.fill_len) > self.allocator.capacity:
                # Grown past the whole pool (its KV was elsewhere, or it was preempted late): it can
                # never run here again, and it must not block the queue.
                (self.rotary if r.status is ReqStatus.ROTARY else self.waiting).remove(r)
                self._finish(r, FinishReason("abort", message=(
                    f"out of KV cache memory: the request needs more than {self.max_total_tokens} tokens")))
                self._pending.append(self._output(r))
                continue
            n = self._try_admit(r, budget, reserve)
            if n is None and self._rotate_for(r, protect={id(e.req) for e in entries}):
                reserve = self._decode_reserve()
                n = self._try_admit(r, budget, reserve)
            if n is None:
                break
            if n:
                entries.append(self._entry(r, n))
                budget -= n
            elif r.remote is None:  # a resumed decoder: keep its next token's page for it (a remote
                reserve += self.kv.pages_for(r.kv_len + 1) - len(r.pages)  # one grows on the executor)
        # 3. decoding requests: alone (DECODE) or riding along a prefill (EXTEND)
        prefill_reqs = {id(e.req) for e in entries}
        decoders = [r for r in self.running if r.prefilled and id(r) not in prefill_reqs and self._ready(r)]
        if self.offload is not None:
            for r in self.offload.choose(decoders):
                self._drop_local_kv(r)
        decoders = self._make_room(decoders, protect=prefill_reqs)
        entries.extend(self._entry(r, 1) for r in decoders)
        mode = ForwardMode.EXTEND if prefill_reqs else ForwardMode.DECODE
        return entries, mode

    def _make_room(self, decoders: list[Req], protect: set[int]) -> list[Req]:
        """Grow each decoder by one token, preempting the latest arrivals when pages run out."""
        kept = [r for r in decoders if r.remote is not None]  # their KV grows on the executor
        # Grown in the reverse of the policy's victim order: the first victims grow last.
        decoders = self.policy.victims([r for r in decoders if r.remote is None])[::-1]
        coming = self._pages_coming()
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
                              and x.remote is None and self._ready(x)]
                    victim = self.policy.victims(others)[0] if others else r
                if victim is r and len(self.running) == 1 and self._copies_in_flight():
                    break  # pages still under rotation copies: it grows once they land
                if victim is r and len(self.running) == 1:
                    # Alone and still out of pages: it can never fit, so fail it explicitly.
                    self.running.remove(r)
                    self._finish(r, FinishReason("abort", message=(
                        f"out of KV cache memory: the request needs more than {self.max_total_tokens} tokens")))
                    self._pending.append(self._output(r))
                    break
                self._preempt(victim)
                if victim is r:
                    break
            else:
                self.kv.grow(r, r.kv_len + 1)
                kept.append(r)
        return kept

    def _preempt(self, r: Req) -> None:
        if self._rotate_out(r, forced=True):
            return
        logger.debug("preempting %s (kv_len=%d)", r.rid, r.kv_len)
        self.running.remove(r)
        self._release_kv(r)
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
    def _process(self, entries: list[Entry], logits: torch.Tensor) -> list[StepOutput]:
        row = 0
        sample_rows: list[int] = []
        sample_reqs: list[Req] = []
        for e in entries:
            r = e.req
            n_in = len(e.logprob_positions)
            if n_in:
                targets = torch.tensor([r.input_ids[q + 1] for q in e.logprob_positions], device=logits.device)
                lps, tops = logprobs_of(logits[row : row + n_in], targets, r.top_logprobs_num)
                for i, q in enumerate(e.logprob_positions):
                    r.input_token_logprobs.append((lps[i], r.input_ids[q + 1]))
                    r.input_top_logprobs.append(tops[i] if tops else None)
                row += n_in
            r.kv_len += e.extend
            if e.extend > 1:
                self.prefill_tokens += e.extend
                # Publish finished prompt pages now so concurrent requests can share them.
                self._cache_prefix(r)
            if e.sample:
                sample_rows.append(row)
                sample_reqs.append(r)
                row += 1
        if sample_rows:
            rows_logits = logits[sample_rows]  # a copy: masked in place below
            rows = [self._sample_row(r) for r in sample_reqs]
            if any(r.grammar is not None for r in sample_reqs):
                rows = self.grammar_masks.constrain(rows_logits, [r.grammar for r in sample_reqs], rows)
            tokens = self.sampler.sample(rows_logits, self.sampler.batch(rows)).tolist()
            # (landed) remote rows let through by a watchdog carry no attention results: drop them
            forged = self._forged([r for r in sample_reqs if r.remote is not None],
                                  self.offload.remote if self.offload is not None else None)
            if forged:
                for r in sample_reqs:
                    if id(r) in forged:
                        self._drop_forged(r)
                keep = [i for i, r in enumerate(sample_reqs) if id(r) not in forged]
                sample_reqs, tokens = [sample_reqs[i] for i in keep], [tokens[i] for i in keep]
                rows_logits = rows_logits[keep]
                entries = [e for e in entries if id(e.req) not in forged]
            want_lp = [i for i, r in enumerate(sample_reqs) if r.return_logprob]
            if want_lp:
                top_n = max(sample_reqs[i].top_logprobs_num for i in want_lp)
                lps, tops = logprobs_of(rows_logits[want_lp], torch.tensor([tokens[i] for i in want_lp],
                                                                           device=logits.device), top_n)
                for j, i in enumerate(want_lp):
                    r = sample_reqs[i]
                    r.output_token_logprobs.append((lps[j], tokens[i]))
                    r.output_top_logprobs.append(tops[j][: r.top_logprobs_num] if tops else [])
            for r, t in zip(sample_reqs, tokens, strict=True):
                r.output_ids.append(t)
                if r.grammar is not None:
                    r.grammar.accept(t)
        return self._finish_or_report([e.req for e in entries])

    def _finish_or_report(self, reqs: list[Req]) -> list[StepOutput]:
        """Apply the finish rules to requests whose forward just landed; report what is new."""
        outputs: list[StepOutput] = []
        now = self.clock()
        for r in reqs:
            if r.output_ids:
                r.last_token_time = now
                if r.first_token_time is None:
                    r.first_token_time = now
            done = r.kv_len >= r.fill_len - 1  # mid-prefill chunks cannot finish
            reason = check_finish(r, self.eos_ids, self.runner.context_len, self.decode_fn) if done else None
            if reason is not None:
                self.running.remove(r)
                self._finish(r, reason)
            if reason is not None or self._has_new(r):
                outputs.append(self._output(r))
        return outputs

    def _sample_row(self, r: Req, ahead: int = 0) -> SampleRow:
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

    def _finish(self, r: Req, reason: FinishReason) -> None:
        r.status = ReqStatus.FINISHED
        r.finish_reason = reason
        self._release_kv(r)
        if r.penalty_slot >= 0:
            self.sampler.penalties.release(r.penalty_slot)
            r.penalty_slot = -1

    def _has_new(self, r: Req) -> bool:
        sent = self._sent.get(r.rid, (0, 0, 0))
        return len(r.output_ids) > sent[0] or len(r.input_token_logprobs) > sent[1]

    def _output(self, r: Req) -> StepOutput:
        t0, i0, o0 = self._sent.get(r.rid, (0, 0, 0))
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
            self._sent.pop(r.rid, None)
        else:
            self._sent[r.rid] = (len(r.output_ids), len(r.input_token_logprobs), len(r.output_token_logprobs))
        return out
