"""The strict knee search of bench/goodput_knee.py, run on the simulator instead of a GPU. SIMULATED.

Same plan as the GPU tool (its `Plan`, `next_rate` and `bracket`, imported, not copied): a point (run,
rate) is `repeats` replays of n = max(min_req, rate x seconds) requests, repeat k at trace offset
k x stride with arrival seed k, the same rows and arrival times for every run; a point passes when the
mean both-SLO attainment over its repeats is >= target; the union rule and bisection to within 10 %
decide the next rate. Each repeat's requests are built from the very serving.py argument list the GPU
tool would pass (`goodput_knee.serving_argv`, parsed by serving.py's parser), and are replayed by
`replay_sweeps.predict`'s path (the real Scheduler, the calibrated clock, serving.py's max_duration).

Besides attainment each repeat records why it missed: the share of the replay's time the GPU was busy
(forwards priced by the cost model) and the prefill share of it, the KV requests held against the pool
(pages neither free nor evictable prefix cache, peak and mean over steps), the waiting queue, rotations
and preemptions. Where the pool filled and requests were rotated out or preempted, KV binds; where it
never filled while the GPU was busy, compute does.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench import goodput as G
from bench import goodput_knee as K
from bench.policy_sim import Clock, forward_seconds, make_scheduler, replay, serving_workload
from bench.serving import build_parser as serving_parser
from bench.sim.cost import CostModel
from bench.sim.replay_sweeps import run_of, serving_config
from bench.traces import default_traces_dir


@dataclass(frozen=True)
class Setting:
    """One workload of the sweep: what the GPU call's knee step would be given (TRACE, ARRIVAL, ...)."""

    name: str
    trace: str
    arrival: str  # poisson | burst (serving.py's burst: 4x the quiet rate for 5 s of every 30 s)
    grid: tuple[float, ...]
    max_in: int
    max_out: int = 256
    ttft: float = 5.0
    tpot: float = 0.1


@dataclass(frozen=True)
class Server:
    """The simulated server: its pool as the real one logged it, the host pool, the priced model."""

    pool_tokens: int
    host_gb: float
    cost: CostModel


def point_config(st: Setting, plan: K.Plan, rate: float, repeat: int) -> dict[str, Any]:
    """serving.py's parsed flags (a report's `config`) for one repeat of one point, from the argument
    list goodput_knee.py would pass: the same rows, offsets, seed and max_duration as on the GPU."""
    a = argparse.Namespace(trace=st.trace, traces_dir=default_traces_dir(), arrival=st.arrival, max_in=st.max_in,
                           max_out=st.max_out, ttft=st.ttft, tpot=st.tpot, vocab_size=32000)
    argv = K.serving_argv(a, plan, "sim", rate, repeat, "http://127.0.0.1:1", Path("/nonexistent"), "sim")
    return vars(serving_parser().parse_args(argv))


# Run variants the simulated search knows, as goodput_knee.py names them (POLICY-MODE.NAME): their server
# arguments. The GPU tool takes any launcher flags (`--variant NAME=FLAGS`); the simulator prices only the
# scheduler options its real Scheduler reads (replay_sweeps.SIM_FLAGS).
VARIANTS: dict[str, dict[str, Any]] = {"missed": {"lvf_missed_last": True}}  # --lvf-missed-last


def variant_args(run: str) -> dict[str, Any] | None:
    """`lvf-rotate.missed` -> its server arguments; a plain run -> None; an unknown variant is refused."""
    if "." not in run:
        return None
    name = run.split(".", 1)[1]
    if name not in VARIANTS:
        raise SystemExit(f"run {run!r}: the simulator knows the variants {', '.join(sorted(VARIANTS))} "
                         f"(bench/sim/knee.py VARIANTS), not {name!r}")
    return VARIANTS[name]


def simulate(cfg: dict[str, Any], run: str, server: Server) -> dict[str, Any]:
    """One repeat on the simulator: attainment over the scheduled requests (unsent or unfinished at
    max_duration: misses, as serving.py), and what bound it (GPU busy share, KV held, queue, copies)."""
    ttft, tpot, horizon = float(cfg["ttft_slo"]), float(cfg["tbt_slo"]), float(cfg["max_duration"])
    reqs = serving_workload(serving_config(cfg))
    policy, mode = run_of(run)
    clock = Clock()
    context = max(len(ids) + n for _, ids, n in reqs) + 16
    s = make_scheduler(policy, mode, server.pool_tokens, server.host_gb, ttft, tpot, clock, server.cost, 16,
                       context, skip_forward=True, host_time=True, extra=variant_args(run))
    busy = [0.0, 0.0, 0.0]  # forward seconds: all, of steps carrying a prefill chunk; forwards
    held: list[float] = []
    waiting: list[int] = []
    timed = s.runner.forward

    def forward(batch: Any) -> Any:
        dt = forward_seconds(server.cost, batch, True)
        busy[0] += dt
        busy[1] += dt if any(n > 1 for n in batch.extend_lens) else 0.0
        busy[2] += 1
        return timed(batch)

    step = s.step

    def probed() -> Any:
        out = step()
        cap = s.allocator.capacity  # pages neither free nor evictable prefix cache: what requests hold
        held.append((cap - s.allocator.num_free - s.kv.cache.size_info().evictable_pages) / cap)
        waiting.append(len(s.waiting))
        return out

    s.runner.forward = forward  # type: ignore[method-assign]
    s.step = probed  # type: ignore[method-assign]
    res = replay(s, clock, [r for r in reqs if r[0] < horizon], horizon_s=horizon)
    met = {"both": 0, "ttft": 0, "tbt": 0}
    ttfts = []
    for i, (_, _, n_out) in enumerate(reqs):
        ts = res["times"].get(f"q{i}", [])
        if len(ts) < n_out:
            continue
        first = ts[0] - res["arrival"][f"q{i}"]
        mean = (ts[-1] - ts[0]) / (len(ts) - 1) if len(ts) > 1 else 0.0
        ttfts.append(first)
        met["ttft"] += first <= ttft
        met["tbt"] += mean <= tpot
        met["both"] += first <= ttft and mean <= tpot
    n = len(reqs)
    span = reqs[-1][0] if reqs else 0.0
    return {**{k: v / n for k, v in met.items()}, "scheduled": n, "realized_rate": (n - 1) / span if span else 0.0,
            "mean_input": float(np.mean([len(ids) for _, ids, _ in reqs])),
            "mean_output": float(np.mean([n_out for _, _, n_out in reqs])),
            "gpu_busy": busy[0] / clock.t if clock.t else 0.0, "prefill_share": busy[1] / busy[0] if busy[0] else 0.0,
            "step_ms": 1e3 * busy[0] / busy[2] if busy[2] else 0.0,
            "kv_held_peak": max(held, default=0.0), "kv_held_mean": float(np.mean(held)) if held else 0.0,
            "waiting_peak": max(waiting, default=0), "rotations_out": res["rotations"],
            "preemptions": res["preemptions"], "end_s": clock.t,
            "ttft_median_s": float(np.median(ttfts)) if ttfts else math.nan}


def point(st: Setting, plan: K.Plan, run: str, rate: float, server: Server) -> dict[str, Any]:
    """Every repeat of one point and their mean (the curve's value)."""
    reps = [simulate(point_config(st, plan, rate, k), run, server) for k in range(plan.repeats)]
    mean = {k: float(np.mean([r[k] for r in reps])) for k in reps[0] if isinstance(reps[0][k], int | float)}
    return {"run": run, "rate": rate, "n": plan.n(rate), "offsets": [plan.offset(k) for k in range(plan.repeats)],
            "both": mean["both"], "both_range": [min(r["both"] for r in reps), max(r["both"] for r in reps)],
            "mean": mean, "repeats": reps}


def goodput_of(curve: dict[float, float], plan: K.Plan) -> dict[str, Any]:
    """Strict goodput of a mean curve: the highest rate with every lower swept rate also passing."""
    lo, hi = K.bracket(curve, plan.target)
    if lo is None:
        text = f"< {min(curve):g}" if curve else "not run"
    elif hi is None:
        text = f">= {lo:g}"
    else:
        text = f"{lo:g}"
    return {"goodput": lo, "first_failing": hi, "text": text, "lower_bound": hi is None and lo is not None}


def search(st: Setting, runs: Sequence[str], plan: K.Plan, server: Server,
           log: Callable[[str], None] = print,
           reuse: Mapping[tuple[str, float], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Every run's knee under goodput_knee.py's rules (union of rates below each run's first failure,
    bisection to the plan's tolerance, `extend` steps above a grid that all passed). `reuse`: points of
    an earlier search of the same setting, plan and server, by (run, rate), taken instead of replayed
    (the replay is deterministic, so the search takes the same path)."""
    curves: dict[str, dict[float, float]] = {r: {} for r in runs}
    points: list[dict[str, Any]] = []
    moved = True
    while moved:
        moved = False
        for run in runs:
            while True:
                others = [x for o in runs if o != run for x in curves[o]]
                rate = K.next_rate(curves[run], others, plan)
                if rate is None:
                    break
                t0 = time.perf_counter()
                p = reuse[run, rate] if reuse and (run, rate) in reuse else point(st, plan, run, rate, server)
                curves[run][rate] = p["both"]
                points.append(p)
                moved = True
                m = p["mean"]
                log(f"{st.name:<24} {run:<15} {rate:>6g} n={p['n']:<4} both {100 * p['both']:5.1f} % "
                    f"[{100 * p['both_range'][0]:.0f}-{100 * p['both_range'][1]:.0f}]  TTFT {100 * m['ttft']:5.1f}  "
                    f"TPOT {100 * m['tbt']:5.1f}  busy {100 * m['gpu_busy']:3.0f} % "
                    f"(prefill {100 * m['prefill_share']:3.0f} %, "
                    f"step {m['step_ms']:3.0f} ms)  queue {m['waiting_peak']:3.0f}  KV peak "
                    f"{100 * m['kv_held_peak']:3.0f} % mean {100 * m['kv_held_mean']:3.0f} %  rot "
                    f"{m['rotations_out']:.0f} pre {m['preemptions']:.0f}  ({time.perf_counter() - t0:.0f} s)")
    good = {run: goodput_of(curves[run], plan) for run in runs}
    return {"setting": st.__dict__ | {"grid": list(st.grid)}, "plan": {"grid": list(plan.rates),
            "repeats": plan.repeats, "seconds": plan.seconds, "min_req": plan.min_req, "target": plan.target,
            "tolerance": plan.tolerance, "extend": plan.extend, "stride": plan.stride,
            "offsets": [plan.offset(k) for k in range(plan.repeats)]},
            "goodput": good, "ratio": ratio(good), "points": sorted(points, key=lambda p: (p["run"], p["rate"])),
            "binding": {run: binding(points, run, good[run]) for run in runs}}


def ratio(good: dict[str, dict[str, Any]], num: str = "lvf-rotate", den: str = "fcfs-recompute") -> str:
    """lvf / fcfs strict goodput as text: a number, a bound, or why there is none."""
    if num not in good or den not in good:
        return "n/a"
    a, b = good[num], good[den]
    if a["goodput"] is None or b["goodput"] is None:
        return "n/a (a run is below its lowest rate)"
    r = a["goodput"] / b["goodput"]
    if a["lower_bound"] or b["lower_bound"]:
        return f"{r:.2f}x (a lower bound is involved: {a['text']} / {b['text']})"
    return f"{r:.2f}x"


def binding(points: Sequence[dict[str, Any]], run: str, good: dict[str, Any]) -> dict[str, Any]:
    """What binds at the knee: the run's first failing point (else its highest). KV binds where the running
    requests' KV reached >= 90 % of the pool and requests were rotated out or preempted; compute binds
    where the pool never filled but the GPU was busy >= 90 % of the replay (the simulated GPU steps
    whenever a request runs, so busy alone says little below the knee: the prefill share of the GPU's
    time, the step time and the queue say where it went)."""
    mine = {p["rate"]: p for p in points if p["run"] == run}
    if not mine:
        return {"at": None, "verdict": "not run"}
    at = good["first_failing"] if good["first_failing"] is not None else max(mine)
    m = mine[at]["mean"]
    kv = m["kv_held_peak"] >= 0.9 and (m["rotations_out"] > 0 or m["preemptions"] > 0)
    compute = m["gpu_busy"] >= 0.9
    verdict = ("both (GPU busy and pool full)" if kv and compute else "KV" if kv else "compute" if compute
               else "neither clearly (GPU idle part of the time, pool not full)")
    return {"at": at, "verdict": verdict, "gpu_busy": m["gpu_busy"], "kv_held_peak": m["kv_held_peak"],
            "kv_held_mean": m["kv_held_mean"], "prefill_share": m["prefill_share"], "step_ms": m["step_ms"],
            "rotations_out": m["rotations_out"], "preemptions": m["preemptions"],
            "waiting_peak": m["waiting_peak"], "ttft_attainment": m["ttft"], "tpot_attainment": m["tbt"]}


def pool_check(st: Setting, plan: K.Plan, run: str, rate: float, server: Server, factor: float = 2.0
               ) -> dict[str, Any]:
    """Does KV bind at a failing point? The same point with the GPU pool `factor` times larger (a
    counterfactual: no H200 has that room beside Mixtral) and everything else equal. Passing there means
    the pool, not compute, failed it; failing there too means compute does (or both)."""
    big = Server(int(server.pool_tokens * factor), server.host_gb, server.cost)
    p = point(st, plan, run, rate, big)
    m = p["mean"]
    passed = G.at_target(p["both"], plan.target)
    return {"factor": factor, "rate": rate, "both": p["both"], "both_range": p["both_range"], "ttft": m["ttft"],
            "tbt": m["tbt"], "kv_held_peak": m["kv_held_peak"], "step_ms": m["step_ms"], "passes": passed,
            "verdict": "KV binds (passes with the larger pool)" if passed
            else "compute binds too (fails with the larger pool)"}
