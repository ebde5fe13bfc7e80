"""Prefill/decode disaggregation, a scheduler member.

    prefill worker: hand_off(rid)    a request that has its first token leaves the running batch but
                                     keeps its pages (the sender thread reads them) ... handed(rid)
                                     once the send completed: its prompt pages go to the prefix
                                     cache and the rest are freed, as at a finish
    decode worker:  add_prefilled    a request arrives with its first token and its prompt's KV
                                     (home STAGED); admission copies the KV into pages and it
                                     decodes from there
"""

from __future__ import annotations

from typing import Any

import torch

from sglang_ext.scheduler.member import Residency
from sglang_ext.scheduler.request import FinishReason, KVHome, Req, ReqStatus
from sglang_ext.scheduler.view import LoopView


class Handoff(Residency):
    home = KVHome.STAGED

    def __init__(self, s: LoopView) -> None:
        self.s = s
        self.handing: dict[str, Req] = {}  # prefill side: prefilled, pages held while their KV is sent
        self.staged: dict[str, Any] = {}  # decode side: rid -> the prompt's KV ([pages, L, 2, P, Hkv, D])

    # ---- member hooks ---------------------------------------------------------------------------
    def busy(self) -> bool:
        return bool(self.handing)

    def holders(self) -> list[Req]:
        return list(self.handing.values())

    def release(self, r: Req) -> None:
        if r.home is KVHome.STAGED:  # aborted before its admission
            self.staged.pop(r.rid, None)
            r.home = KVHome.LOCAL

    def admit(self, r: Req, budget: int, reserve: int) -> int | None:
        """The pages this worker's cache holds already are matched, the rest are copied in from the
        staged KV, and it decodes with the others this step (0), or None if its pages do not fit now."""
        s = self.s
        s.kv.admit(r)
        n = len(r.input_ids)  # the prompt's KV; the first token (output_ids[0]) is decoded here
        need = s.kv.pages_for(n + 1) - len(r.pages)
        if need + reserve > s.kv.available_pages:
            s.kv.release(r, keep_in_cache=False)
            return None
        s.kv.grow(r, n)
        kv = self.staged.pop(r.rid)
        lo, hi = r.cached_pages, s.kv.pages_for(n)
        if hi > lo:
            pool = s.runner.pool
            idx = torch.tensor(r.pages[lo:hi], dtype=torch.int64, device=pool.device)
            pool.data[idx] = kv[lo:hi].to(pool.device, pool.data.dtype)
        r.kv_len, r.home = n, KVHome.LOCAL
        s.start_running(r, s.waiting)
        return 0

    def first_pages(self, r: Req) -> int | None:
        """Its prompt's KV arrived from the prefill worker: all of it (and its next token) at once."""
        kv = self.s.kv
        match = kv.cache.match_prefix(r.fill_ids[: kv.match_limit(r)])
        return kv.pages_for(len(r.input_ids) + 1) - len(match.pages)

    # ---- the worker's calls ---------------------------------------------------------------------
    def hand_off(self, rid: str) -> Req | None:
        """Take a running request out of scheduling, its pages still its own; None if it is not
        running (finished or aborted meanwhile)."""
        r = next((x for x in self.s.running if x.rid == rid), None)
        if r is None:
            return None
        self.s.running.remove(r)
        self.s.sent.pop(rid, None)  # the decode worker reports the rest
        self.handing[rid] = r
        return r

    def handed(self, rid: str) -> None:
        """Its KV is sent (or the send failed): release its pages, publishing the prompt's to the cache."""
        r = self.handing.pop(rid, None)
        if r is not None:
            self.s.finish(r, FinishReason("stop", message="handed to a decode worker"))

    def add_prefilled(self, req: Req, kv: Any) -> None:
        """Queue a request that arrives with its first token (`req.output_ids`) and its prompt's KV
        in pages (`kv`: [pages, L, 2, P, Hkv, D]; None: recomputed here at admission, as for a
        preempted request). What the prefill worker reported already (input logprobs, the first token
        and its logprob) is not reported again."""
        assert len(req.output_ids) == 1
        self.s.validate(req)
        if req.return_logprob:  # computed on the prefill worker: placeholders keep positions, not resent
            n_in = len(req.input_ids) - req.logprob_start
            req.input_token_logprobs = [(None, t) for t in req.input_ids[req.logprob_start:]]
            req.input_top_logprobs = [None] * n_in
        if kv is not None:
            self.staged[req.rid] = kv
            req.home = KVHome.STAGED
        req.status = ReqStatus.WAITING
        self.s.sent[req.rid] = (1, len(req.input_token_logprobs), 0)
        self.s.waiting.append(req)
