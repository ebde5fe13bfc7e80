"""Admission: who joins the running batch, the same code for the plain and the overlap loop.

Waiting requests are admitted and rotary ones resumed in the policy's order, each through the
residency member of its home (`member.Residency`), while the step's prefill tokens, the batch's
slots and the pages beyond the decoders' reserve last; a member may move running requests out
voluntarily to make room for a candidate. The overlap loop asks `blocked` before it launches step
t+1 beside step t: the same candidates, reserve and residencies, with the head's least demand.
"""

from __future__ import annotations

from collections.abc import Callable

from sglang_ext.scheduler.batch_builder import Entry
from sglang_ext.scheduler.member import Member, Residency
from sglang_ext.scheduler.request import KVHome, Req
from sglang_ext.scheduler.view import LoopView


class Admission:
    def __init__(self, s: LoopView, members: list[Member], abort_too_long: Callable[[Req], None]) -> None:
        self.s = s
        self.members = members
        self.homes: dict[KVHome, Residency] = {m.home: m for m in members if isinstance(m, Residency)}
        self.abort_too_long = abort_too_long

    def pooled(self, r: Req) -> bool:
        """`r`'s KV takes (or, once admitted, will take) pages of this worker's pool."""
        return self.homes[r.home].pooled

    def pages_needed(self, r: Req, tokens: int) -> int:
        """Pool pages `r` lacks for `tokens` tokens of KV (0 if its KV lives elsewhere)."""
        return max(self.s.kv.pages_for(tokens) - len(r.pages), 0) if self.pooled(r) else 0

    def decode_reserve(self) -> int:
        """Pages kept free for running requests' next tokens, so admission does not cause an
        immediate preemption (a short horizon, not the whole max_new_tokens)."""
        horizon = 4 * self.s.page_size
        total = 0
        for r in self.s.running:
            left = r.sampling.max_new_tokens - len(r.output_ids)
            total += self.pages_needed(r, r.kv_len + min(left, horizon) + 1)
        return total

    def kv_deficit(self) -> int:
        """Pages by which every running, rotary and waiting request's KV (and its next token) exceeds
        the pool; 0 if it all fits. Stops counting past twice the pool (then it is at least the pool),
        so a long queue costs no more than the requests that two pools hold."""
        s = self.s
        cap = s.kv.allocator.capacity
        demand = 0
        for queue in (s.running, s.rotary, s.waiting):
            for r in queue:
                if self.pooled(r):
                    demand += s.kv.pages_for(r.fill_len + 1)
                    if demand > 2 * cap:
                        return demand - cap
        return max(demand - cap, 0)

    def admit(self, entries: list[Entry], budget: int) -> None:
        """Admit candidates into this step (their prefill chunks appended to `entries`) while the
        token budget, slots, KV headroom and the members' copy budgets last."""
        s = self.s
        if s.policy.wants_fit or any(m.wants_deficit for m in self.members):
            s.deficit = self.kv_deficit()
        s.policy.begin(s.clock(), s.deficit == 0)
        reserve = self.decode_reserve()
        for r in s.policy.candidates(s.waiting, s.rotary, s.kv.cache):
            if budget <= 0:
                break
            if not self.homes[r.home].may_admit(r):
                continue  # e.g. its KV is still on the way out: a copy back would race it
            if s.kv.pages_for(r.fill_len) > s.kv.allocator.capacity:
                # Grown past the whole pool (its KV was elsewhere, or it was preempted late): it can
                # never run here again, and it must not block the queue.
                (s.rotary if r in s.rotary else s.waiting).remove(r)
                self.abort_too_long(r)
                continue
            got = self._try(r, budget, reserve)
            if got is None and any(m.make_room_for(r, {id(e.req) for e in entries}) for m in self.members):
                reserve = self.decode_reserve()
                got = self._try(r, budget, reserve)
            if got is None:
                break
            if got:
                entries.append(Entry.of(r, got))
                budget -= got
            else:  # a resumed decoder: keep its next token's page for it (none if its KV is elsewhere)
                reserve += self.pages_needed(r, r.kv_len + 1)

    def _try(self, r: Req, budget: int, reserve: int) -> int | None:
        """Admit a candidate through the residency of its home: the tokens it computes this step (0:
        it decodes with the others, or waits for its KV), or None (nothing changed) if it does not fit."""
        if len(self.s.running) >= self.s.max_running:
            return None
        return self.homes[r.home].admit(r, budget, reserve)

    def blocked(self) -> bool:
        """No waiting request could be admitted now, whatever a step in flight brings, so the overlap
        loop keeps overlapping while a queue stands. True only where it cannot be wrong: the running
        batch is full, or the policy's first candidate (where `admit` stops) cannot get its first
        pages beyond the decode reserve, even counting what its cached prefix may lend. An admission
        that only the step in flight's finishes make possible waits one step."""
        s = self.s
        if len(s.running) >= s.max_running:
            return True
        reserve = self.decode_reserve()
        available = s.kv.available_pages
        if available - reserve < 1:
            return True
        head = next(iter(s.policy.candidates(s.waiting, s.rotary, s.kv.cache)), None)
        if head is None or head.admitted:
            return False
        home = self.homes[head.home]
        if not home.may_admit(head):
            return False  # `admit` skips it and may admit the next one
        need = home.first_pages(head)  # its residency's least demand, as its `admit` counts it
        return need is not None and need + reserve > available  # None: admitted without pages
