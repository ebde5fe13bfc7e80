"""The cluster file's `offload:` entries at run time: senders paired with executors, on events.

    WorkerUp of a sender     pick an up worker of `to` that offers executor memory (fewest senders
                             first), and the transport from where both run (transport/choice.py)
                             -> ExecutorOpen to it -> its reply (the pair's rendezvous)
                             -> OffloadDirective to the sender
    WorkerUp of a host       pair the senders that have no executor (and, if it is a new process,
                             those it served before: their pairs died with it)
    Adrenaline placement     an entry with from == to (a model with prefill and decode workers):
                             its decode workers are the senders, its prefill workers the hosts;
                             the router places requests there at prefill (adrenaline.py here)
    WorkerDown of a host     its senders detach (their transport would time out anyway)
    LoadReported (sender)    a sender that lost its executor, or a pairing that failed or waits for a
                             host, is tried again (at most every RETRY_S)

What share of a sender's requests go out is its entry's policy's (planning/ here): the directive
carries the policy's decision when the pairing opens; later decisions, taken on events by
`Steering` (steer.py here), go to the sender as OffloadRatio updates of the live pairing.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any, Final

from router.config import OffloadSpec
from router.events import Event, LoadReported, WorkerDown, WorkerUp
from router.placement.adrenaline import AdrenalinePlacer
from router.placement.base import KeptKV, PlacementStrategy, RouterHandle
from router.placement.metrics import PlanningMetrics
from router.placement.pairing import RETRY_S, Pairing
from router.placement.startup import StartupQuiet
from router.placement.steer import EVENTS, Steering
from router.tracker import WorkerState
from sglang_ext.messages import ExecutorOpen, OffloadDirective, ReplyOut, WorkerInfo
from sglang_ext.transport.choice import SERVED_DEFAULT, Choice, WorkerSite, choose_transport

logger = logging.getLogger(__name__)
OPEN_TIMEOUT_S: Final = 10.0
_LIVE: Final = ("opening", "active")


class OffloadPlacement(PlacementStrategy):
    """Remote attention: each sender of the cluster file's `offload:` entries paired with an executor."""

    info_key = "offload"
    events = (WorkerUp, WorkerDown, *EVENTS)

    def __init__(self, router: RouterHandle, rules: Sequence[OffloadSpec]) -> None:
        self.router = router
        self.rules = {r.from_: r for r in rules}
        self.hosts_of = {r.to for r in rules}
        self.pairings: dict[str, Pairing] = {}  # sender worker id -> its pairing
        self._ids = itertools.count(1)
        self.steering = Steering(router, self.pairings, self.hosts_of)
        self.adrenaline = AdrenalinePlacer(self.pairings)  # from == to entries: requests placed at prefill
        self.quiet = StartupQuiet(router.registry)  # waits for a host while the cluster starts: INFO, not WARNING
        router.metrics.registry.register(PlanningMetrics(self.pairings))

    def close(self) -> None:
        for p in self.pairings.values():
            if p.task is not None:
                p.task.cancel()

    def describe(self) -> list[dict[str, Any]]:
        out = [p.describe() for p in self.pairings.values()]
        for model in self.rules:  # senders the router knows of but has not paired yet
            entry = self.router.registry.models.get(model)
            for wid in entry.workers if entry else ():
                if wid not in self.pairings and self._is(wid, self.rules[model], "decode"):
                    out.append(Pairing(wid, self.rules[model], state="sender not up").describe())
        return out

    def expected_links(self, configured: Sequence[WorkerState]) -> list[dict[str, Any]]:
        """The pairing of each configured sender of an `offload:` entry (under Adrenaline placement, from
        == to, the model's decode workers send); one not made yet is `not paired`."""
        out = []
        for w in configured:
            rule = self.rules.get(w.model)
            if rule is None or (rule.from_ == rule.to and w.role != "decode"):
                continue
            p = self.pairings.get(w.worker_id)
            out.append({"kind": "offload", "from": w.worker_id, "executor": (p.executor or None) if p else None,
                        "to_model": rule.to, "state": p.state if p is not None else "not paired"})
        return out

    # ---- placement --------------------------------------------------------------------------------
    def keep_kv(self, rid: str, prefill: WorkerState, decode: WorkerState) -> KeptKV | None:
        return self.adrenaline.choose(rid, prefill, decode)

    def adrenaline_executor(self, decode_id: str) -> str | None:
        """The prefill worker hosting `decode_id`'s active Adrenaline pairing (None: none)."""
        p = self.pairings.get(decode_id)
        if p is None or p.rule.from_ != p.rule.to or p.state != "active":
            return None
        return str(p.executor)

    # ---- events -----------------------------------------------------------------------------------
    # Each hook ends with the policies' decisions (Steering), for every event it listens to.
    def on_worker_up(self, ev: WorkerUp) -> None:
        w = self.router.registry.workers.get(ev.worker_id)
        if ev.model in self.hosts_of and w is not None and w.info is not None and w.info.executor_mem_bytes > 0:
            self.quiet.host_up(ev.model)
        if ev.model in self.rules and self._is(ev.worker_id, self.rules[ev.model], "decode"):
            p = self._pairing(ev.worker_id, ev.model)
            if ev.fresh or p.state not in _LIVE:
                self._pair(p, now=True)
        if ev.model in self.hosts_of:
            for p in self.pairings.values():
                if not self._is(ev.worker_id, p.rule, "prefill"):
                    continue
                if p.rule.to == ev.model and (p.state not in _LIVE or (ev.fresh and p.executor == ev.worker_id)):
                    self._pair(p, now=True)
        self.steering.on_event(ev)

    def on_worker_down(self, ev: WorkerDown) -> None:
        p = self.pairings.get(ev.worker_id)
        if p is not None:
            self._cancel(p)
            p.state = "sender down"
        for p in self.pairings.values():
            if p.executor == ev.worker_id and p.state in _LIVE:
                self._cancel(p)
                self.router.send(p.sender, OffloadDirective(pairing=p.pairing_id, detach=True))
                self._set(p, f"detached: executor {ev.worker_id} is down")
        self.steering.on_event(ev)

    def on_load_report(self, ev: LoadReported) -> None:
        if ev.model in self.rules and self._is(ev.worker_id, self.rules[ev.model], "decode"):
            p = self._pairing(ev.worker_id, ev.model)
            r = ev.report.offload
            if p.state == "active" and r is not None and r.pairing == p.pairing_id and r.state not in ("active", ""):
                self._set(p, r.state_text())
            if p.state not in _LIVE:
                self._pair(p)
        self.steering.on_event(ev)

    def on_other(self, ev: Event) -> None:
        self.steering.on_event(ev)

    def _is(self, worker_id: str, rule: OffloadSpec, role: str) -> bool:
        """Whether the worker takes that side of the entry: any worker of a WEAVER entry; under
        Adrenaline placement (from == to) decode workers send and prefill workers host."""
        if rule.from_ != rule.to:
            return True
        w = self.router.registry.workers.get(worker_id)
        return w is not None and w.info is not None and w.info.disaggregation_mode == role

    def _pairing(self, sender: str, model: str) -> Pairing:
        p = self.pairings.get(sender)
        if p is None or p.rule.from_ != model:
            p = self.pairings[sender] = Pairing(sender, self.rules[model])
        return p

    def _set(self, p: Pairing, state: str) -> None:
        p.state = state
        if state == "opening":
            return
        if state in ("active", "sender down"):
            level = logging.INFO
        elif state.startswith("waiting:"):
            level = self.quiet.level(p.rule.to)  # no host up yet: expected while the cluster starts
        else:
            level = logging.WARNING
        # Logged once per state, and once more if a startup wait outlasts the startup.
        if state != p.logged or level > p.logged_level:
            p.logged, p.logged_level = state, level
            logger.log(level, "offload %s -> %s: %s", p.sender, p.executor or "?", state)

    def _cancel(self, p: Pairing) -> None:
        if p.task is not None and not p.task.done():
            p.task.cancel()
        p.task = None

    def _pair(self, p: Pairing, now: bool = False) -> None:
        if not now and time.monotonic() - p.last_try < RETRY_S:
            return
        self._cancel(p)
        p.last_try = time.monotonic()
        p.task = asyncio.get_running_loop().create_task(self._open(p))

    # ---- one pairing ------------------------------------------------------------------------------
    def _pick_host(self, p: Pairing) -> WorkerState | None:
        entry = self.router.registry.models.get(p.rule.to)
        hosts = [w for w in entry.up_workers if w.info is not None and w.info.executor_mem_bytes > 0
                 and self._is(w.worker_id, p.rule, "prefill")] if entry else []
        if not hosts:
            return None
        load = {w.worker_id: 0 for w in hosts}
        for q in self.pairings.values():
            if q is not p and q.state in _LIVE and q.executor in load:
                load[q.executor] += 1
        return min(hosts, key=lambda w: (load[w.worker_id], w.worker_id))

    async def _open(self, p: Pairing) -> None:
        sender = self.router.registry.workers.get(p.sender)
        if sender is None or not sender.up or sender.info is None:
            return
        info = sender.info
        if not info.num_layers:
            self._set(p, "failed: the sender reports no attention shape (a worker of an older version?)")
            return
        host = self._pick_host(p)
        if host is None:
            which = "prefill worker" if p.rule.from_ == p.rule.to else "worker"
            self._set(p, f"waiting: no up {which} of {p.rule.to!r} offers executor memory")
            return
        pid = f"{self.router.new_rid()}-pair{next(self._ids)}"
        p.executor, p.pairing_id = host.worker_id, pid
        try:
            choice = choose_transport(info.offload_transport or None, _site(info), _site(host.info))
        except ValueError as e:
            self._set(p, f"failed: {e}")
            return
        self._set(p, "opening")
        reply = await self.router.request_reply(host, lambda rid: _open_msg(rid, info, p.rule, pid, choice),
                                                OPEN_TIMEOUT_S)
        if p.pairing_id != pid:
            return  # superseded meanwhile
        if reply is None or not reply.ok:
            why = reply.data.get("error", "refused") if reply is not None else f"no answer in {OPEN_TIMEOUT_S:g} s"
            self._set(p, f"failed: {host.worker_id}: {why}")
            return
        d = _directive(reply, p.rule, pid, host.worker_id, self.steering.opening(p))
        p.transport = d.transport
        self.router.send(p.sender, d)
        self._set(p, "active")


def _site(info: WorkerInfo | None) -> WorkerSite:
    assert info is not None  # up workers have said hello
    return WorkerSite(info.worker_id, info.hostname, info.device)


def _open_msg(rid: str, info: WorkerInfo, rule: OffloadSpec, pairing: str, choice: Choice) -> ExecutorOpen:
    return ExecutorOpen(rid=rid, guest=info.worker_id, guest_model=info.model_name, pairing=pairing,
                        num_layers=info.num_layers, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim,
                        page_size=info.page_size, dtype=info.kv_dtype, num_q_heads=info.num_q_heads,
                        scale=info.attn_scale, guest_device=info.device, transport=choice.transport,
                        fallback=choice.fallback, guest_gpu=info.gpu_uuid, timeout_s=rule.timeout_s)


def _directive(reply: ReplyOut, rule: OffloadSpec, pairing: str, executor: str,
               wire: tuple[float, float]) -> OffloadDirective:
    return OffloadDirective(pairing=pairing, executor=executor, store=str(reply.data["store"]),
                            backend=str(reply.data.get("backend", "gloo")), ratio=wire[0], bound=wire[1],
                            policy=rule.policy, transport=str(reply.data.get("transport", SERVED_DEFAULT)),
                            timeout_s=rule.timeout_s, placement="prefill" if rule.from_ == rule.to else "")
