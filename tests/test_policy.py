"""Scheduling policies as plugins: VLT ordering (lvf), the swap baselines (wf, sf), and lvf's
degeneration to FCFS while everything fits (also end to end: the same steps as fcfs)."""

from __future__ import annotations

from _rotation_util import Clock, drive, reqs, rotating
from _tiny import greedy, prompts

from sglang_ext.kvcache.base import NoPrefixCache
from sglang_ext.scheduler.policy import FCFS, LargestVLTFirst, make_policy
from sglang_ext.scheduler.request import KVHome, Req, ReqStatus
from sglang_ext.server_args import ServerArgs

CACHE = NoPrefixCache(4)


def _req(rid: str, status: ReqStatus | KVHome, arrival: float, last_token: float | None = None,
         first_token: float | None = None, tokens: int = 1) -> Req:
    """A request in a queue (`status`), or rotary (`KVHome.HOST`: waiting, its KV in host memory)."""
    r = Req(rid, [5, 6, 7], greedy(), arrival_time=arrival)
    if isinstance(status, KVHome):
        status, r.home = ReqStatus.WAITING, status
    r.status, r.last_token_time = status, last_token
    r.first_token_time = first_token
    if last_token is not None or first_token is not None:
        r.output_ids = [9] * tokens
    return r


def _lvf(**kw: float) -> LargestVLTFirst:
    p = make_policy("lvf", ServerArgs(preemption_mode="rotate", schedule_policy="lvf", ttft_slo_ms=1000,
                                      tpot_slo_ms=100, **kw))  # type: ignore[arg-type]
    assert isinstance(p, LargestVLTFirst)
    return p


def test_vlt_definitions() -> None:
    p = _lvf(lvf_alpha=3.0, lvf_beta_ttft=0.0, lvf_beta_tpot=0.5)
    p.begin(10.0, fits=False)
    assert p.vlt(_req("w", ReqStatus.WAITING, arrival=8.0)) == 2.0  # 2 s late / 1 s SLO
    assert p.vlt(_req("q0", KVHome.HOST, arrival=9.0)) == 1.0  # no token yet: as a waiting one
    # running: decode lag in TPOT SLOs; 21 tokens in the 1 s since the first = 10 SLOs ahead
    assert abs(p.vlt(_req("r", ReqStatus.RUNNING, 0.0, first_token=9.0, tokens=21)) + 3 * 10) < 1e-9
    # back from rotation, behind schedule: positive, so not a victim
    assert p.vlt(_req("back", ReqStatus.RUNNING, 0.0, first_token=8.0, tokens=5)) > 0
    assert p.vlt(_req("prefill", ReqStatus.RUNNING, 0.0)) == 0.0  # no token yet
    # rotary: the same lag, less its tolerance beta_F. Out for 0.1 s but 10 SLOs ahead: not urgent
    ahead = _req("ahead", KVHome.HOST, 0.0, last_token=9.9, first_token=9.0, tokens=21)
    assert abs(p.vlt(ahead) - 3 * (-10 - 0.5)) < 1e-9
    # 2 SLOs behind (11 tokens in 1.2 s): urgent
    behind = _req("behind", KVHome.HOST, 0.0, last_token=9.5, first_token=8.8, tokens=11)
    assert abs(p.vlt(behind) - 3 * (2 - 0.5)) < 1e-9


def test_lvf_orders_by_deadline_and_preempts_the_furthest_ahead() -> None:
    p = _lvf()
    p.begin(10.0, fits=False)
    w_old = _req("w_old", ReqStatus.WAITING, arrival=7.0)  # 3.0 - 0.5 (beta_B)
    w_new = _req("w_new", ReqStatus.WAITING, arrival=9.9)  # 0.1 - 0.5
    rot = _req("rot", KVHome.HOST, 0.0, last_token=9.7, first_token=7.0, tokens=21)  # 3 * (10 - 0.5) = 28.5
    rot_ahead = _req("rot_ahead", KVHome.HOST, 0.0, last_token=9.99, first_token=9.0,
                     tokens=12)  # 3 * (-1 - 0.5) = -4.5
    # earliest deadline first: w_old's first token was due at 8.0, rot (1 s behind) at 9.0, rot_ahead
    # runs out of slack at 10.1, w_new's first token is due at 10.9
    assert [r.rid for r in p.candidates([w_new, w_old], [rot_ahead, rot], CACHE)] == [
        "w_old", "rot", "rot_ahead", "w_new"]
    long_run = _req("long", ReqStatus.RUNNING, 0.0, first_token=9.0, tokens=31)  # 3*(10-30) = -60
    mid_run = _req("mid", ReqStatus.RUNNING, 1.0, first_token=9.5, tokens=19)  # 3*(5-18) = -39
    short_run = _req("short", ReqStatus.RUNNING, 1.5, first_token=9.5, tokens=7)  # 3*(5-6) = -3
    just_in = _req("just_in", ReqStatus.RUNNING, 2.0)  # 0: no token yet
    running = [short_run, just_in, mid_run, long_run]
    assert [r.rid for r in p.victims(running)] == ["long", "mid", "short", "just_in"]


def _running(rid: str, first: float, tokens: int, left: int, kv: int = 100) -> Req:
    """A decoding request: `tokens` out since `first` (at 10.0), `left` more to go, `kv` tokens of KV."""
    r = _req(rid, ReqStatus.RUNNING, 0.0, first_token=first, tokens=tokens)
    r.sampling.max_new_tokens, r.kv_len = tokens + left, kv
    return r


def test_lvf_rotates_only_when_the_candidate_would_miss_and_the_victims_can_pay() -> None:
    p = _lvf()  # TTFT SLO 1 s, TPOT SLO 100 ms, alpha 3
    w = _req("w", ReqStatus.WAITING, arrival=9.7)  # 0.7 s of its TTFT budget left
    far = _running("far", 9.0, 91, left=100)  # 80 SLOs ahead: 8 s of slack
    near = _running("near", 9.5, 19, left=100)  # 13 SLOs ahead: 1.3 s
    p.begin(10.0, fits=False)
    assert p.make_room_for(w, [near, far], short_tokens=150) == []  # no step time measured yet
    p.tick(9.98)  # steps under pressure time the iteration
    p.tick(10.0)
    assert p.step_s is not None and abs(p.step_s - 0.02) < 1e-9
    # room comes in 100 steps (2 s): w would miss; only far's slack covers 2 x 2 s + 4 steps
    assert abs(p.wait_s([near, far], 150) - 2.0) < 1e-9
    assert [r.rid for r in p.make_room_for(w, [near, far], short_tokens=150)] == ["far"]
    # a request finishing in 5 steps frees the room in time: no one goes out
    soon = _running("soon", 9.9, 3, left=5, kv=400)
    assert p.make_room_for(w, [near, far, soon], short_tokens=150) == []
    # a TTFT already missed is not bought back at another stream's expense
    assert p.make_room_for(_req("late", ReqStatus.WAITING, arrival=8.5), [near, far], short_tokens=150) == []
    # no TPOT slack (as fast as the SLO, no faster): nobody can pay
    level = _running("level", 9.0, 11, left=100)
    assert p.make_room_for(w, [level], short_tokens=150) == []
    # a rotary stream 2 SLOs behind that can still recover its mean TPOT gets room; one within its
    # tolerance displaces no one (it resumes when there is room)
    behind = _req("behind", KVHome.HOST, 0.0, last_token=9.5, first_token=8.8, tokens=11)
    behind.sampling.max_new_tokens = 111
    assert [r.rid for r in p.make_room_for(behind, [near, far], short_tokens=150)] == ["far"]
    ahead = _req("ahead", KVHome.HOST, 0.0, last_token=9.99, first_token=9.0, tokens=12)
    assert p.make_room_for(ahead, [near, far], short_tokens=150) == []
    # hysteresis: a stream resumed 8 tokens ago is not a voluntary victim yet, however far ahead
    far.run_start_tokens = 91 - 8
    assert p.make_room_for(w, [near, far], short_tokens=150) == []
    far.run_start_tokens = 91 - LargestVLTFirst.MIN_STAY_TOKENS
    assert [r.rid for r in p.make_room_for(w, [near, far], short_tokens=150)] == ["far"]
    # the overlap loop's cheap question: never False where make_room_for would name a victim
    assert p.may_rotate_for(w, [near, far], 10.0)
    assert not p.may_rotate_for(w, [level], 10.0)  # no one has slack
    assert not p.may_rotate_for(_req("late", ReqStatus.WAITING, arrival=8.5), [near, far], 10.0)
    # even room for all of its KV comes within its budget: no rotation could be decided, so it overlaps
    assert not p.may_rotate_for(w, [near, far, soon], 10.0)


def test_lvf_missed_last_puts_requests_past_saving_behind_the_rest() -> None:
    """--lvf-missed-last: a waiting request whose TTFT has passed, or a stream that cannot recover its
    mean TPOT, goes behind the candidates that can still make it; within each group the deadline order
    stands. Off (the default), a late head stays first, and `make_room_for` refuses it, so admission
    (which stops at the first candidate that does not fit) would make no room for the ones behind."""
    late = _req("late", ReqStatus.WAITING, arrival=8.5)  # TTFT 1 s: due at 9.5, missed
    w = _req("w", ReqStatus.WAITING, arrival=9.7)  # 0.7 s left
    lost = _req("lost", KVHome.HOST, 0.0, last_token=5.0, first_token=4.0, tokens=11)  # 50 SLOs behind
    lost.sampling.max_new_tokens = 20  # 9 tokens to go at most: 9 x (0.1 - 0.02) s cannot repay 5 s
    behind = _req("behind", KVHome.HOST, 0.0, last_token=9.5, first_token=8.8, tokens=11)  # 1 s behind
    behind.sampling.max_new_tokens = 111  # 100 tokens x 0.08 s of margin repay it
    far = _running("far", 9.0, 91, left=100)
    for on, order in ((False, ["lost", "late", "behind", "w"]), (True, ["behind", "w", "lost", "late"])):
        p = _lvf(lvf_missed_last=on)
        p.begin(9.98, fits=False)
        p.tick(9.98)
        p.tick(10.0)  # a 20 ms step under pressure
        p.begin(10.0, fits=False)
        assert [r.rid for r in p.candidates([w, late], [behind, lost], CACHE)] == order
        assert p.missed(late) and p.missed(lost) and not p.missed(w) and not p.missed(behind)
        assert p.make_room_for(late, [far], short_tokens=150) == []  # the head, when off: no room for it
        assert [r.rid for r in p.make_room_for(w, [far], short_tokens=150)] == ["far"]
    p = _lvf(lvf_missed_last=True)
    p.begin(10.0, fits=True)  # while everything fits it is FCFS, flag or not
    assert [r.rid for r in p.candidates([w, late], [], CACHE)] == ["late", "w"]


def test_lvf_is_fcfs_while_everything_fits() -> None:
    p, f = _lvf(), FCFS()
    p.begin(10.0, fits=True)
    waiting = [_req("b", ReqStatus.WAITING, 5.0), _req("a", ReqStatus.WAITING, 1.0)]
    rotary = [_req("c", KVHome.HOST, 3.0, last_token=4.0)]
    running = [_req("x", ReqStatus.RUNNING, 0.5), _req("y", ReqStatus.RUNNING, 4.0)]
    assert p.candidates(waiting, rotary, CACHE) == f.candidates(waiting, rotary, CACHE)
    assert [r.rid for r in p.candidates(waiting, rotary, CACHE)] == ["a", "c", "b"]
    assert p.victims(running) == f.victims(running) and p.make_room_for(waiting[0], running) == []


def test_swap_baselines_order_the_two_queues() -> None:
    waiting = [_req("w2", ReqStatus.WAITING, 2.0), _req("w1", ReqStatus.WAITING, 1.0)]
    rotary = [_req("q3", KVHome.HOST, 3.0, last_token=4.0), _req("q0", KVHome.HOST, 0.0, last_token=4.0)]
    assert [r.rid for r in make_policy("wf").candidates(waiting, rotary, CACHE)] == ["w1", "w2", "q0", "q3"]
    assert [r.rid for r in make_policy("sf").candidates(waiting, rotary, CACHE)] == ["q0", "q3", "w1", "w2"]
    assert [r.rid for r in make_policy("fcfs").candidates(waiting, rotary, CACHE)] == ["q0", "w1", "w2", "q3"]


def test_lvf_end_to_end_equals_fcfs_when_the_pool_is_large() -> None:
    """Same batches, same outputs, step by step, and no rotation."""
    ps = prompts([5, 17, 33, 9, 40, 3])
    steps: dict[str, list[list[tuple[str, int]]]] = {}
    for policy in ("lvf", "fcfs"):
        s, clock = rotating(policy, max_total_tokens=4096)
        trace: list[list[tuple[str, int]]] = []
        steps[policy] = trace
        orig = s._run

        def spy(entries, mode, orig=orig, trace=trace):  # type: ignore[no-untyped-def]
            trace.append([(e.req.rid, e.extend) for e in entries])
            return orig(entries, mode)

        s._run = spy  # type: ignore[method-assign]
        drive(s, reqs(ps, 8), clock, every=2)
        assert s.rot is not None and s.rot.rotations_out == 0
    assert steps["lvf"] == steps["fcfs"] and len(steps["lvf"]) > 10


def test_injected_clock_drives_vlt() -> None:
    s, clock = rotating("lvf")
    assert isinstance(clock, Clock) and s.clock is clock
    r = Req("a", prompts([6])[0], greedy(3))
    clock.t = 4.0
    drive(s, [r], clock, dt=0.5)
    assert r.first_token_time == 4.5 and r.last_token_time is not None and r.last_token_time > 4.5
