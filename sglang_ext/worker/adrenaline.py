"""Adrenaline placement on the workers: a disaggregated request whose decode attention runs on the
prefill worker that computed its prompt (the router chooses which: router/placement/adrenaline.py).

    prefill worker (executor host)                       decode worker (the sender)
    prefill + first token, as usual
    hand_off: Placer.place copies the prompt's KV
      from its pool into its executor under the
      decode worker's offload pairing, as `handle`
      (device-local; no network)
    header [PLACED, room, n, handle, first] ───────────> the request is queued with its first token,
      over the KV pair, after the copy                   adopted as a remote row (RemoteResidency.adopt:
    pages freed (prompt pages to the prefix cache)       no local pages) and decodes on the executor

If the executor cannot take the KV (full, or the pairing is gone), the prefill worker sends it as in
plain PD. If the decode worker cannot adopt it (its pairing changed), it recomputes the prompt. KV
placed for a request nobody adopts (aborted meanwhile, or the header could not go) is released on
the executor.
"""

from __future__ import annotations

import logging

import torch

from sglang_ext.kvcache.pool import KVPool
from sglang_ext.messages import Disagg
from sglang_ext.offload.host import ExecutorHost
from sglang_ext.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


class Placer:
    """The prefill side: keeps chosen requests' prompt KV in this worker's own executor."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.host: ExecutorHost | None = None  # set when this worker offers executor memory
        self.placed: dict[str, tuple[str, int]] = {}  # rid -> (offload pairing, handle), until its header went

    def place(self, rid: str, d: Disagg, pages: list[int], n_tokens: int, reserve: int = 0) -> bool:
        """On the forward thread, at hand-off: True if the prompt's KV (`pages`, `n_tokens`) is now in
        the executor under the decode worker's pairing, with pages for `reserve` tokens in all; False:
        it is sent as usual."""
        if not d.handle or self.host is None:
            return False
        idx = torch.tensor(pages, dtype=torch.int64, device=self.pool.device)
        if not self.host.adopt(d.executor_pairing, d.handle, self.pool.data.index_select(0, idx), n_tokens,
                               reserve):
            logger.info("request %s: the executor cannot keep its KV (pairing %s full or gone); it is sent", rid,
                        d.executor_pairing)
            return False
        self.placed[rid] = (d.executor_pairing, d.handle)
        return True

    def sent(self, rid: str, ok: bool) -> bool:
        """The header of a placed request went (ok) or could not go (its KV is released: the router
        resumes the request on the decode worker, which recomputes it). False if `rid` was not placed."""
        got = self.placed.pop(rid, None)
        if got is None:
            return False
        if not ok and self.host is not None:
            self.host.release_placed(*got)
        return True


def drop_placed(handle: int, scheduler: Scheduler) -> None:
    """The decode side: KV placed on the executor for a request that will not run here (aborted, or
    the pair closed): release it there. (A handle of another pairing is unknown to this one's guest,
    and that pairing's KV went with it.)"""
    off = scheduler.remote_sender
    if handle and off is not None and off.active:
        off.remote.release(handle)
