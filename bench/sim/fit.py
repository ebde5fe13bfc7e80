"""Fit one GPU's cost-model rates to the measurements in bench/results and write the calibration file.

    python -m bench.sim.fit --out bench/sim/calibration/h200.json

Decode: step = max(W / weights_GBps, rows x F / gemm_TFLOPs) + KV / kv_GBps + rows x row_us + step_us,
least squares on relative error over the fit runs' decode rows (by default the largest offline sweep;
every other run is held out for bench/sim/validate.py). With one dense model W is the same in every row,
so W / weights_GBps and step_us cannot be told apart by a fit: weights_GBps is taken from the sweep's
torch-profiler GEMM time (bytes of weights / GEMM kernel time at bs 64, memory-bound there), and the
fit gives the rest. Prefill: GEMM FLOPs / gemm_TFLOPs + causal attention FLOPs / attention_TFLOPs on the
fit runs' single-request prefills. Host link, exchange and the executor host's slowdown are read from
their benches (see each function). MoE: the `moe` rates (expert bytes' read rate and a fixed cost per
sparse layer per expert; see `fit_moe`) are fitted to the MoE offline runs'
decode rows at `--moe-fit-ctx` (1K), the dense rates held fixed, and the `moe_prefill` rates (see
`fit_moe_prefill`) to their single-request prefills; their other rows (ctx 8K, prefill) are
held out, rows in `MOE_OUTLIERS` are reported, never fitted, and runs in `MOE_SUPERSEDED` (measured with
kernels the runtime no longer runs) are listed, never used. Anything not measured is null, with the
reason under `missing`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Final

import numpy as np

from bench.sim.cost import DEFAULT_CALIBRATION, GiB
from bench.sim.geometry import Geometry
from bench.sim.runs import (
    REPO,
    RESULTS,
    DecodeRow,
    PrefillRow,
    Report,
    commit_of,
    decode_rows,
    find_reports,
    prefill_rows,
    report_geometry,
)


def _nnls_rel(A: np.ndarray, y: np.ndarray, scale: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """Least squares of A x = y on relative residuals (relative to `scale`, default y), x >= 0 (columns
    whose weight turns negative are dropped and the rest refitted). Returns x and the sum of squared
    relative residuals."""
    w = 1.0 / (y if scale is None else scale)
    active = list(range(A.shape[1]))
    x = np.zeros(A.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(A[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            x[:] = 0.0
            x[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    r = (A @ x - y) * w
    return x, float(r @ r)


def fit_decode(rows: Sequence[tuple[int, int, float]], geo: Geometry, weights_GBps: float) -> dict[str, float]:
    """(bs, ctx, seconds) rows -> gemm_TFLOPs, kv_GBps, row_us, step_us, with weights_GBps given.
    The max() makes the GEMM rate nonlinear: a 1-D search over it (log grid, then golden section),
    linear non-negative least squares for the rest at each candidate."""
    bs = np.array([r[0] for r in rows], float)
    ctx = np.array([r[1] for r in rows], float)
    y = np.array([r[2] for r in rows], float)
    read = np.array([geo.weight_read_bytes(b) for b in bs]) / (weights_GBps * 1e9)
    A = np.stack([bs * ctx * geo.kv_bytes_per_token, bs, np.ones_like(bs)], axis=1)

    def loss(log_tflops: float) -> tuple[float, np.ndarray]:
        dense = np.maximum(read, bs * geo.flops_per_row / (10 ** log_tflops * 1e12))
        x, sse = _nnls_rel(A, y - dense)
        return sse, x

    grid = np.linspace(np.log10(20.0), np.log10(5000.0), 400)
    best = min(grid, key=lambda g: loss(g)[0])
    lo, hi = best - 0.02, best + 0.02
    phi = (5 ** 0.5 - 1) / 2
    for _ in range(60):
        a, b = hi - phi * (hi - lo), lo + phi * (hi - lo)
        if loss(a)[0] < loss(b)[0]:
            hi = b
        else:
            lo = a
    g = (lo + hi) / 2
    _, (inv_kv, row_s, step_s) = loss(g)
    return {"weights_GBps": weights_GBps, "gemm_TFLOPs": float(10 ** g),
            "kv_GBps": float(1 / inv_kv / 1e9) if inv_kv > 0 else float("inf"),
            "row_us": float(row_s * 1e6), "step_us": float(step_s * 1e6)}


MoeRow = tuple[Geometry, int, int, float, float | None]  # geometry, bs, ctx, seconds, measured experts hit


def moe_design(geo: Geometry, bs: int, ctx: int, hit: float | None, dec: dict[str, Any],
               expert_scale: float = 1.0) -> tuple[list[float], float]:
    """One MoE decode row's columns for fit_moe (expert bytes read, times `expert_scale`; per-expert fixed
    work) and its known part (dense weights, KV, rows and step constant at the dense rates `dec`)."""
    cols = [(geo.weight_read_bytes(bs, hit) - geo.dense_weight_bytes) * expert_scale,
            geo.sparse_layers * geo.num_experts * 1e-6]
    known = (geo.dense_weight_bytes / (dec["weights_GBps"] * 1e9)
             + bs * ctx * geo.kv_bytes_per_token / (dec["kv_GBps"] * 1e9)
             + (bs * dec["row_us"] + dec["step_us"]) * 1e-6)
    return cols, known


def fit_moe(rows: Sequence[MoeRow], dec: dict[str, Any]) -> dict[str, float]:
    """MoE decode rows -> moe.expert_GBps (expert bytes' read rate) and layer_expert_us (per sparse layer,
    per expert of the model), the dense rates `dec` held fixed (fitted to the dense model). Every MoE step
    measured is memory-bound (Mixtral bs 256: 9 ms of GEMM FLOPs at the decode rate against 24+ ms of
    reads), so the step is linear in the two unknowns: non-negative least squares on relative error of
    step - (dense weights + KV + rows + step constant). Other forms tried on the 2026-12-03 rows (a fixed
    cost per sparse layer, per expert hit, per routed pair) fitted worse or were dropped at 0."""
    A, known = zip(*(moe_design(geo, bs, ctx, hit, dec) for geo, bs, ctx, _, hit in rows), strict=True)
    y = np.array([r[3] for r in rows])
    x, _ = _nnls_rel(np.array(A), y - np.array(known), scale=y)
    return {"expert_GBps": float(1 / x[0] / 1e9) if x[0] > 0 else float("inf"), "layer_expert_us": float(x[1])}


# geometry, requests, tokens each, seconds[, tokens before each chunk (bench/offline.py's REQSxLEN@PREFIX)]
MoePrefillRow = tuple[Geometry, int, int, float] | tuple[Geometry, int, int, float, int]


def moe_prefill_columns(geo: Geometry, reqs: int, length: int, dec: dict[str, Any], pre: dict[str, Any],
                        attention: bool = False, prefix: int = 0) -> tuple[list[float], float]:
    """One MoE prefill's design row for fit_moe_prefill (expert bytes read, expert-layers hit, expert FLOPs,
    and with `attention` the causal attention FLOPs, a chunk's prefix included) and its known part: the
    non-expert GEMMs at the dense prefill rate, the step constant, and without `attention` the attention at
    the dense prefill rate."""
    tokens = reqs * length
    hit = geo.experts_hit(tokens)
    rest = 2.0 * geo.layer_params * tokens + 2.0 * geo.lm_head_params * reqs - geo.expert_flops(tokens)
    attn = reqs * geo.attention_flops(length, prefix + length)
    known = (max(geo.dense_weight_bytes / (dec["weights_GBps"] * 1e9), rest / (pre["gemm_TFLOPs"] * 1e12))
             + dec["step_us"] * 1e-6)
    cols = [geo.sparse_layers * hit * geo.expert_bytes, geo.sparse_layers * hit, geo.expert_flops(tokens)]
    if attention:
        cols.append(attn)
    else:
        known += attn / (pre["attention_TFLOPs"] * 1e12)
    return cols, known


# Distinct single-request prefill lengths from which fit_moe_prefill also fits the attention rate: the
# attention's L^2 is then told apart from the GEMMs' L (2026-12-07: Qwen3 on the H100, 256 to 8K tokens,
# attended at ~half the rate fitted to Llama-3-8B's two prefills). Fewer (the H200: 1K and 8K of each
# model) keep the dense prefill's attention rate, unless rows of equal tokens attend over different
# prefixes (`equal_token_pairs`), which tell the attention apart directly.
MOE_ATTENTION_MIN_LENGTHS: Final = 5


def equal_token_pairs(rows: Sequence[MoePrefillRow]) -> bool:
    """Some shape (requests, tokens each) was measured with two prefixes (bench/offline.py's 1x6144 and
    1x6144@1536): the same expert and GEMM work with different attention, the cleanest measure of the
    attention rate (2026-12-07 session 16: 359 TFLOP/s on the H100 from one call's such rows, where the lengths-only
    fit had read 181; `equal_token_attention_s` measures it)."""
    return equal_token_attention_s(rows) is not None


def fit_moe_prefill(rows: Sequence[MoePrefillRow], dec: dict[str, Any], pre: dict[str, Any]) -> dict[str, float]:
    """MoE prefill rows -> moe_prefill.expert_GBps, layer_expert_us, gemm_TFLOPs (and attention_TFLOPs: measured
    first from rows of equal tokens and different prefixes where there are some, `equal_token_attention_s`,
    the rest then fitted to what it leaves; else fitted jointly when the single-request rows span
    MOE_ATTENTION_MIN_LENGTHS lengths), the dense decode and prefill rates held
    fixed. Per sparse layer each expert hit is read once and pays a fixed cost, the expert FLOPs run at one
    grouped-GEMM rate, and the causal attention at its own: linear in the unknowns, non-negative least
    squares on relative error (columns scaled first: their magnitudes are 1e10 bytes, 1e3 expert-layers,
    1e13 FLOPs). A rate whose column the fit drops is infinite (that term costs nothing). With one model's
    rows (two token counts) the three are not identifiable: the fit then drops columns and what it returns
    does not transfer (validate's moe-cross prefill shows it)."""
    measured = equal_token_attention_s(rows)  # seconds a causal attention FLOP, where equal tokens tell it
    attention = measured is None and len({row[2] for row in rows if row[1] == 1}) >= MOE_ATTENTION_MIN_LENGTHS
    A, y, known = [], [], []
    for geo, reqs, length, sec, *more in rows:
        prefix = more[0] if more else 0
        cols, k = moe_prefill_columns(geo, reqs, length, dec, pre, attention or measured is not None, prefix)
        if measured is not None:  # the attention is known: the rest is fitted to what it leaves
            k += cols.pop() * measured
        A.append(cols)
        known.append(k)
        y.append(sec)
    a, t = np.array(A), np.array(y)
    sc = np.abs(a).max(axis=0)
    x, _ = _nnls_rel(a / sc, t - np.array(known), scale=t)
    x = x / sc
    out = {"expert_GBps": float(1 / x[0] / 1e9) if x[0] > 0 else float("inf"),  # dropped: no such term
           "layer_expert_us": float(x[1] * 1e6),
           "gemm_TFLOPs": float(1 / x[2] / 1e12) if x[2] > 0 else float("inf")}
    if measured is not None:
        out["attention_TFLOPs"] = float(1 / measured / 1e12)
    elif attention:
        out["attention_TFLOPs"] = float(1 / x[3] / 1e12) if x[3] > 0 else float("inf")
    return out


def equal_token_attention_s(rows: Sequence[MoePrefillRow]) -> float | None:
    """Seconds per causal attention FLOP from the rows that share a geometry and a shape (requests, tokens each)
    but attend over different prefixes: within each such group the time differences are the attention's alone
    (the experts, GEMMs, LM head rows and fixed costs are the same work), so a least-squares slope through
    the group-centred times and attention FLOPs measures it with nothing else fitted beside it. None without
    such a group (or a slope that is not positive)."""
    groups: dict[tuple[int, int, int], list[tuple[float, float]]] = {}
    for geo, reqs, length, sec, *more in rows:
        prefix = more[0] if more else 0
        groups.setdefault((id(geo), reqs, length), []).append((reqs * geo.attention_flops(length, prefix + length),
                                                              sec))
    dx, dy = [], []
    for g in groups.values():
        if len({f for f, _ in g}) < 2:
            continue
        fx, fy = np.mean([f for f, _ in g]), np.mean([t for _, t in g])
        dx += [f - fx for f, _ in g]
        dy += [t - fy for _, t in g]
    if not dx:
        return None
    x, y = np.array(dx), np.array(dy)
    slope = float(x @ y / (x @ x))
    return slope if slope > 0 else None


# Rows measured but not fitted, with the reason (source path suffix, bs, ctx): kept out of the fit and
# reported on their own by validate. The H200's one outlier (Mixtral bs 64 ctx 1K,
# 31.8 ms, no faster than bs 128) was in the s4 Mixtral run, superseded below; in the tuned-table rerun
# bs 64 takes 26.9 ms (bs 32 23.5, bs 128 27.8) and, held out of a trial fit, was predicted within 4.4 %
# like its neighbours, so it is fitted.
MOE_OUTLIERS: dict[tuple[str, int, int], str] = {
    # 2026-12-07 s12's bs 12 ran in the bs-16 graph before commit 2e5bb7a, when the graph's 4 padding rows
    # were routed to experts like real ones (a step of 16 rows' experts); remeasured at the new code in s14
    # (c1: 15.07 / 16.29 ms against 16.75 / 17.95). Its bs 24 rows (a graph size, no padding) stay fitted.
    ("2026-12-07-h100-s12/offline-qwen3-30b-a3b-uniform.json", 12, 1024):
        "measured before 2e5bb7a: the graph's padding rows reached experts (remeasured in 2026-12-07-h100-s14)",
    ("2026-12-07-h100-s12/offline-qwen3-30b-a3b-uniform.json", 12, 4096):
        "measured before 2e5bb7a: the graph's padding rows reached experts (remeasured in 2026-12-07-h100-s14)",
}

# MoE offline runs measured with kernels the runtime no longer runs (path suffix -> why, and the run that
# replaces it): neither fitted nor validated, listed in the calibration's sources.
MOE_SUPERSEDED: dict[str, str] = {
    "2026-12-03-h200-s4/c2-moebench-bench/offline-mixtral-8x7b.json":
        "measured with the untuned MoE block-size table (bs 64: 31.8 ms); superseded by "
        "2026-12-03-h200-s5/c2-moetune-moebench/offline-mixtral-8x7b.json, measured with the tuned table (T up "
        "to 256) and the GROUP_M 16 default the runtime now runs (bs 64: 26.9 ms)",
    "2026-12-07-h100-s15/c1-offline-qwen3-prefill.json":
        "its first prefills ran on a cold GPU (1x256 68.4 ms, 1x1024 60.1 ms: the first forwards of the call's "
        "first engine); superseded by 2026-12-07-h100-s15/c4-offline-qwen3-prefill.json, the same shapes after a "
        "1x2048 warm-up on the same machine (45.9 and 44.5 ms)",
}


def superseded_why(report: Report) -> str | None:
    """Why an MoE run is no longer used (MOE_SUPERSEDED), or None."""
    return next((why for suffix, why in MOE_SUPERSEDED.items() if report.rel().endswith(suffix)), None)


def moe_split(rows: Sequence[DecodeRow], fit_ctx: int,
              fitted_runs: Sequence[str] | None = None) -> dict[str, list[DecodeRow]]:
    """MoE decode rows -> fit (ctx == fit_ctx, not an outlier), held-out (every other ctx), outlier.
    `fitted_runs` (a calibration file's `sources.moe_fit.runs`): only those runs' rows are "fit"; a run
    measured after the file was fitted is held out whole, its rows at fit_ctx too."""
    out: dict[str, list[DecodeRow]] = {"fit": [], "held-out": [], "outlier": []}
    for d in rows:
        if any(d.source.endswith(src) and (d.bs, d.ctx) == (bs, ctx) for src, bs, ctx in MOE_OUTLIERS):
            out["outlier"].append(d)
        elif d.ctx == fit_ctx and (fitted_runs is None or any(f.endswith(d.source) for f in fitted_runs)):
            out["fit"].append(d)
        else:
            out["held-out"].append(d)
    return out


def moe_reports(reports: list[Report], superseded: bool = False) -> list[Report]:
    """bench/offline.py reports of MoE geometries (their preset checked against the run's weight bytes):
    the current ones, or (`superseded`) those MOE_SUPERSEDED retires."""
    return [r for r in reports if r.kind == "offline" and report_geometry(r).is_moe
            and (superseded_why(r) is not None) == superseded]


def fit_prefill(rows: Sequence[tuple[int, int, float]], geo: Geometry, step_us: float) -> dict[str, float]:
    """(reqs, len, seconds) rows, compute-bound -> gemm_TFLOPs, attention_TFLOPs."""
    lin = np.array([2.0 * geo.layer_params * q * n + 2.0 * geo.lm_head_params * q for q, n, _ in rows])
    att = np.array([q * geo.attention_flops(n, n) for q, n, _ in rows])
    y = np.array([t - step_us * 1e-6 for _, _, t in rows])
    x, _ = _nnls_rel(np.stack([lin, att], axis=1), y)
    return {"gemm_TFLOPs": float(1 / x[0] / 1e12) if x[0] > 0 else float("inf"),
            "attention_TFLOPs": float(1 / x[1] / 1e12) if x[1] > 0 else float("inf")}


def weights_rate(reports: list[Report], geo: Geometry) -> tuple[float | None, str]:
    """Weight bytes / GEMM kernel time from the fit runs' graph profiles (bs 64: memory-bound GEMMs)."""
    rates, where = [], []
    for r in reports:
        prof = (r.data.get("profile") or {}).get("graph") or {}
        gemm_us = (prof.get("by_category_us") or {}).get("gemm")
        bs = prof.get("bs")
        if gemm_us and bs and bs * geo.flops_per_row / 500e12 < geo.dense_weight_bytes / 4e12:
            rates.append(geo.dense_weight_bytes / (gemm_us * 1e-6) / 1e9)
            where.append(f"{r.rel()} profile.graph bs {bs} ctx {prof.get('ctx')}: gemm {gemm_us:.0f} us")
    if not rates:
        return None, "no torch-profiler GEMM time in the fit runs"
    return float(np.mean(rates)), "; ".join(where)


def host_link(reports: list[Report]) -> tuple[dict[str, float | None], str]:
    """The engine's copy method (kv_rotation's best_method, `batched`), host-contiguous layout, from the
    latest kv_rotation run; duplex = both directions at once, the sum."""
    runs = [r for r in reports if r.kind == "kv_rotation"]
    if not runs:
        return {"d2h_GBps": None, "h2d_GBps": None, "duplex_GBps": None}, "no bench/kv_rotation.py run"
    r = runs[-1]
    s = r.data["summary"]
    m = s["methods"][s.get("best_method", "batched")]
    return ({"d2h_GBps": m["out_host_contiguous_gbps"], "h2d_GBps": m["in_host_contiguous_gbps"],
             "duplex_GBps": m["duplex_gbps"], "peak_d2h_GBps": s["peak_gbps"]["out"],
             "peak_h2d_GBps": s["peak_gbps"]["in"], "peak_duplex_GBps": s["peak_gbps"]["duplex"]},
            f"{r.rel()} ({r.date}), method {s.get('best_method')}")


def plain_loop_host(results: Path, gpu: str) -> tuple[dict[str, float | None], str]:
    """Host time a step pays when the loop cannot overlap it with the previous step's forward: the engine
    overlaps decode steps only, so a prefill (or mixed) step is scheduled, built, run and landed with the
    GPU idle around its host work. bench/offline.py's `loop` rows of the plain Scheduler measure exactly
    that: step wall time - median forward GPU time; least squares on the batch's rows."""
    xs, ys, where = [], [], []
    for path in sorted(results.rglob("*.json")):
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        loop = d.get("loop") if isinstance(d, dict) else None
        env = d.get("env") if isinstance(d, dict) else None
        if not isinstance(loop, list) or not isinstance(env, dict):
            continue
        if gpu.lower() not in str(env.get("gpu", "")).lower():
            continue
        for row in loop:
            if row.get("scheduler") == "Scheduler" and row.get("step_wall_ms") and row.get("forward_gpu_ms_median"):
                xs.append(float(row["requests"]))
                ys.append(float(row["step_wall_ms"]) - float(row["forward_gpu_ms_median"]))
        if loop:
            where.append(str(path.relative_to(results)))
    if len(set(xs)) < 2:
        return {"plain_host_us": None, "plain_host_row_us": None}, "no bench/offline.py loop rows at two batch sizes"
    slope, icpt = np.polyfit(np.array(xs), np.array(ys), 1)
    return ({"plain_host_us": float(icpt) * 1e3, "plain_host_row_us": float(slope) * 1e3},
            f"{len(xs)} plain-loop rows (step wall - forward GPU) of " + ", ".join(where))


EXCHANGE_COLUMNS = {"signalled": "gpu_signalled_graph", "lean": "gpu_signalled_lean_graph",
                    "data_only": "data_only_graph"}


def exchange(reports: list[Report]) -> tuple[dict[str, dict[str, float | None]], dict[str, str]]:
    """Per-layer exchange us = base_us + per_row_us x bs, least squares over the latest two-GPU run
    holding each variant (graph mode); `two_process_mps` from the one-GPU MPS run."""
    out: dict[str, dict[str, float | None]] = {}
    src: dict[str, str] = {}
    runs = [r for r in reports if r.kind == "ra_exchange"]
    wanted = [(name, "two_gpu", col, lambda r: True) for name, col in EXCHANGE_COLUMNS.items()]
    wanted.append(("two_process_mps", "two_process", "gpu_signalled_graph", lambda r: "mps" in r.path.name))
    for name, topo, col, ok in wanted:
        pts: list[tuple[int, float]] = []
        for r in reversed(runs):
            pts = [(int(s["bs"]), float(s[col])) for s in r.data["summary"]
                   if s.get("topology") == topo and s.get(col) is not None]
            if pts and ok(r):
                src[name] = f"{r.rel()} ({r.date}) {topo} {col}"
                break
            pts = []
        if len(pts) < 2:
            out[name] = {"base_us": None, "per_row_us": None}
            continue
        bs = np.array([p[0] for p in pts], float)
        us = np.array([p[1] for p in pts])
        per_row, base = np.polyfit(bs, us, 1)
        out[name] = {"base_us": float(base), "per_row_us": float(per_row)}
    return out, src


def executor_host(reports: list[Report], geo: Geometry) -> tuple[dict[str, Any], dict[str, str]]:
    """The host model's step increase while its executor serves a guest: uncapped from the two-GPU run
    (a real sender), increase per GiB of guest KV held, least squares through 0; capped per
    executor_max_sms from the one-GPU run (emulated sender), the mean over its guest sizes, flat."""
    out: dict[str, Any] = {"uncapped_increase_per_guest_gib": None, "capped_increase": {}, "measured": []}
    src: dict[str, str] = {}
    for r in (r for r in reports if r.kind == "remote_host"):
        two_gpu = len(r.env.get("gpus") or []) >= 2
        for row in r.data["rows"]:
            gib = row["bs"] * row["share"] * row["ctx"] * geo.kv_bytes_per_token / GiB
            sms = int(row.get("executor_sms", 0))
            out["measured"].append({"source": r.rel(), "two_gpu": two_gpu, "executor_sms": sms, "guest_gib": gib,
                                    "increase": row["increase"], "host_alone_ms": r.data["host_alone_ms"]})
    two = [m for m in out["measured"] if m["two_gpu"] and m["executor_sms"] == 0]
    if two:
        g = np.array([m["guest_gib"] for m in two])
        inc = np.array([m["increase"] for m in two])
        out["uncapped_increase_per_guest_gib"] = float(g @ inc / (g @ g))
        src["uncapped"] = ", ".join(sorted({m["source"] for m in two}))
    capped: dict[int, list[float]] = {}
    for m in out["measured"]:
        if m["executor_sms"]:
            capped.setdefault(m["executor_sms"], []).append(m["increase"])
    out["capped_increase"] = {str(k): float(np.mean(v)) for k, v in sorted(capped.items())}
    if capped:
        src["capped"] = ", ".join(sorted({m["source"] for m in out["measured"] if m["executor_sms"]}))
    return out, src


def default_fit_runs(reports: list[Report], model: str) -> list[Report]:
    """The offline report with the most decode rows for `model` (the full sweep)."""
    offl = [r for r in reports if r.kind == "offline" and r.model == model]
    if not offl:
        raise SystemExit(f"no bench/offline.py report for {model} under {RESULTS}")
    return [max(offl, key=lambda r: (len(r.data["decode"]), r.date))]


def is_fit(row: DecodeRow | PrefillRow, fit_paths: set[str]) -> bool:
    if row.source not in fit_paths:
        return False
    return isinstance(row, DecodeRow) or row.single


def calibrate(results: Path, model: str, gpu: str, fit_runs: list[str] | None,
              moe_fit_ctx: int = 1024) -> dict[str, Any]:
    reports = find_reports(results, gpu)
    geo = Geometry.preset(model)
    fit = ([r for r in reports if any(r.rel() == f or str(r.path) == f for f in fit_runs)] if fit_runs
           else default_fit_runs(reports, model))
    fit_paths = {r.rel() for r in fit}
    missing: dict[str, str] = {}
    w, w_src = weights_rate(fit, geo)
    if w is None:
        w = float(np.mean([r.env["hbm_read_TBps"] * 1e3 for r in fit]))
        w_src = f"no profile: the runs' measured HBM read rate ({w_src})"
    drows = [(d.bs, d.ctx, d.ms * 1e-3) for d in decode_rows(reports) if d.model == model and is_fit(d, fit_paths)]
    dec: dict[str, Any] = dict(fit_decode(drows, geo, w))
    dec["hbm_read_GBps_measured"] = float(np.mean([r.env["hbm_read_TBps"] * 1e3 for r in fit]))
    prow = [(p.reqs, p.length, p.ms * 1e-3) for p in prefill_rows(reports) if p.model == model and is_fit(p, fit_paths)]
    pre: dict[str, Any] = dict(fit_prefill(prow, geo, dec["step_us"])) if len(prow) >= 2 else {
        "gemm_TFLOPs": None, "attention_TFLOPs": None}
    if pre["gemm_TFLOPs"] is None:
        why = "fewer than 2 prefill rows in the fit runs"
        missing["prefill.gemm_TFLOPs"] = missing["prefill.attention_TFLOPs"] = why
    link, link_src = host_link(reports)
    for k, rate in link.items():
        if rate is None:
            missing[f"host_link.{k}"] = link_src
    ex, ex_src = exchange(reports)
    for k, fitted in ex.items():
        if fitted["base_us"] is None:
            missing[f"remote_exchange.{k}"] = "no two-GPU bench/remote_attention.py exchange run with this variant"
    host, host_src = executor_host(reports, geo)
    if host["uncapped_increase_per_guest_gib"] is None:
        missing["executor_host.uncapped"] = "no two-GPU bench/remote_host.py run"
    loop, loop_src = plain_loop_host(results, gpu)
    if loop["plain_host_us"] is None:
        missing["loop.plain_host_us"] = loop_src
    moe_runs = moe_reports(reports)
    moe_paths = {r.rel() for r in moe_runs}
    split = moe_split([d for d in decode_rows(moe_runs)], moe_fit_ctx)
    moe: dict[str, float | None]
    if len(split["fit"]) >= 3:
        geos = {r.model: report_geometry(r) for r in moe_runs}
        moe = dict(fit_moe([(geos[d.model], d.bs, d.ctx, d.ms * 1e-3, d.experts_hit) for d in split["fit"]], dec))
    else:
        moe = {"expert_GBps": None, "layer_expert_us": None}
        missing["moe.expert_GBps"] = missing["moe.layer_expert_us"] = (
            f"fewer than 3 MoE bench/offline.py decode rows at ctx {moe_fit_ctx} on {gpu}")
    # every key the cost model reads, None until measured: a card whose MoE prefill is not fitted here takes
    # all five from --fill-from (the blend bounds too, without which the rates are not used at all)
    moe_pre: dict[str, float | None] = dict.fromkeys(
        ("expert_GBps", "layer_expert_us", "gemm_TFLOPs", "blend_from_tokens", "blend_to_tokens"))
    pre_fit = [p for p in prefill_rows(moe_runs) if p.moe_fitted]
    if moe["expert_GBps"] is not None and pre["gemm_TFLOPs"] is not None and len(pre_fit) >= 3:
        geos = {r.model: report_geometry(r) for r in moe_runs}
        moe_pre = dict(fit_moe_prefill([(geos[p.model], p.reqs, p.length, p.ms * 1e-3, p.prefix) for p in pre_fit],
                                       dec, pre))
        # where each form was measured: decode batches up to this many rows, prefills from this many tokens
        moe_pre["blend_from_tokens"] = float(max(d.bs for d in split["fit"]))
        moe_pre["blend_to_tokens"] = float(min(p.reqs * p.length for p in pre_fit))
    if any(v is None or not np.isfinite(v) for v in moe_pre.values()):
        missing["moe_prefill"] = (f"fewer than 3 single-request MoE prefill rows on {gpu}, or a rate the fit "
                                  "dropped: MoE prefill is priced with the dense prefill rates")
    missing.update(MISSING_ALWAYS)
    retired = {r.rel() for r in moe_reports(reports, superseded=True)}
    used = sorted({r.rel() for r in reports if r.kind != "offline" or r.model == model or r.rel() in moe_paths}
                  | retired)
    by_path = {r.rel(): r for r in reports}
    return {
        "schema": 1,
        "gpu": fit[0].gpu,
        "model_measured": model,
        "fitted_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git_head(),
        "command": "python -m bench.sim.fit " + " ".join(sys.argv[1:]),
        "decode": dec,
        "prefill": pre,
        "host_link": link,
        "remote_exchange": ex,
        "executor_host": host,
        "loop": loop,
        "moe": moe,
        "moe_prefill": moe_pre,
        "sources": {"loop": loop_src,
                    "moe_fit": {"ctx": moe_fit_ctx, "runs": sorted(moe_paths),
                                "rows": [f"{d.model} bs {d.bs} ctx {d.ctx}" for d in split["fit"]],
                                "held_out": [f"{d.model} bs {d.bs} ctx {d.ctx}" for d in split["held-out"]],
                                "excluded": [{"source": d.source, "bs": d.bs, "ctx": d.ctx,
                                              "why": next(w for (s, b, c), w in MOE_OUTLIERS.items()
                                                          if d.source.endswith(s) and (b, c) == (d.bs, d.ctx))}
                                             for d in split["outlier"]],
                                "superseded": [{"source": r.rel(), "why": superseded_why(r)}
                                               for r in moe_reports(reports, superseded=True)]},
                    "moe_prefill_fit": {"rows": [f"{p.model} {p.shape}" for p in pre_fit],
                                        "held_out": [f"{p.model} {p.shape}"
                                                     for p in prefill_rows(moe_runs) if not p.moe_fitted]},
                    "decode_fit": sorted(fit_paths), "weights_GBps": w_src, "prefill_fit": sorted(fit_paths),
                    "host_link": link_src, "remote_exchange": ex_src, "executor_host": host_src},
        "missing": missing,
        "runs": [{"path": p, "kind": by_path[p].kind, "date": by_path[p].date,
                  "commit_added": commit_of(by_path[p].path),
                  "report_git_commit": by_path[p].data.get("git_commit"), "fit": p in fit_paths,
                  "used_for": _used_for(by_path[p], fit_paths, [link_src, *ex_src.values()], moe_paths,
                                        moe_fit_ctx)} for p in used],
    }


FILLABLE: tuple[str, ...] = ("decode", "prefill", "host_link", "remote_exchange", "executor_host", "loop", "moe",
                             "moe_prefill")


def fill_missing(cal: dict[str, Any], other: dict[str, Any], source: str) -> dict[str, Any]:
    """Fill `cal`'s unmeasured rates (null) from `other`, a calibration of another card or a derived one, in
    place: a card profiled in part (an H100 with its own decode, prefill and MoE rows) keeps what it
    measured and borrows the rest. Every borrowed rate is listed under `filled_from` and leaves `missing`;
    a section measured here is never overwritten. Returns what was taken."""
    taken: dict[str, Any] = {}

    def walk(mine: dict[str, Any], theirs: dict[str, Any], path: str) -> None:
        for k, v in mine.items():
            t = theirs.get(k) if isinstance(theirs, dict) else None
            if v == {} and isinstance(t, dict) and t:  # nothing measured here (executor_host.capped_increase)
                mine[k] = json.loads(json.dumps(t))
                taken.update({f"{path}.{k}.{kk}"[1:]: vv for kk, vv in t.items()})
            elif isinstance(v, dict):
                walk(v, t if isinstance(t, dict) else {}, f"{path}.{k}")
            elif v is None and isinstance(t, int | float) and not isinstance(t, bool):
                mine[k] = t
                taken[f"{path}.{k}"[1:]] = t

    for section in FILLABLE:
        if isinstance(cal.get(section), dict) and isinstance(other.get(section), dict):
            walk(cal[section], other[section], f".{section}")
    for key in list(cal.get("missing", {})):  # "moe_prefill", "executor_host.uncapped", "prefill.gemm_TFLOPs", ...
        if any(t.startswith(key) for t in taken):
            del cal["missing"][key]
    cal["filled_from"] = {"file": source, "gpu": other.get("gpu"), "derived": "derived" in other,
                          "rates": taken}
    return taken


def _used_for(r: Report, fit_paths: set[str], sources: list[str], moe_paths: set[str], moe_ctx: int) -> str:
    why = superseded_why(r) if r.kind == "offline" else None
    if why is not None:
        return "not used: " + why
    if r.rel() in moe_paths:
        return (f"moe fit (decode rows at ctx {moe_ctx}, outliers excepted) and moe_prefill fit (single-request "
                "prefills); validation (held out): its other decode rows and its batched prefill")
    if r.kind == "offline":
        return "decode and prefill fit" if r.rel() in fit_paths else "validation (held out)"
    if r.kind == "remote_step" and r.env.get("executor_load"):
        return "validation: all-local steps held out (its remote rows ran beside an executor load: not used)"
    if r.kind == "remote_step":
        return "validation: all-local steps held out; remote-row steps"
    if r.kind == "remote_host":
        return "executor_host fit; its host-alone step held out"
    used = any(s.startswith(r.rel() + " ") for s in sources)
    if not used:
        return "not used (a later run supersedes it)"
    return "host_link" if r.kind == "kv_rotation" else "remote_exchange"


MISSING_ALWAYS: dict[str, str] = {
    "decode.moe_trained_routing": "the MoE runs (2026-12-03, Mixtral-8x7B and Qwen3-30B-A3B) use dummy weights "
                                  "with random routers: their measured experts hit equal the uniform-routing "
                                  "expectation within 1.5 %; a trained router's skew (fewer experts hit) is not "
                                  "measured",
    "decode.moe_other": "moe rates come from two MoE geometries (8 x 14336 and 128 x 768 experts) at ctx 1K "
                        "with the Triton MoE kernels (Mixtral with the tuned block-size table of 2026-12-03 s5); "
                        "other expert shapes and other kernels are unvalidated",
    "prefill.moe": "the moe_prefill rates come from two MoE geometries' single-request prefills of 1K and 8K tokens "
                   "(2026-12-03, Mixtral-8x7B tuned table, Qwen3-30B-A3B): each model alone cannot identify the "
                   "three rates (fitted on Qwen3 alone, Mixtral is 8-23 % over; on Mixtral alone, Qwen3 130-430 % "
                   "over), forwards below 1K tokens and other expert shapes are extrapolations, and a prefill chunk "
                   "mixed with decode rows is unmeasured",
    "decode.other_models": "dense decode rows are Llama-3-8B only; other dense geometries (Qwen2.5-32B) are "
                           "priced by bytes and FLOPs with the 8B's rates, unvalidated",
    "prefill.mixed_batches": "no measurement of a prefill chunk and decode rows in one forward; the sum form is "
                             "unvalidated",
    "host_link.c2c": "no GH200 (C2C) measurement: only the H200's PCIe link",
    "executor_host.capped_two_gpu": "capped figures are from one GPU with an emulated sender (2026-12-02); the "
                                    "two-GPU capped run is still to do",
    "remote_exchange.engine_lean_two_gpu": "`lean` is the bench's lean variant (2026-11-30, before issue 21 moved "
                                           "the engine to it); the engine's own lean exchange across two GPUs is "
                                           "not measured",
}


def _git_head() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=30, check=False).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Fit the simulator's cost model to bench/results (see module doc).")
    p.add_argument("--out", type=Path, default=DEFAULT_CALIBRATION, help="calibration file to write")
    p.add_argument("--results", type=Path, default=RESULTS, help="folder searched (recursively) for reports")
    p.add_argument("--model", default="llama-3-8b", help="the measured model's geometry preset")
    p.add_argument("--gpu", default="H200", help="use reports whose GPU name contains this")
    p.add_argument("--fit-runs", nargs="*", help="offline reports to fit (paths relative to the repo); default: "
                                                "the largest sweep; every other row is held out")
    p.add_argument("--moe-fit-ctx", type=int, default=1024,
                   help="fit the moe rates to the MoE offline runs' decode rows at this ctx (outliers in "
                        "MOE_OUTLIERS excepted); their rows at every other ctx are held out")
    p.add_argument("--fill-from", type=Path, default=None, metavar="JSON",
                   help="take every rate this card's runs leave unmeasured from this calibration (e.g. the derived "
                        "h100.json: an H100 with its own decode/prefill/MoE rows but no host-link, exchange or "
                        "executor-host run); each taken rate is listed under `filled_from`")
    a = p.parse_args(argv)
    if a.fill_from is not None and not a.fill_from.is_file():
        p.error(f"--fill-from {a.fill_from}: no such calibration file")
    try:
        cal = calibrate(a.results, a.model, a.gpu, a.fit_runs, a.moe_fit_ctx)
    except IndexError:  # fit[0] of no run
        print(f"error: no bench/offline.py run of {a.model} on a GPU named like {a.gpu!r} under {a.results}",
              file=sys.stderr)
        return 2
    if a.fill_from is not None:
        fill_missing(cal, json.loads(a.fill_from.read_text()), str(a.fill_from))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(cal, indent=1) + "\n")
    d, pr = cal["decode"], cal["prefill"]
    print(f"decode: weights {d['weights_GBps']:.0f} GB/s, KV {d['kv_GBps']:.0f} GB/s, GEMM {d['gemm_TFLOPs']:.0f} "
          f"TFLOP/s, {d['row_us']:.2f} us/row, {d['step_us']:.0f} us/step")
    mp = cal["moe_prefill"]
    if all(v is not None for v in mp.values()):
        print(f"moe prefill: experts hit read at {mp['expert_GBps']:.0f} GB/s + {mp['layer_expert_us']:.2f} us per "
              f"sparse layer per expert hit, expert GEMMs {mp['gemm_TFLOPs']:.0f} TFLOP/s "
              f"({len(cal['sources']['moe_prefill_fit']['rows'])} rows)")
    if pr["gemm_TFLOPs"] is not None:
        print(f"prefill: GEMM {pr['gemm_TFLOPs']:.0f} TFLOP/s, attention {pr['attention_TFLOPs']:.0f} TFLOP/s")
    m = cal["moe"]
    if m["expert_GBps"] is not None:
        print(f"moe: experts {m['expert_GBps']:.0f} GB/s, {m['layer_expert_us']:.3f} us per sparse layer per "
              f"expert ({len(cal['sources']['moe_fit']['rows'])} rows)")
    print(f"host link: {cal['host_link']}")
    print(f"exchange: {cal['remote_exchange']}")
    print(f"executor host: uncapped {cal['executor_host']['uncapped_increase_per_guest_gib']}/GiB, "
          f"capped {cal['executor_host']['capped_increase']}")
    print(f"wrote {a.out} ({len(cal['runs'])} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
