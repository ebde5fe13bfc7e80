"""Prefill/decode placement: KV pairs between the prefill and decode workers of a model, opened on
worker events, and the choice of a (prefill, decode) pair for a request.

    WorkerUp of a prefill or decode worker   open a pair with each up worker of the other role of its
                                             model: KVPairOpen to the decode worker -> its reply (the
                                             pair's rendezvous) -> KVPairConnect to the prefill worker
    WorkerDown                               its pairs are down (a new process is paired afresh); a
                                             prefill worker's decode partners are told (KVPairClose)
    LoadReported                             a pair that failed is tried again (at most every RETRY_S)

A model is served disaggregated while at least one pair of it is active; otherwise its requests go to
any up worker of it, whatever its role, as whole requests (every worker can serve them).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Final

from router.events import LoadReported, WorkerDown, WorkerUp
from router.placement.base import Placement, PlacementStrategy, RouterHandle
from router.registry import Balancer, LeastOutstandingTokens, ModelEntry
from router.tracker import WorkerState
from sglang_ext.messages import KVPairClose, KVPairConnect, KVPairOpen, WorkerInfo

logger = logging.getLogger(__name__)
RETRY_S: Final = 2.0
OPEN_TIMEOUT_S: Final = 10.0
TRANSFER_TIMEOUT_S: Final = 30.0  # one request's KV on the wire longer than this: the pair is broken
ROLES: Final = ("prefill", "decode")
PAIRED_SLACK_TOKENS: Final = 2048  # how far behind a decode worker paired with the prefill worker may be


@dataclass
class KVPair:
    prefill: str
    decode: str
    pairing: str = ""
    state: str = "opening"  # opening | active | down | failed: ...
    backend: str = ""  # how the pages go: gloo | nccl | cuda_ipc (the decode worker's choice)
    last_try: float = -RETRY_S
    task: asyncio.Task[None] | None = None

    def describe(self) -> dict[str, Any]:
        return {"prefill": self.prefill, "decode": self.decode, "pairing": self.pairing or None, "state": self.state,
                "backend": self.backend or None}


def geometry_problem(a: WorkerInfo | None, b: WorkerInfo | None) -> str | None:
    """Why the KV of one worker cannot be used by the other (None: it can)."""
    if a is None or b is None:
        return "a worker has not said hello"
    keys = ("page_size", "num_layers", "num_kv_heads", "head_dim", "kv_dtype", "vocab_size")
    diff = [f"{k} {getattr(a, k)} vs {getattr(b, k)}" for k in keys if getattr(a, k) != getattr(b, k)]
    return f"their KV differs ({', '.join(diff)})" if diff else None


def _no_executor(decode_id: str) -> str | None:
    return None


class PDPlacement(PlacementStrategy):
    """`executor_of(decode id)`: the prefill worker hosting that decode worker's Adrenaline executor, if
    any (the offload strategy's, router/placement/strategies.py wires it)."""

    info_key = "disaggregation"

    def __init__(self, router: RouterHandle, executor_of: Callable[[str], str | None] = _no_executor) -> None:
        self.router = router
        self.executor_of = executor_of
        self.pairs: dict[tuple[str, str], KVPair] = {}  # (prefill id, decode id) -> its pair
        self._ids = itertools.count(1)
        self._decode_balancer: Balancer = LeastOutstandingTokens()

    def close(self) -> None:
        for p in self.pairs.values():
            if p.task is not None:
                p.task.cancel()

    def describe(self) -> list[dict[str, Any]]:
        return [p.describe() for p in self.pairs.values()]

    # ---- placement ------------------------------------------------------------------------------
    def expected_links(self, configured: Sequence[WorkerState]) -> list[dict[str, Any]]:
        """Every (prefill, decode) pair of configured workers of one model, as this strategy pairs them
        (each prefill worker with each decode worker of its model); a pair not opened yet is `not opened`."""
        out = []
        for p in configured:
            if p.role != "prefill":
                continue
            for d in configured:
                if d.role == "decode" and d.model == p.model:
                    pair = self.pairs.get((p.worker_id, d.worker_id))
                    out.append({"kind": "disaggregation", "prefill": p.worker_id, "decode": d.worker_id,
                                "state": pair.state if pair is not None else "not opened"})
        return out

    def place(self, model: ModelEntry, balancer: Balancer, prefix_key: str | None,
              avoid: Collection[str]) -> Placement | None:
        """A (prefill, decode) placement over an active pair of `model` without a worker in `avoid`,
        or None (serve it whole)."""
        partners: dict[str, list[tuple[WorkerState, str]]] = {}
        for p in self.pairs.values():
            if p.state != "active":
                continue
            pw, dw = self.router.registry.workers.get(p.prefill), self.router.registry.workers.get(p.decode)
            if pw is None or dw is None or not (pw.up and dw.up) or pw.model != model.name:
                continue
            if pw.worker_id in avoid or dw.worker_id in avoid:
                continue
            partners.setdefault(pw.worker_id, []).append((dw, p.pairing))
        if not partners:
            return None
        prefill = balancer.pick([self.router.registry.workers[w] for w in partners], prefix_key)
        decode = self._pick_decode(prefill, [dw for dw, _ in partners[prefill.worker_id]])
        pairing = next(pid for dw, pid in partners[prefill.worker_id] if dw is decode)
        return Placement(prefill, decode, pairing)

    def _pick_decode(self, prefill: WorkerState, candidates: list[WorkerState]) -> WorkerState:
        """The least loaded decode worker -- or, with Adrenaline placement, one whose executor is
        `prefill` (only then can the request keep its KV there) unless it is more than
        PAIRED_SLACK_TOKENS behind. With several prefill workers each decode worker's executor is
        one of them; without this, most placements would miss their pairing."""
        best = self._decode_balancer.pick(candidates)
        paired = [dw for dw in candidates if self.executor_of(dw.worker_id) == prefill.worker_id]
        if not paired or best in paired:
            return best
        near = self._decode_balancer.pick(paired)
        return near if near.outstanding_tokens <= best.outstanding_tokens + PAIRED_SLACK_TOKENS else best

    def pair_broken(self, pairing: str, why: str) -> None:
        """A request found the pair unusable: take it out of placement until it is opened again."""
        for p in self.pairs.values():
            if p.pairing == pairing and p.state == "active":
                self._set(p, f"failed: {why}")

    # ---- events ---------------------------------------------------------------------------------
    def on_worker_up(self, ev: WorkerUp) -> None:
        w = self.router.registry.workers.get(ev.worker_id)
        if w is None or w.role not in ROLES:
            return
        for p in self._pairs_of(w):
            if ev.fresh or p.state != "active":
                self._open(p, now=True)

    def on_worker_down(self, ev: WorkerDown) -> None:
        for p in self.pairs.values():
            if ev.worker_id in (p.prefill, p.decode):
                if p.task is not None:
                    p.task.cancel()
                if ev.worker_id == p.prefill and p.pairing and p.state in ("active", "opening"):
                    # A hung prefill worker keeps its sockets open: the decode worker would wait
                    # for its KV forever. (A dead one closes them; this is then a no-op there.)
                    self.router.send(p.decode, KVPairClose(pairing=p.pairing))
                self._set(p, "down")

    def on_load_report(self, ev: LoadReported) -> None:
        for p in self.pairs.values():
            if ev.worker_id in (p.prefill, p.decode) and p.state not in ("active", "opening"):
                self._open(p)

    def _pairs_of(self, w: WorkerState) -> list[KVPair]:
        """Every pair of `w` with an up worker of the other role of its model (created as needed)."""
        entry = self.router.registry.models.get(w.model)
        other = "decode" if w.role == "prefill" else "prefill"
        out = []
        for x in entry.up_workers if entry else ():
            if x.role != other:
                continue
            key = (w.worker_id, x.worker_id) if w.role == "prefill" else (x.worker_id, w.worker_id)
            out.append(self.pairs.setdefault(key, KVPair(*key)))
        return out

    def _set(self, p: KVPair, state: str) -> None:
        if state != p.state:
            log = logger.info if state in ("active", "down", "opening") else logger.warning
            log("KV pair %s -> %s: %s", p.prefill, p.decode, state)
        p.state = state

    def _open(self, p: KVPair, now: bool = False) -> None:
        if not now and time.monotonic() - p.last_try < RETRY_S:
            return
        if p.task is not None and not p.task.done():
            p.task.cancel()
        p.last_try = time.monotonic()
        p.task = asyncio.get_running_loop().create_task(self._connect(p))

    async def _connect(self, p: KVPair) -> None:
        reg = self.router.registry
        pw, dw = reg.workers.get(p.prefill), reg.workers.get(p.decode)
        if pw is None or dw is None or not (pw.up and dw.up) or pw.role != "prefill" or dw.role != "decode":
            self._set(p, "down")
            return
        if (problem := geometry_problem(pw.info, dw.info)) is not None:
            self._set(p, f"failed: {problem}")
            return
        assert pw.info is not None
        pid = f"{self.router.new_rid()}-kv{next(self._ids)}"
        p.pairing = pid
        self._set(p, "opening")
        peer = pw.info
        reply = await self.router.request_reply(dw, lambda rid: KVPairOpen(
            rid=rid, pairing=pid, peer=p.prefill, peer_device=peer.device, timeout_s=TRANSFER_TIMEOUT_S,
            peer_host=peer.hostname, peer_gpu=peer.gpu_uuid, peer_pid=peer.pid),
            OPEN_TIMEOUT_S)
        if p.pairing != pid:
            return  # superseded meanwhile
        if reply is None or not reply.ok:
            why = reply.data.get("error", "refused") if reply is not None else f"no answer in {OPEN_TIMEOUT_S:g} s"
            self._set(p, f"failed: {p.decode}: {why}")
            return
        p.backend = str(reply.data.get("backend", "gloo"))
        self.router.send(p.prefill, KVPairConnect(pairing=pid, peer=p.decode, store=str(reply.data["store"]),
                                                  backend=p.backend,
                                                  timeout_s=TRANSFER_TIMEOUT_S))
        self._set(p, "active")
