"""Why the cost model misses Mixtral's batch-1 decode step, and what a term for it would cost.

    python -m bench.sim.moe_occupancy [--out FILE]

The calibrated MoE decode form (bench/sim/cost.py) reads the experts hit at one fitted rate. At batch 1
Mixtral-8x7B hits 2 of 8 experts a layer, and the tuned grouped GEMMs (sglang_ext/ops/moe/configs) then
launch few programs: the down projection at T=1 runs 2 experts x 4096 / BLOCK_N 64 = 128 programs on 132
SMs, each streaming a 64 x 14,336 tile, so the step reaches 76.5 % of its roofline against 95 % at bs 8
(bench/results/2026-12-03-h200-s5, summary-mixtral-8x7b.txt). The fitted form reads the experts ~11 % too
fast there.

This command refits the `moe` rates with one more factor: each grouped GEMM's bytes are read at the
fitted rate divided by an occupancy f = C / (C + h x SMs), C its programs (experts hit x M blocks x N
blocks from the tuned block sizes), h swept. It prints, per h, the fitted expert rate, the fit and
held-out errors (ctx 1K fitted, ctx 8K held out, as bench/sim/fit.py splits them) and whether the fitted
rate stays under the HBM read the same runs measured. It changes no calibration: an analysis to read,
kept so that its numbers can be rerun (docs/benchmarks.md, "Simulator cost model").
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.sim.cost import DEFAULT_CALIBRATION
from bench.sim.fit import _nnls_rel, moe_design, moe_reports, moe_split
from bench.sim.geometry import DTYPE_BYTES, Geometry
from bench.sim.runs import DecodeRow, decode_rows, find_reports, report_geometry
from sglang_ext.ops.moe.configs import get_config, split

SMS = 132  # H200 (and H100 SXM)
DEVICE = "NVIDIA_H200"  # the tuned tables the measured runs used
FIT_CTX = 1024


def programs(geo: Geometry, bs: int, hit: float) -> tuple[int, int]:
    """(gate/up, down) programs one sparse layer launches at `bs` tokens with `hit` experts hit."""
    inter = geo.expert_bytes // (3 * geo.hidden * DTYPE_BYTES)
    up, down = split(get_config(bs, geo.top_k, geo.num_experts, inter, geo.hidden, torch.bfloat16, DEVICE))
    m_blocks = hit * math.ceil(bs * geo.top_k / hit / up["BLOCK_M"])  # pairs per expert hit, in M blocks
    return (round(m_blocks * math.ceil(inter / up["BLOCK_N"])),  # gate and up tiles in one program
            round(m_blocks * math.ceil(geo.hidden / down["BLOCK_N"])))


def slowdown(geo: Geometry, bs: int, hit: float, h: float) -> float:
    """Expert bytes' read time over the fitted rate's: 2/3 of the bytes in gate/up, 1/3 in down."""
    if h <= 0:
        return 1.0
    c_up, c_down = programs(geo, bs, hit)
    return 2 / 3 * (1 + h * SMS / c_up) + 1 / 3 * (1 + h * SMS / c_down)


def fit(rows: Sequence[DecodeRow], geos: dict[str, Geometry], dec: dict[str, Any], h: float,
        fitted_runs: Sequence[str] | None = None) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """bench/sim/fit.py's fit_moe with the occupancy factor, on the rows at FIT_CTX of `fitted_runs` (the
    calibration's, so that h = 0 is its fit; None: every run's); every row's error after the fit."""

    def design(d: DecodeRow) -> tuple[list[float], float]:
        geo = geos[d.model]
        hit = d.experts_hit if d.experts_hit is not None else geo.experts_hit(d.bs)
        return moe_design(geo, d.bs, d.ctx, d.experts_hit, dec, slowdown(geo, d.bs, hit, h))

    fitted = moe_split(rows, FIT_CTX, fitted_runs)["fit"]
    cols, known = zip(*(design(d) for d in fitted), strict=True)
    y = np.array([d.ms * 1e-3 for d in fitted])
    x, _ = _nnls_rel(np.array(cols), y - np.array(known), scale=y)
    out = []
    for d in rows:
        col, k = design(d)
        pred = float(np.dot(col, x) + k)
        out.append({"model": d.model, "bs": d.bs, "ctx": d.ctx, "measured_ms": d.ms, "predicted_ms": 1e3 * pred,
                    "error_pct": 100 * (pred / (d.ms * 1e-3) - 1), "set": "fit" if d in fitted else "held-out"})
    return {"expert_GBps": float(1 / x[0] / 1e9) if x[0] > 0 else math.inf, "layer_expert_us": float(x[1])}, out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--h", type=float, nargs="+", default=[0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8],
                   help="occupancy constants to sweep (0: today's form)")
    p.add_argument("--out", type=Path, help="JSON: every h, its rates and every row's error")
    a = p.parse_args(argv)
    cal = json.loads(DEFAULT_CALIBRATION.read_text())
    reports = moe_reports(find_reports())
    rows = [d for d in decode_rows(reports) if d.what == "offline step_ms"]
    if not rows:
        print("error: no MoE bench/offline.py decode rows under bench/results", file=sys.stderr)
        return 2
    geos = {r.model: report_geometry(r) for r in reports}
    hbm = float(cal["decode"]["hbm_read_GBps_measured"])
    print(f"{len(rows)} MoE decode rows ({', '.join(sorted(geos))}); HBM read measured {hbm:,.0f} GB/s")
    for name, geo in sorted(geos.items()):
        print(f"  {name} at bs 1: gate/up {programs(geo, 1, 2 if geo.top_k == 2 else geo.top_k)[0]} programs, "
              f"down {programs(geo, 1, 2 if geo.top_k == 2 else geo.top_k)[1]} on {SMS} SMs")
    print(f"{'h':>5} {'expert GB/s':>12} {'us/expert':>10} {'fit mean/max %':>16} {'held-out mean/max %':>20}  "
          "under HBM read")
    res = []
    for h in a.h:
        rates, errs = fit(rows, geos, cal["decode"], h, cal["sources"]["moe_fit"]["runs"])
        f = [abs(e["error_pct"]) for e in errs if e["set"] == "fit"]
        o = [abs(e["error_pct"]) for e in errs if e["set"] == "held-out"]
        print(f"{h:5.2f} {rates['expert_GBps']:12,.0f} {rates['layer_expert_us']:10.3f} "
              f"{np.mean(f):7.2f} / {max(f):5.2f} {np.mean(o):11.2f} / {max(o):5.2f}  "
              f"{'yes' if rates['expert_GBps'] <= hbm else 'NO'}")
        worst = max(errs, key=lambda e: abs(e["error_pct"]))
        print(f"      worst: {worst['model']} bs {worst['bs']} ctx {worst['ctx']} {worst['error_pct']:+.1f} %")
        res.append({"h": h, **rates, "rows": errs})
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"hbm_read_GBps_measured": hbm, "sms": SMS, "sweep": res}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
