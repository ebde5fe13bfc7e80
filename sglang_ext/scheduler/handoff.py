"""The scheduler's side of prefill/decode disaggregation.

    prefill worker: hand_off(rid)    a request that has its first token leaves the running batch but
                                     keeps its pages (the sender thread reads them) ... handed(rid)
                                     once the send completed: its prompt pages go to the prefix
                                     cache and the rest are freed, as at a finish
    decode worker:  add_prefilled    a request arrives with its first token and its prompt's KV
                                     (staged); admission copies the KV into pages (admission.py)
                                     and it decodes from there

Kept apart from the batching loop (`scheduler.py`), like remote rows and rotation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang_ext.scheduler.request import FinishReason, Req, ReqStatus


class Handoff:
    running: list[Req]
    waiting: list[Req]
    _sent: dict[str, tuple[int, int, int]]
    handing: dict[str, Req]
    validate: Callable[[Req], None]  # the Scheduler's
    _finish: Callable[[Req, FinishReason], None]

    def hand_off(self, rid: str) -> Req | None:
        """Take a running request out of scheduling, its pages still its own; None if it is not
        running (finished or aborted meanwhile)."""
        r = next((x for x in self.running if x.rid == rid), None)
        if r is None:
            return None
        self.running.remove(r)
        self._sent.pop(rid, None)
        self.handing[rid] = r
        return r

    def handed(self, rid: str) -> None:
        """Its KV is sent (or the send failed): release its pages, publishing the prompt's to the cache."""
        r = self.handing.pop(rid, None)
        if r is not None:
            self._finish(r, FinishReason("stop", message="handed to a decode worker"))

    def add_prefilled(self, req: Req, kv: Any) -> None:
        """Queue a request that arrives with its first token (`req.output_ids`) and its prompt's KV
        in pages (`kv`: [pages, L, 2, P, Hkv, D]; None: recomputed here at admission, as for a
        preempted request). What the prefill worker reported already (input logprobs, the first token
        and its logprob) is not reported again."""
        assert len(req.output_ids) == 1
        self.validate(req)
        if req.return_logprob:  # computed on the prefill worker: placeholders keep positions, not resent
            n_in = len(req.input_ids) - req.logprob_start
            req.input_token_logprobs = [(None, t) for t in req.input_ids[req.logprob_start:]]
            req.input_top_logprobs = [None] * n_in
        req.staged_kv = kv
        req.status = ReqStatus.WAITING
        self._sent[req.rid] = (1, len(req.input_token_logprobs), 0)
        self.waiting.append(req)
