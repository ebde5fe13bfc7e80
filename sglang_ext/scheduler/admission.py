"""Admission of one candidate (a waiting request, or a rotary one to resume) and the voluntary
rotations a policy asks for to make room. Part of the scheduler (`scheduler.py`); kept apart so the
batching loop stays short.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sglang_ext.scheduler.request import Req, ReqStatus
from sglang_ext.scheduler.rotary import RotaryRows


class Admission(RotaryRows):
    max_running: int
    chunk: int
    _admit_remote: Callable[[Req], int]  # RemoteRows'

    def _decode_reserve(self) -> int:
        """Pages kept free for running requests' next tokens, so admission does not cause an
        immediate preemption (a short horizon, not the whole max_new_tokens)."""
        horizon = 4 * self.page_size
        total = 0
        for r in self.running:
            if r.remote is not None:
                continue
            left = r.sampling.max_new_tokens - len(r.output_ids)
            total += max(self.kv.pages_for(r.kv_len + min(left, horizon) + 1) - len(r.pages), 0)
        return total

    def _try_admit(self, r: Req, budget: int, reserve: int) -> int | None:
        """Admit a waiting request or resume a rotary one; the tokens it computes this step (0: a
        resumed decoder, which decodes with the others), or None (nothing changed) if it does not fit."""
        if len(self.running) >= self.max_running:
            return None
        if r.staged_kv is not None:
            return self._admit_staged(r, reserve)
        if r.remote is not None:  # its KV is on an executor already (Adrenaline placement)
            return self._admit_remote(r)
        rotary = r.status is ReqStatus.ROTARY
        self.kv.admit(r)
        if rotary:
            target, copy = self._resume_plan(r)
        else:
            target, copy = r.kv_len, 0
        decoding = rotary and bool(r.output_ids) and target == r.fill_len - 1
        n = 0 if decoding else min(r.fill_len - target, budget)
        need = self.kv.pages_for(target + max(n, 1)) - len(r.pages)
        assert self.rot is not None or not rotary
        if need + reserve > self.kv.available_pages or (copy and not self.rot.may_move(
                "in", copy * self.rot.engine.page_bytes)):  # type: ignore[union-attr]
            self.kv.release(r, keep_in_cache=False)
            return None
        if rotary:
            if not self._resume(r):
                return 0  # its KV is on the way in: it joins a batch once the copy has landed
        else:
            if r.num_preemptions == 0:
                r.cached_tokens = r.kv_len
            self.waiting.remove(r)
            r.start_running(self.clock())
            self.running.append(r)
        if n:
            self.kv.grow(r, r.kv_len + n)
        return n

    def _admit_staged(self, r: Req, reserve: int) -> int | None:
        """Admit a request whose prompt KV came from a prefill worker (disaggregation): the pages this
        worker's cache holds already are matched, the rest are copied in from the staged KV, and it
        decodes with the others this step (0), or None if its pages do not fit now."""
        self.kv.admit(r)
        n = len(r.input_ids)  # the prompt's KV; the first token (output_ids[0]) is decoded here
        need = self.kv.pages_for(n + 1) - len(r.pages)
        if need + reserve > self.kv.available_pages:
            self.kv.release(r, keep_in_cache=False)
            return None
        self.kv.grow(r, n)
        lo, hi = r.cached_pages, self.kv.pages_for(n)
        if hi > lo:
            pool = self.runner.pool
            idx = torch.tensor(r.pages[lo:hi], dtype=torch.int64, device=pool.device)
            pool.data[idx] = r.staged_kv[lo:hi].to(pool.device, pool.data.dtype)
        r.kv_len, r.staged_kv = n, None
        self.waiting.remove(r)
        r.start_running(self.clock())
        self.running.append(r)
        return 0

    def _rotate_for(self, cand: Req, protect: set[int]) -> bool:
        """Rotate out the policy's voluntary victims (not in this step's batch) until `cand` could
        fit; True if any went. Pages that copies in flight will give back count as room: a victim's
        pages come free only when its copy lands (next iteration on a GPU), so without them every
        victim in the list would go for one candidate."""
        if self.rot is None:
            return False
        victims = self.policy.make_room_for(
            cand, [r for r in self.running if r.remote is None and id(r) not in protect and self._ready(r)])
        if not victims:
            return False
        hit = self.kv.cache.match_prefix(cand.fill_ids[: self.kv.match_limit(cand)]).num_tokens
        have = max(hit, cand.host_len)
        need = self.kv.pages_for(min(cand.fill_len, have + self.chunk)) - hit // self.page_size

        def short() -> int:
            return need - (self.kv.available_pages + self._pages_coming() - self._decode_reserve())

        def slot() -> bool:
            return len(self.running) < self.max_running

        if short() <= 0 and slot():
            return False  # the room is there or on its way: a rotation would buy nothing
        if short() > sum(len(v.pages) for v in victims):
            return False  # even all of them would not make room
        moved = False
        for v in victims:
            if not self._rotate_out(v, forced=False):
                break
            moved = True
            if short() <= 0 and slot():
                break
        return moved

    def _kv_deficit(self) -> int:
        """Pages by which every running, rotary and waiting request's KV (and its next token) exceeds
        the pool; 0 if it all fits. Stops counting past twice the pool (then it is at least the pool),
        so a long queue costs no more than the requests that two pools hold."""
        cap = self.allocator.capacity
        demand = 0
        for queue in (self.running, self.rotary, self.waiting):
            for r in queue:
                if r.remote is None:
                    demand += self.kv.pages_for(r.fill_len + 1)
                    if demand > 2 * cap:
                        return demand - cap
        return max(demand - cap, 0)
