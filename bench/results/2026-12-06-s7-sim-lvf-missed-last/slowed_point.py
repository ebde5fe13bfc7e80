"""Replay one report of the Qwen3 uniform panel (lvf-rotate) on the simulator as `replay_sweeps.predict`
does, with the prefill forwards of its first ~14 s slowed by the factors the collapsed repeat's server
logged (rate 3, repeat 0, 2026-12-06 session 6), optionally with `--lvf-missed-last`.

    python bench/results/2026-12-06-s7-sim-lvf-missed-last/slowed_point.py --repeat 0 [--missed-last] [--plain]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench.policy_sim import Clock, make_scheduler, replay, serving_workload  # noqa: E402
from bench.sim import replay_sweeps as RS  # noqa: E402
from bench.sim.cost import CostModel  # noqa: E402
from bench.sim.instance import gpu_calibration  # noqa: E402

# (until simulated second, factor) for forwards with a prefill chunk: the server's step log of the collapsed
# repeat, its first 14 s (chunks of 5-8K tokens at 6-16K tok/s, against 34-37K later in the same repeat)
PROFILE = [(2.4, 4.0), (4.5, 2.4), (6.7, 5.0), (9.8, 1.7), (13.8, 3.1)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", default="3")
    p.add_argument("--repeat", type=int, default=0)
    p.add_argument("--missed-last", action="store_true", help="the run with --lvf-missed-last")
    p.add_argument("--plain", action="store_true", help="no slowdown (replay_sweeps' own prediction)")
    a = p.parse_args()
    torch.set_num_threads(1)
    folder = RS.RESULTS / "2026-12-06-h100-s6/qwen3-uniform-knee"
    path = folder / f"gp_lvf-rotate_r{a.rate}_k{a.repeat}.json"
    report = json.loads(path.read_text())
    sw = next(s for pn in RS.PANELS if "uniform" in pn.name for s in pn.sweeps)
    pool, _ = RS.pool_tokens(path, "lvf-rotate", sw, (0.0, 0.0))  # the pool its server logged
    cost = CostModel.load(gpu_calibration("h100")[0], "qwen3-30b-a3b")
    cfg = report["config"]
    ttft, tpot, horizon = float(cfg["ttft_slo"]), float(cfg["tbt_slo"]), float(cfg["max_duration"])
    reqs = serving_workload(RS.serving_config(cfg))
    clock = Clock()
    context = max(len(ids) + n for _, ids, n in reqs) + 16
    s = make_scheduler("lvf", "rotate", pool, sw.host_gb, ttft, tpot, clock, cost, 16, context, skip_forward=True,
                       host_time=True, extra={"lvf_missed_last": True} if a.missed_last else None)
    timed = s.runner.forward

    def slowed(batch):  # type: ignore[no-untyped-def]
        t0 = max(clock.t, clock.stall)
        out = timed(batch)
        if not a.plain and any(n > 1 for n in batch.extend_lens):
            clock.t = t0 + (clock.t - t0) * next((f for until, f in PROFILE if t0 < until), 1.0)
        return out

    s.runner.forward = slowed  # type: ignore[method-assign]
    res = replay(s, clock, [r for r in reqs if r[0] < horizon], horizon_s=horizon)
    met = 0
    for i, (_, _, n_out) in enumerate(reqs):
        ts = res["times"].get(f"q{i}", [])
        if len(ts) < n_out:
            continue
        mean = (ts[-1] - ts[0]) / (len(ts) - 1) if len(ts) > 1 else 0.0
        met += ts[0] - res["arrival"][f"q{i}"] <= ttft and mean <= tpot
    print(f"rate {a.rate} repeat {a.repeat} {'plain' if a.plain else 'slowed start'} "
          f"lvf{' --lvf-missed-last' if a.missed_last else ''}: both SLOs {100 * met / len(reqs):.1f} % "
          f"of {len(reqs)}, rotations {res['rotations']}, preemptions {res['preemptions']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
