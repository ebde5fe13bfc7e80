"""What lvf is for, on a synthetic clock: a burst of arrivals while long streams fill a small pool.
The streams decode 5x faster than their TPOT SLO, so lvf rotates the streams furthest ahead out to let
the burst in (first tokens within the TTFT SLO) and brings them back before they fall behind; FCFS
(recompute) makes the burst wait for the streams. Attainments are compared in clock time (one step =
10 ms), never wall time; greedy outputs equal an unconstrained pool's."""

from __future__ import annotations

import pytest
from _rotation_util import PAGE, Clock, reference, rotating
from _tiny import greedy, make_scheduler, prompts

from sglang_ext.scheduler.request import Req
from sglang_ext.scheduler.scheduler import Scheduler

STEP_S, TTFT_S, TPOT_S = 0.010, 0.100, 0.050
STREAMS, BURST, BURST_STEP, LONG, SHORT = 4, 6, 20, 60, 8


def _scheduler(policy: str, late: int) -> tuple[Scheduler, Clock]:
    slo = dict(max_total_tokens=96, ttft_slo_ms=TTFT_S * 1000, tpot_slo_ms=TPOT_S * 1000)
    if policy == "fcfs":
        s = make_scheduler(page_size=PAGE, **slo)  # the baseline: recompute
        clock = Clock()
        s.clock = clock
        return s, clock
    return rotating(policy, late=late, lvf_beta_ttft=0.5, **slo)


def _serve(policy: str, late: int = 0) -> tuple[list[Req], Scheduler]:
    s, clock = _scheduler(policy, late)
    ps = prompts([8] * (STREAMS + BURST), seed=11)
    rs = [Req(f"s{i}", ps[i], greedy(LONG)) for i in range(STREAMS)]
    rs += [Req(f"b{i}", ps[STREAMS + i], greedy(SHORT)) for i in range(BURST)]
    pending = list(rs)
    for step in range(3000):
        clock.t += STEP_S
        due = [r for r in pending if step >= (BURST_STEP if r.rid.startswith("b") else 0)]
        for r in due:
            r.arrival_time = clock.t
            s.add_request(r)
            pending.remove(r)
        if not pending and not s.has_work():
            break
        s.step()
        s.check()
    assert not pending and not s.has_work()
    return rs, s


def _attainment(rs: list[Req]) -> tuple[float, float]:
    assert all(r.first_token_time is not None and r.last_token_time is not None for r in rs)
    ttft = sum(r.first_token_time - r.arrival_time <= TTFT_S for r in rs)  # type: ignore[operator]
    tpot = sum((r.last_token_time - r.first_token_time) / (len(r.output_ids) - 1) <= TPOT_S  # type: ignore[operator]
               for r in rs)
    return ttft / len(rs), tpot / len(rs)


@pytest.mark.parametrize("late", [0, 2])
def test_lvf_serves_a_burst_within_its_ttft_slo_while_streams_keep_their_tpot(late: int) -> None:
    want = reference(prompts([8] * (STREAMS + BURST), seed=11), max_new=LONG)
    fcfs, _ = _serve("fcfs")
    lvf, s = _serve("lvf", late)
    for rs in (fcfs, lvf):  # greedy outputs as in an unconstrained pool (the burst stops at SHORT tokens)
        assert all(r.output_ids == want[f"r{i}"][: len(r.output_ids)] for i, r in enumerate(rs))
    ttft_fcfs, tpot_fcfs = _attainment(fcfs)
    ttft_lvf, tpot_lvf = _attainment(lvf)
    assert ttft_lvf > ttft_fcfs and tpot_lvf >= tpot_fcfs
    assert ttft_lvf == tpot_lvf == 1.0  # every request within both SLOs
    assert s.rot is not None and s.rot.rotations_out > 0
    # no thrash: each stream goes out and comes back a few times, not every step
    assert max(r.rotations for r in lvf) <= 3
