"""Adrenaline placement without processes: the cluster file's from == to entry, the router's choice
of requests (router/placement/adrenaline.py), the executor host taking a prefill worker's KV (`adopt`), and a
decode scheduler that adopts requests whose KV is on the executor -- outputs equal a plain run, also
when the executor is lost mid-generation.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch
from _tiny import VOCAB, greedy, make_scheduler, prompts, run_all

from router.config import ClusterSpec, ConfigError, OffloadSpec, build_cluster
from router.placement.adrenaline import HANDLE_BASE, AdrenalinePlacer
from sglang_ext.messages import Disagg
from sglang_ext.offload.executor import AttentionExecutor
from sglang_ext.offload.host import ExecutorHost
from sglang_ext.offload.remote import ExecutorLost
from sglang_ext.scheduler.request import Req
from sglang_ext.scheduler.scheduler import Scheduler
from sglang_ext.worker.adrenaline import Placer

LENGTHS = [5, 17, 33, 9, 40, 3]
MAX_NEW = 14


# ---- the cluster file -------------------------------------------------------------------------------
def cluster(workers: list[dict[str, Any]], **entry: Any) -> Any:
    spec = msgspec.convert({"models": [{"name": "m", "workers": workers}],
                            "offload": [{"from": "m", "to": "m", "ratio": 0.5, **entry}]}, ClusterSpec)
    return build_cluster(spec)


def test_an_entry_from_a_model_to_itself_is_adrenaline_placement() -> None:
    mps = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30"}
    c = cluster([{"role": "prefill", "args": {"executor_mem_gb": 1}, "env": mps}, {"role": "decode"}])
    assert c.offload == (OffloadSpec(from_="m", to="m", ratio=0.5),)
    assert [w.env for w in c.workers] == [(("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "30"),), ()]
    with pytest.raises(msgspec.ValidationError, match="Expected `str`"):
        cluster([{"role": "prefill", "env": {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": 30}}])


@pytest.mark.parametrize(("workers", "needle"), [
    ([{}, {"args": {"executor_mem_gb": 1}}], "from and to are both 'm': that is Adrenaline placement, which needs "
                                             "prefill and decode workers of 'm' (role: prefill|decode; it has serve)"),
    ([{"role": "prefill", "args": {"executor_mem_gb": 1}}], "it has prefill"),
    ([{"role": "prefill"}, {"role": "decode", "args": {"executor_mem_gb": 1}}],
     "no prefill worker of 'm' offers executor memory"),
])
def test_adrenaline_placement_needs_both_roles_and_executor_memory(workers: list[dict[str, Any]], needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        cluster(workers)
    assert needle in str(e.value)


# ---- the router's choice ----------------------------------------------------------------------------
def placer(state: str = "active", executor: str = "P", ratio: float = 0.5) -> tuple[AdrenalinePlacer, Any]:
    rule = OffloadSpec(from_="m", to="m", ratio=ratio)
    pairing = SimpleNamespace(rule=rule, state=state, executor=executor, pairing_id="pair1", sent=(ratio, 0.0))
    return AdrenalinePlacer({"D": pairing}), pairing  # type: ignore[dict-item]


def test_the_router_places_its_share_of_the_requests_in_flight() -> None:
    ap, pairing = placer(ratio=0.5)
    p, d = SimpleNamespace(worker_id="P"), SimpleNamespace(worker_id="D", inflight={})
    chosen = []
    for i in range(6):
        d.inflight[f"r{i}"] = None
        chosen.append(ap.choose(f"r{i}", p, d))  # type: ignore[arg-type]
    assert [c is not None for c in chosen] == [False, True, False, True, False, True]
    handles = [c.handle for c in chosen if c is not None]
    assert len(set(handles)) == 3 and min(handles) > HANDLE_BASE
    assert {c.pairing for c in chosen if c is not None} == {"pair1"}
    # placed requests that finished leave the share: the next one goes there again
    for rid in ("r1", "r3", "r5"):
        del d.inflight[rid]
    d.inflight["r6"] = None
    assert ap.choose("r6", p, d) is not None  # type: ignore[arg-type]
    # another prefill worker than the pairing's executor, or a pairing not active: plain PD
    d.inflight["r7"] = None
    assert ap.choose("r7", SimpleNamespace(worker_id="P2"), d) is None  # type: ignore[arg-type]
    pairing.state = "lost"
    assert ap.choose("r7", p, d) is None  # type: ignore[arg-type]


def test_a_weaver_entry_places_nothing_at_prefill() -> None:
    ap, pairing = placer(ratio=1.0)
    pairing.rule = OffloadSpec(from_="hot", to="cold", ratio=1.0)
    d = SimpleNamespace(worker_id="D", inflight={"r0": None})
    assert ap.choose("r0", SimpleNamespace(worker_id="P"), d) is None  # type: ignore[arg-type]


# ---- the prefill worker's executor host -------------------------------------------------------------
def test_the_host_adopts_prefill_kv_into_a_live_pairing() -> None:
    d = make_scheduler(offload_executor="local", offload_ratio=0.5)
    remote: Any = d.remote_sender.remote  # type: ignore[union-attr]
    ex: AttentionExecutor = remote.executor
    host = ExecutorHost(ex)
    svc = SimpleNamespace(guest=remote.guest, ipc=None, ended=SimpleNamespace(is_set=lambda: False))
    host.services[f"{remote.guest}/pair1"] = svc  # type: ignore[assignment]
    g = d.runner.pool.geometry
    kv = torch.randn(3, g.num_layers, 2, g.page_size, g.num_kv_heads, g.head_dim)
    assert host.adopt("pair1", HANDLE_BASE + 1, kv, 10)
    assert ex.guests[remote.guest].seqs[HANDLE_BASE + 1].length == 10 and ex.used_tokens(remote.guest) == 12
    assert not host.adopt("pair2", HANDLE_BASE + 2, kv, 10)  # not a pairing served here
    too_big = torch.zeros(ex.partition.total_bytes // kv[0].nbytes + 1, *kv.shape[1:])
    assert not host.adopt("pair1", HANDLE_BASE + 3, too_big, 10)  # full: the KV is sent instead
    host.release_placed("pair1", HANDLE_BASE + 1)
    assert ex.used_tokens(remote.guest) == 0
    ex.check()


# ---- the decode scheduler ---------------------------------------------------------------------------
def reqs() -> list[Req]:
    return [Req(f"r{i}", p, greedy(MAX_NEW)) for i, p in enumerate(prompts(LENGTHS))]


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    return run_all(make_scheduler(), reqs())


def prefill(r: Req) -> tuple[int, torch.Tensor]:
    """What a prefill worker does: the prompt's first token and KV pages (then it hands it off)."""
    p = make_scheduler()
    p.add_request(Req(r.rid, list(r.input_ids), greedy(MAX_NEW)))
    first = next(o.new_token_ids[0] for o in p.step() if o.new_token_ids)
    held = p.handoff.hand_off(r.rid)
    assert held is not None
    n = len(r.input_ids)
    idx = torch.tensor(held.pages[: -(-n // p.page_size)], dtype=torch.int64)
    return first, p.runner.pool.data.index_select(0, idx).clone()


def decode_with_placed(s: Scheduler, rs: list[Req], placed: set[str]) -> dict[str, list[int]]:
    """The decode worker: every request arrives with its first token; those in `placed` have their KV
    on the executor already (adopted), the others bring it staged (plain PD)."""
    assert s.remote_sender is not None
    s.remote_sender.placed_only = True
    remote: Any = s.remote_sender.remote
    out: dict[str, list[int]] = {}
    for r in rs:
        first, kv = prefill(r)
        r.output_ids = [first]
        out[r.rid] = [first]
        if r.rid in placed:
            handle = HANDLE_BASE + int(r.rid[1:])
            remote.executor.load(remote.guest, handle, kv, len(r.input_ids))
            s.handoff.add_prefilled(r, None)
            assert s.remote_residency.adopt(r, handle)
        else:
            s.handoff.add_prefilled(r, kv)
    return out


def drive(s: Scheduler, out: dict[str, list[int]], lose_after: int = -1) -> None:
    steps = 0
    while s.has_work():
        if steps == lose_after:
            assert s.remote_sender is not None and s.remote_sender.num_remote > 0

            def gone(*_: object) -> None:
                raise ExecutorLost("the prefill worker died (simulated)")

            s.remote_sender.remote.post = gone  # type: ignore[method-assign]
        for o in s.step():
            out[o.rid].extend(o.new_token_ids)
        s.check()
        steps += 1
        assert steps < 2000


def test_adopted_requests_decode_on_the_executor(reference: dict[str, list[int]]) -> None:
    s = make_scheduler(offload_executor="local", offload_ratio=1.0)
    rs = reqs()
    placed = {"r0", "r2", "r4"}
    out = decode_with_placed(s, rs, placed)
    assert all(not r.pages for r in rs if r.rid in placed)  # no local page: the KV is the executor's
    drive(s, out)
    assert out == reference
    assert {r.rid for r in rs if r.attention_executor is not None} == placed  # placed_only: nothing else moved
    remote: Any = s.remote_sender.remote  # type: ignore[union-attr]
    assert remote.executor.used_tokens(remote.guest) == 0 and s.remote_sender.num_remote == 0  # type: ignore[union-attr]


@pytest.mark.parametrize("lose_after", [0, 5])
def test_adopted_requests_are_recomputed_when_the_executor_is_lost(reference: dict[str, list[int]],
                                                                   lose_after: int) -> None:
    s = make_scheduler(offload_executor="local", offload_ratio=1.0)
    out = decode_with_placed(s, reqs(), {"r1", "r3", "r5"})
    drive(s, out, lose_after)
    assert out == reference
    assert s.num_preemptions >= 3 and not s.remote_sender.active  # type: ignore[union-attr]


@pytest.mark.parametrize("lose_after", [-1, 6])
def test_requests_adopted_while_others_decode_under_overlap_scheduling(reference: dict[str, list[int]],
                                                                       lose_after: int) -> None:
    """The decode worker on a GPU runs the overlap loop: placed requests arrive while a step is in
    flight (and the executor may be lost after that); outputs are still a plain run's."""
    base = make_scheduler(offload_executor="local", offload_ratio=1.0)
    s = Scheduler(base.args, base.runner, base.page_size, base.eos_ids, vocab_size=VOCAB,
                  remote_sender=base.remote_sender, overlap=True)
    rs = reqs()
    out = decode_with_placed(s, rs[:3], {"r1"})
    for _ in range(3):
        for o in s.step():
            out[o.rid].extend(o.new_token_ids)
        s.check()
    out.update(decode_with_placed(s, rs[3:], {"r3", "r5"}))
    drive(s, out, lose_after)
    assert out == reference
    placed = {r.rid for r in rs if r.attention_executor is not None}
    assert placed == {"r1", "r3", "r5"}


def test_an_adopted_request_aborted_before_it_runs_frees_its_executor_kv() -> None:
    s = make_scheduler(offload_executor="local", offload_ratio=1.0)
    rs = reqs()[:2]
    decode_with_placed(s, rs, {"r0", "r1"})
    s.abort("r0")
    remote: Any = s.remote_sender.remote  # type: ignore[union-attr]
    assert HANDLE_BASE + 0 not in remote.executor.guests[remote.guest].seqs
    while s.has_work():
        s.step()
    assert remote.executor.used_tokens(remote.guest) == 0


# ---- the prefill worker's side of a hand-off --------------------------------------------------------
class FakeHost:
    def __init__(self, room: bool) -> None:
        self.room = room
        self.adopted: list[tuple[str, int, int, int]] = []
        self.released: list[tuple[str, int]] = []

    def adopt(self, pairing: str, handle: int, kv: torch.Tensor, length: int, reserve_tokens: int = 0) -> bool:
        self.adopted.append((pairing, handle, kv.shape[0], length))
        self.reserved = reserve_tokens
        return self.room

    def release_placed(self, pairing: str, handle: int) -> None:
        self.released.append((pairing, handle))


def test_the_placer_keeps_placed_kv_or_falls_back_to_sending_it() -> None:
    pool = make_scheduler().runner.pool
    placer = Placer(pool)
    d = Disagg(role="prefill", pairing="kv1", room=7, executor_pairing="pair1", handle=HANDLE_BASE + 5)
    plain = Disagg(role="prefill", pairing="kv1", room=8)
    assert not placer.place("r0", d, [1, 2], 7)  # no executor on this worker: the KV is sent
    host = placer.host = FakeHost(room=True)  # type: ignore[assignment]
    assert not placer.place("r1", plain, [1, 2], 7) and not host.adopted  # not chosen by the router
    assert placer.place("r2", d, [1, 2], 7, 30) and host.adopted == [("pair1", HANDLE_BASE + 5, 2, 7)]
    assert host.reserved == 30  # pages for the request's longest are set aside on the executor
    assert placer.sent("r2", ok=True) and not host.released
    assert placer.place("r3", d, [3], 2)
    assert placer.sent("r3", ok=False) and host.released == [("pair1", HANDLE_BASE + 5)]  # the header never went
    assert not placer.sent("r1", ok=True)  # a plain hand-off
    host.room = False  # the executor is full: sent as in plain PD
    assert not placer.place("r4", d, [1], 3) and "r4" not in placer.placed


def test_under_the_adrenaline_policy_placement_applies_c1_c2() -> None:
    """With OB from the `adrenaline` policy, a request is placed only if C1 or C2 holds for the loads
    the router sees (hand-computed below), on top of the share."""
    ap, pairing = placer(ratio=1.0)
    pairing.decision = SimpleNamespace(ob=0.5)
    p, d = SimpleNamespace(worker_id="P"), SimpleNamespace(worker_id="D", inflight={})

    def arrive(rid: str, prompt: int, max_new: int = 100, done: int = 0) -> Any:
        d.inflight[rid] = SimpleNamespace(prompt_tokens=None, est_prompt_tokens=prompt, completion_tokens=done,
                                          max_new_tokens=max_new)
        return ap.choose(rid, p, d)  # type: ignore[arg-type]

    # nothing local yet: C1 (0 + 600 < 0) and C2 (0 + 500 < 0) fail
    assert arrive("a", 500) is None
    # local: a = 500 tokens, 1 request. C1: 0 + 1100 < 250 no; C2: 0 + 1000 < 250 no
    assert arrive("b", 1000) is None
    # local: a, b = 1500 tokens, 2 requests (b has streamed 500 more: 2000). C1: 0 + 300 < 1000 yes
    d.inflight["b"].completion_tokens = 500
    assert arrive("c", 200) is not None
    # placed: c = 200 (1 request); local 2000 in 2. C1: 200 + 900 < 1000 no;
    # C2: 200 + 800 < 1000 no (not strictly)
    assert arrive("d", 800) is None
    # local now 2800 in 3 (d stayed). C1: 200 + 700 < 1400 yes
    assert arrive("e", 600) is not None
    # without OB (the other policies) only the share decides
    pairing.decision = SimpleNamespace(ob=None)
    assert arrive("f", 5000) is not None


def test_with_several_prefill_workers_the_decode_choice_prefers_the_paired_one() -> None:
    """Decode D2's Adrenaline executor is prefill worker P: a request prefilled on P goes to D2 (where
    it can keep its KV on P) unless D2 is more than PAIRED_SLACK_TOKENS behind the least loaded."""
    from router.placement.offload import OffloadPlacement
    from router.placement.pd import PAIRED_SLACK_TOKENS, PDPlacement

    def worker(wid: str, outstanding: int) -> Any:
        return SimpleNamespace(worker_id=wid, outstanding_tokens=outstanding, inflight={}, load=None, num_served=0)

    adr = SimpleNamespace(rule=OffloadSpec(from_="m", to="m", ratio=0.5), state="active", executor="P")
    weaver = SimpleNamespace(rule=OffloadSpec(from_="m", to="cold", ratio=0.5), state="active", executor="P")
    offload = SimpleNamespace(pairings={"D2": adr, "D3": weaver})
    executor_of = partial(OffloadPlacement.adrenaline_executor, offload)  # the wiring of strategies.py
    planner = PDPlacement(SimpleNamespace(), executor_of)  # type: ignore[arg-type]
    p, p2 = worker("P", 0), worker("P2", 0)
    d1, d2, d3 = worker("D1", 100), worker("D2", 100 + PAIRED_SLACK_TOKENS), worker("D3", 0)
    assert planner._pick_decode(p, [d1, d2]) is d2  # within the slack
    assert planner._pick_decode(p2, [d1, d2]) is d1  # D2's executor is not P2: least loaded
    d2.outstanding_tokens += 1
    assert planner._pick_decode(p, [d1, d2]) is d1  # too far behind
    assert planner._pick_decode(p, [d1, d3]) is d3  # a WEAVER pairing is not a placement: least loaded
    adr.state = "lost"
    d2.outstanding_tokens = 150
    assert planner._pick_decode(p, [d1, d2]) is d1


def test_a_pd_decode_queue_that_cannot_be_admitted_keeps_the_loop_overlapped() -> None:
    """Plain PD on a KV-bound decode worker: requests wait with their staged KV, the head cannot fit
    beside the decode reserve, and the overlap loop keeps running ahead (it drained whenever one page
    was spare). Outputs are a plain run's."""
    lengths = [40, 38, 36, 34, 44, 42, 39, 41]

    def rs() -> list[Req]:
        return [Req(f"r{i}", p, greedy(MAX_NEW)) for i, p in enumerate(prompts(lengths))]

    want = run_all(make_scheduler(), rs())

    def run(old_rule: bool) -> int:
        base = make_scheduler(max_total_tokens=200)
        s = Scheduler(base.args, base.runner, base.page_size, base.eos_ids, vocab_size=VOCAB, overlap=True)
        if old_rule:
            assert s.overlap is not None
            s.overlap._admission_blocked = lambda: (len(s.running) >= s.max_running  # type: ignore[method-assign]
                                                    or s.kv.available_pages - s.decode_reserve() < 1)
        out: dict[str, list[int]] = {}
        for r in rs():
            first, kv = prefill(r)
            r.output_ids, out[r.rid] = [first], [first]
            s.handoff.add_prefilled(r, kv)
        drive(s, out)
        assert out == want
        return s.overlapped_steps

    assert run(old_rule=False) > run(old_rule=True)
