"""The simulator's predictions for issue 35, all SIMULATED (docs/simulator.md has them with their band).

    python -m bench.sim.predict weaver   --out bench/results/2026-12-03-sim-predictions
    python -m bench.sim.predict pd       --out bench/results/2026-12-03-sim-predictions
    python -m bench.sim.predict rotation --out bench/results/2026-12-03-sim-predictions
    python -m bench.sim.predict fleet    --out bench/results/2026-12-03-sim-predictions
    python -m bench.sim.predict mixtral  --out bench/results/2026-12-03-sim-predictions
    python -m bench.sim.predict mixtral-kvbind --out bench/results/2026-12-03-sim-predictions

- weaver: WEAVER fair. A hot and a cold Llama-3-8B, each on a whole H200 (0.9); the hot model's
  goodput (highest rate on the grid with >= 90 % of requests within both SLOs) without and with
  offload (half its decoding requests' attention and KV on the cold GPU, which lends 40 GiB), for
  ctx ~1K (Azure conv), ~4K (Mooncake clipped at 4K) and 8K+ (Mooncake clipped at 16K); and the
  cold model's TPOT while it hosts.
- pd: Adrenaline fair. Plain PD (prefill and decode instances, a whole H200 each) against PD with
  Adrenaline's placement (half the decoding requests attended on the prefill GPU), executor uncapped
  and capped at 24 SMs.
- rotation: lvf-rotate on a quarter H200 (158,656-token pool, Mooncake), with the H200's measured
  host link and with a GH200-like C2C link (450 GB/s per direction: an ASSUMPTION, only the link
  changed), beside fcfs-recompute.
- fleet: ServeGen's per-model mix (bench/sim/examples/models.yaml) at a total rate: the fewest GPUs
  keeping 90 % of requests within both SLOs, dedicated vs WEAVER pairing vs rotation vs both.
- mixtral: issue 33's lvf/fcfs goodput sweep for Mixtral-8x7B on one H200 at 0.9 (the pool its server
  logged there: 19,550 pages x 16 tokens; 32 GiB host pool) under bench/goodput_knee.py's strict method
  (bench/sim/knee.py: the same plan, rows, union rule and bisection), fcfs-recompute, lvf-rotate and
  fcfs-rotate, on Mooncake and Azure conversation, Poisson and bursts; per run the strict goodput, the
  lvf/fcfs ratio, per-rate attainment, and whether KV or compute binds at the knee.
- mixtral-kvbind: the same server and method, fcfs-recompute and lvf-rotate only, on six workloads
  chosen for KV to bind before compute (issue 33's "KV rotation where KV truly binds"): Mooncake with
  its own output lengths (max-out 1,024 / 2,048 instead of 256), TPOT 0.1 s and a relaxed 0.2 s,
  Poisson and bursts, and Azure conversation with its own outputs at TPOT 0.2 s.
Each writes <what>.json and <what>.png into --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.sim.fleet import (
    ERROR_BAND,
    FULL,
    STRATEGIES,
    FleetPlan,
    ModelSpec,
    Pairing,
    Slot,
    error_band,
    fewest_gpus,
    load_gpu,
    make_requests,
    run_fleet,
    servegen_rates,
)
from bench.sim.instance import with_link
from bench.sim.plan import read_models

EXAMPLE = Path(__file__).resolve().parent / "examples" / "models.yaml"
CTX: dict[str, tuple[str, int, list[float]]] = {"~1K (azure-conv)": ("azure-conv", 4096, [12, 18, 24, 30, 36, 42]),
       "~4K (mooncake <= 4K)": ("mooncake", 4096, [4, 6, 8, 10, 12, 14]),
       "8K+ (mooncake <= 16K)": ("mooncake", 16384, [1.5, 2, 2.5, 3, 4, 5])}


def _save(out: Path, name: str, data: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    data = {"label": "SIMULATED", "error_band": ERROR_BAND, **data}
    (out / f"{name}.json").write_text(json.dumps(data, indent=1, default=str))


def weaver(a: argparse.Namespace) -> dict[str, Any]:
    cal, mem = load_gpu("h200")
    res: dict[str, Any] = {"setup": "hot and cold llama-3-8b, each a whole H200 (0.9); cold at 1 req/s azure-conv; "
                                    f"offload ratio 0.5, {a.lend_gib:g} GiB lent; TTFT 2 s, mean TPOT 100 ms",
                           "points": []}
    for label, (trace, max_in, rates) in CTX.items():
        for ratio in (0.0, 0.5):
            misses = 0
            for rate in rates:
                hot = ModelSpec("hot", "llama-3-8b", rate, trace=trace, max_in=max_in, max_out=512)
                cold = ModelSpec("cold", "llama-3-8b", 1.0, trace="azure-conv", max_in=4096, max_out=512)
                plan = FleetPlan(2, [Slot("hot", 0, 0.9), Slot("cold", 1, 0.9)],
                                 [Pairing(0, 1, ratio, a.lend_gib)] if ratio else [])
                t0 = time.time()
                r = run_fleet(plan, [hot, cold], cal, mem, a.seconds, a.seed, extra_tpot_s=(0.02, 0.03, 0.05))
                h, c = r.per_model["hot"], r.per_model["cold"]
                res["points"].append({"ctx": label, "offload_ratio": ratio, "rate": rate, "hot": h, "cold": c})
                print(f"{label:22s} ratio {ratio:.1f} rate {rate:5.1f}: hot both {100 * h['attainment']:5.1f} % "
                      f"(TPOT {h['tpot_mean_ms']:.0f} ms, TTFT p99 {h['ttft_p99_s']:.2f} s), cold TPOT "
                      f"{c['tpot_mean_ms']:.1f} ms  [{time.time() - t0:.0f} s]", flush=True)
                misses = misses + 1 if max(h["attainment"], *h["both_at_tpot"].values()) < 0.9 else 0
                if misses >= 2:
                    break
    good: dict[str, dict[str, Any]] = {}
    for p in res["points"]:
        g = good.setdefault(p["ctx"], {"0.0": 0.0, "0.5": 0.0, "cold_tpot_ms": {}, "at_tpot": {}})
        key = f"{p['offload_ratio']:.1f}"
        if p["hot"]["attainment"] >= 0.9:
            g[key] = max(g[key], p["rate"])
        for slo, att in p["hot"]["both_at_tpot"].items():
            row = g["at_tpot"].setdefault(slo, {"0.0": 0.0, "0.5": 0.0})
            if att >= 0.9:
                row[key] = max(row[key], p["rate"])
        g["cold_tpot_ms"].setdefault(key, []).append((p["rate"], p["cold"]["tpot_mean_ms"]))
    res["goodput"] = good
    return res


def rotation(a: argparse.Namespace) -> dict[str, Any]:
    cal, mem = load_gpu("h200")
    c2c = with_link(cal, a.c2c_GBps)
    rates = [3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    res: dict[str, Any] = {"setup": "llama-3-8b, quarter H200 (0.25 of memory: the GPU runs' 158,656-token pool), "
                                    "mooncake <= 7680 in / 256 out, TTFT 2 s, mean TPOT 100 ms, host pool 32 GB",
                           "c2c_assumption": f"{a.c2c_GBps:g} GB/s per direction, {2 * a.c2c_GBps:g} duplex "
                                             "(GH200 NVLink-C2C class; NOT measured here)",
                           "points": []}
    for run, c, rot in (("fcfs-recompute", cal, False), ("lvf-rotate (H200 PCIe, measured)", cal, True),
                        (f"lvf-rotate (C2C {a.c2c_GBps:g} GB/s, assumed)", c2c, True)):
        for rate in rates:
            m = ModelSpec("m", "llama-3-8b", rate, trace="mooncake", max_in=7680, max_out=256)
            plan = FleetPlan(1, [Slot("m", 0, 0.25)], rotation=rot, host_gb_per_gpu=32.0 * FULL / 0.25)
            r = run_fleet(plan, [m], c, mem, a.seconds, a.seed).per_model["m"]
            res["points"].append({"run": run, "rate": rate, **r})
            print(f"{run:36s} {rate:4.1f} req/s: both {100 * r['attainment']:5.1f} %  rot {r['rotations_out']}  "
                  f"preempt {r['preemptions']}", flush=True)
    return res


def pd(a: argparse.Namespace) -> dict[str, Any]:
    from bench.sim.pd import run_pd

    cal, mem = load_gpu("h200")
    res: dict[str, Any] = {"setup": "llama-3-8b; prefill instance on GPU 0 and decode instance on GPU 1, each 0.9 of "
                                    "its H200; mooncake <= 4K in / 512 out; TTFT 2 s, mean TPOT 100 ms; PD KV "
                                    "transfer at 390 GB/s (assumed); Adrenaline: half the decoding requests on an "
                                    f"executor on the prefill GPU lending {a.lend_gib:g} GiB",
                           "points": []}
    for run, ratio, sms in (("plain PD", 0.0, None), ("Adrenaline, executor uncapped", 0.5, None),
                            ("Adrenaline, executor 24 SMs", 0.5, 24)):
        misses = 0
        for rate in (6.0, 8.0, 10.0, 12.0, 14.0, 16.0, 18.0):
            m = ModelSpec("m", "llama-3-8b", rate, trace="mooncake", max_in=4096, max_out=512)
            r = run_pd(m, cal, mem, a.seconds, a.seed, ratio, a.lend_gib, sms)
            res["points"].append({"run": run, "rate": rate, **r})
            print(f"{run:30s} {rate:4.1f} req/s: both {100 * r['attainment']:5.1f} %  "
                  f"TTFT p99 {r['ttft_p99_s']:.2f} s  TPOT mean {r['tpot_mean_ms']:.1f} ms", flush=True)
            misses = misses + 1 if r["attainment"] < 0.9 else 0
            if misses >= 2:
                break
    return res


def fleet(a: argparse.Namespace) -> dict[str, Any]:
    cal, mem = load_gpu("h200")
    models = read_models(EXAMPLE, "servegen", a.total_rate)
    rule = "of every model's requests" if a.per_model else "of the fleet's requests"
    res: dict[str, Any] = {"setup": f"bench/sim/examples/models.yaml at {a.total_rate:g} req/s "
                                    f"(ServeGen day-1 shares), {a.seconds:g} s of traffic, target 90 % both SLOs "
                                    f"{rule}",
                           "rates": servegen_rates([m for m in ("m-mid", "m-small", "m-large", "deepseek-r1",
                                                                  "mm-image")], a.total_rate),
                           "strategies": {}}
    for strat in STRATEGIES:
        res["strategies"][strat] = fewest_gpus(models, cal, mem, strat, a.seconds, 0.9,
                                               (0.25, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0), a.seed, log=print,
                                               per_model=a.per_model)
    _ = make_requests  # the same requests for every strategy (fewest_gpus draws them from the seed)
    return res


MIXTRAL_POOL_PAGES = 19550  # "kv pool ... (19550 pages x 16 tokens" in c3-mixtral-knee/gp_server_lvf-rotate.log
MIXTRAL_RUNS = ("fcfs-recompute", "lvf-rotate", "fcfs-rotate")


def mixtral_settings() -> list[Any]:
    """The four workloads of issue 33's Mixtral row. Mooncake as the measured knee (c3-mixtral-knee: inputs
    cut to 7,680, outputs 256, TTFT 5 s); Azure conversation as docs/benchmarks.md's open Azure runs
    (inputs cut to 2,048, outputs 256, TTFT 2 s). Grids bracket the knees the simulator finds."""
    from bench.sim.knee import Setting

    return [Setting("mooncake-poisson", "mooncake", "poisson", (1.5, 2.0, 3.0, 4.0), 7680, ttft=5.0),
            Setting("mooncake-burst", "mooncake", "burst", (1.0, 1.5, 2.0, 3.0), 7680, ttft=5.0),
            Setting("azure-conv-poisson", "azure-conv", "poisson", (8.0, 16.0, 24.0, 32.0), 2048, ttft=2.0),
            Setting("azure-conv-burst", "azure-conv", "burst", (4.0, 8.0, 12.0, 16.0), 2048, ttft=2.0)]


KVBIND_RUNS = ("fcfs-recompute", "lvf-rotate")


def kvbind_settings() -> list[Any]:
    """Workloads where KV may bind before compute for Mixtral at 0.9: requests that hold their KV longer.
    Mooncake (inputs cut to 7,680 as the measured knee, TTFT 5 s) with its own outputs (mean 343, 65 %
    over 256, 1 % over 1,024: max-out 1,024 keeps nearly all, 2,048 a reasoning-like cap), at the strict
    TPOT 0.1 s and a relaxed 0.2 s (some platforms' MoE SLO); Azure conversation (inputs cut to 2,048,
    TTFT 2 s) with its own outputs (p99 601). Azure code is left out: its outputs (median 13 tokens) hold
    KV too briefly to bind; ServeGen has per-window statistics only, no requests to replay."""
    from bench.sim.knee import Setting

    return [Setting("mc-out1024-poisson", "mooncake", "poisson", (1.5, 2.0, 2.5, 3.0), 7680, 1024, 5.0, 0.1),
            Setting("mc-out1024-burst", "mooncake", "burst", (1.0, 1.5, 2.0, 2.5), 7680, 1024, 5.0, 0.1),
            Setting("mc-out1024-tpot0.2-poisson", "mooncake", "poisson", (2.0, 2.5, 3.0, 3.5), 7680, 1024, 5.0, 0.2),
            Setting("mc-out1024-tpot0.2-burst", "mooncake", "burst", (1.5, 2.0, 2.5, 3.0), 7680, 1024, 5.0, 0.2),
            Setting("mc-out2048-tpot0.2-poisson", "mooncake", "poisson", (2.0, 2.5, 3.0, 3.5), 7680, 2048, 5.0,
                    0.2),
            Setting("conv-out1024-tpot0.2-poisson", "azure-conv", "poisson", (12.0, 16.0, 20.0, 24.0), 2048, 1024,
                    2.0, 0.2)]


def _reusable(path: Path | None, st: Any, plan: Any, setup: str) -> dict[tuple[str, float], dict[str, Any]]:
    """Points of an earlier output JSON (--reuse) for this setting, kept only where its server (model,
    card, share, pool, calibration: the `setup` line), setting and plan are exactly this run's (the replay
    is deterministic: a reused point is the point)."""
    if path is None:
        return {}
    doc = json.loads(path.read_text())
    old = doc.get("settings", {}).get(st.name)
    if old is None or doc.get("setup") != setup or old["setting"] != st.__dict__ | {"grid": list(st.grid)} or \
            old["plan"]["grid"] != list(plan.rates) or \
            [old["plan"][k] for k in ("repeats", "seconds", "min_req", "target", "tolerance", "extend")] != \
            [plan.repeats, plan.seconds, plan.min_req, plan.target, plan.tolerance, plan.extend]:
        return {}
    return {(p["run"], p["rate"]): p for p in old["points"]}


def mixtral(a: argparse.Namespace) -> dict[str, Any]:
    from bench import goodput_knee as K
    from bench.sim import knee as N
    from bench.sim.cost import CostModel
    from bench.sim.instance import gpu_calibration
    from bench.sim.open_runs import pool_at

    # The pool a server of this model, card and share logged (Mixtral at 0.9 of an H200: MIXTRAL_POOL_PAGES),
    # else the engine's memory math on that card.
    pool, where = pool_at(a.share, a.model, a.gpu)
    cal = gpu_calibration(a.gpu)[0]
    if pool <= 0:
        raise SystemExit(f"{a.model} at {a.share:g} of one {a.gpu} leaves no KV pool ({where})")
    if a.pool_scale != 1.0:  # the ceiling any KV policy could reach: the pool scaled, everything else equal
        pool, where = int(pool * a.pool_scale), f"{where}, scaled x{a.pool_scale:g}: a COUNTERFACTUAL pool"
    server = N.Server(pool, a.host_gb, CostModel.load(cal, a.model))
    kvbind = a.what == "mixtral-kvbind"
    workloads = kvbind_settings() if kvbind else mixtral_settings()
    settings = [st for st in workloads if not a.settings or st.name in a.settings]
    runs = tuple(a.runs or (KVBIND_RUNS if kvbind else MIXTRAL_RUNS))
    setup = (f"{a.model} (preset geometry), one {a.gpu.upper()} at {a.share:g}: pool {pool:,} usable tokens "
             f"({where}), {a.host_gb:g} GiB host pool; mean TPOT as each setting's tpot; strict method of "
             f"bench/goodput_knee.py (bench/sim/knee.py); calibration {Path(cal).name}")
    res: dict[str, Any] = {"setup": setup, "runs": list(runs), "settings": {}}
    print(setup, flush=True)
    for st in settings:
        if a.grid:
            st = dataclasses.replace(st, grid=tuple(a.grid))
        plan = K.Plan(st.grid, a.repeats, a.seconds, a.min_req, 0.9, K.TOLERANCE, a.extend)
        t0 = time.time()
        r = N.search(st, runs, plan, server, reuse=_reusable(a.reuse, st, plan, setup))
        if a.pool_check:  # each run's first failing rate again with twice the pool: does KV bind there?
            for run in runs:
                hi = r["goodput"][run]["first_failing"]
                if hi is not None:
                    r["binding"][run]["pool_x2"] = c = N.pool_check(st, plan, run, hi, server, 2.0)
                    print(f"   {run:<15} at {hi:g} req/s with a 2x pool: both {100 * c['both']:.1f} % "
                          f"(TTFT {100 * c['ttft']:.0f}, TPOT {100 * c['tbt']:.0f}, KV peak "
                          f"{100 * c['kv_held_peak']:.0f} %): {c['verdict']}", flush=True)
        res["settings"][st.name] = r
        print(f"== {st.name}: strict goodput " + ", ".join(f"{run} {g['text']}" for run, g in r["goodput"].items())
              + f"; lvf/fcfs {r['ratio']}  [{time.time() - t0:.0f} s]", flush=True)
        for run, b in r["binding"].items():
            if b["at"] is not None:
                print(f"   {run:<15} at {b['at']:g} req/s: {b['verdict']} (GPU busy {100 * b['gpu_busy']:.0f} %, "
                      f"prefill {100 * b['prefill_share']:.0f} % of it, KV peak {100 * b['kv_held_peak']:.0f} % / mean "
                      f"{100 * b['kv_held_mean']:.0f} % of the pool, rotations {b['rotations_out']:.0f}, preemptions "
                      f"{b['preemptions']:.0f}, TTFT met {100 * b['ttft_attainment']:.0f} %, TPOT met "
                      f"{100 * b['tpot_attainment']:.0f} %)", flush=True)
    res["error_band"] = error_band(server.cost.cal)  # a derived card's file says what it rests on
    print(res["error_band"])
    return res


def plot(name: str, data: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if name == "weaver":
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        ctxs = list(data["goodput"])
        xs = range(len(ctxs))
        slos = ["100ms"] + [s for s in ("50ms", "30ms")
                            if all(s in data["goodput"][c].get("at_tpot", {}) for c in ctxs)]

        def good(c: str, slo: str, key: str) -> float:
            g = data["goodput"][c]
            return float(g[key] if slo == "100ms" else g["at_tpot"][slo][key])

        w = 0.8 / (2 * len(slos))
        for j, slo in enumerate(slos):
            for k, (key, who) in enumerate((("0.0", "alone"), ("0.5", "+ WEAVER 0.5"))):
                off = (2 * j + k) * w - 0.4 + w / 2
                ax1.bar([x + off for x in xs], [good(c, slo, key) for c in ctxs], w, label=f"TPOT {slo}, {who}",
                        hatch="//" if k else None)
        ax1.set_xticks(list(xs), ctxs, fontsize=8)
        ax1.set_ylabel("hot goodput, req/s (>= 90 % both SLOs, TTFT 2 s)")
        ax1.set_title("SIMULATED: WEAVER fair, 2 x H200")
        ax1.legend(fontsize=6)
        for c in ctxs:
            pts = data["goodput"][c]["cold_tpot_ms"]
            for key, style in (("0.0", "--"), ("0.5", "-")):
                if key in pts:
                    ax2.plot([r for r, _ in pts[key]], [t for _, t in pts[key]], style, marker="o",
                             label=f"{c}, {'alone' if key == '0.0' else 'hosting'}")
        ax2.set_xlabel("hot model's rate, req/s")
        ax2.set_ylabel("cold model's mean TPOT, ms")
        ax2.set_title("SIMULATED: cold model while hosting")
        ax2.legend(fontsize=7)
    elif name in ("pd", "rotation"):  # attainment against rate, one line per run
        fig, ax = plt.subplots(figsize=(6, 4))
        series: dict[str, list[tuple[float, float]]] = {}
        for p in data["points"]:
            series.setdefault(p["run"], []).append((p["rate"], 100 * p["attainment"]))
        for run, pts in series.items():
            ax.plot([r for r, _ in pts], [v for _, v in pts], marker="o", label=run)
        ax.axhline(90, color="grey", lw=0.5)
        ax.set_xlabel("req/s")
        ax.set_ylabel("both SLOs, %")
        ax.set_title("SIMULATED: PD vs Adrenaline, 2 x H200, Mooncake <= 4K" if name == "pd"
                     else "SIMULATED: rotation, quarter H200, Mooncake")
        ax.legend(fontsize=7)
    elif name in ("mixtral", "mixtral-kvbind"):  # a panel per workload: mean attainment (repeat range as bars)
        names = list(data["settings"])
        cols = min(2, len(names))
        rows = -(-len(names) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4 * rows), squeeze=False)
        for ax, st in zip(axes.flat, names, strict=False):
            r = data["settings"][st]
            for run in data["runs"]:
                pts = [p for p in r["points"] if p["run"] == run]
                if not pts:
                    continue
                rs = [p["rate"] for p in pts]
                ys = [100 * p["both"] for p in pts]
                err = [[100 * (p["both"] - p["both_range"][0]) for p in pts],
                       [100 * (p["both_range"][1] - p["both"]) for p in pts]]
                ax.errorbar(rs, ys, yerr=err, marker="o", capsize=2, label=f"{run} ({r['goodput'][run]['text']})")
            ax.axhline(90, color="grey", lw=0.5)
            ax.set_xlabel("req/s")
            ax.set_ylabel("both SLOs, % (mean of 3 repeats)")
            ax.set_title(f"SIMULATED: Mixtral 0.9 H200, {st}", fontsize=8)
            ax.legend(fontsize=6)
    else:
        fig, ax = plt.subplots(figsize=(6, 4))
        strats = list(data["strategies"])
        gpus = [data["strategies"][s]["gpus"] or 0 for s in strats]
        ax.bar(strats, gpus)
        for i, s in enumerate(strats):
            st = data["strategies"][s]
            att = 100 * st["result"]["attainment"] if st["result"] else 0
            ax.text(i, gpus[i], f"{att:.1f} %" if st["passed"] else "not met", ha="center", va="bottom")
        ax.set_ylabel("fewest GPUs for 90 % within both SLOs")
        ax.set_title(f"SIMULATED: ServeGen mix, {data['setup'].split(' at ')[1].split(' (')[0]}")
    band = ("SIMULATED (Mixtral knee replay: +1.1 / +6.9 points at 2 / 3 req/s; serving MAE 4.2 points, "
            "optimistic by +3.7 over 127 points; see docs/simulator.md)" if name.startswith("mixtral") else
            "SIMULATED (cost model: decode step error <= 5 % held out; see docs/simulator.md)")
    fig.text(0.01, 0.01, band, fontsize=6)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sim.predict", description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["weaver", "pd", "rotation", "fleet", "mixtral", "mixtral-kvbind", "plot"])
    p.add_argument("--out", type=Path, default=Path("bench/results/2026-12-03-sim-predictions"))
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lend-gib", type=float, default=40.0)
    p.add_argument("--c2c-GBps", type=float, default=450.0)
    p.add_argument("--total-rate", type=float, default=96.0)
    p.add_argument("--per-model", action=argparse.BooleanOptionalAction, default=True,
                   help="fleet: every model must keep 90 %% within both SLOs (--no-per-model: 90 %% of all requests)")
    m = p.add_argument_group("mixtral, mixtral-kvbind (strict knee search; --seconds is the plan's seconds per point)")
    m.add_argument("--settings", nargs="+", choices=[st.name for st in mixtral_settings() + kvbind_settings()],
                   help="workloads to run (default: all of the command's: mixtral's four, mixtral-kvbind's six)")
    m.add_argument("--runs", nargs="+", help=f"POLICY-MODE[.VARIANT] runs (VARIANT one of bench/sim/knee.py's "
                   f"VARIANTS, e.g. lvf-rotate.missed: --lvf-missed-last; default: mixtral {' '.join(MIXTRAL_RUNS)}, "
                   f"mixtral-kvbind {' '.join(KVBIND_RUNS)})")
    m.add_argument("--grid", nargs="+", type=float, help="one grid for every chosen workload (default: each its own)")
    m.add_argument("--model", default="mixtral-8x7b", help="the MoE preset (e.g. qwen3-30b-a3b; default Mixtral)")
    m.add_argument("--gpu", default="h200", help="the card (a calibration file: h200 fitted, h100 derived)")
    m.add_argument("--share", type=float, default=0.9, help="the memory share (--mem-fraction-static)")
    m.add_argument("--repeats", type=int, default=3)
    m.add_argument("--min-req", type=int, default=150)
    m.add_argument("--extend", type=int, default=1, help="grid steps tried above a grid that all passed")
    m.add_argument("--pool-check", action=argparse.BooleanOptionalAction, default=None,
                   help="replay each run's first failing rate with twice the pool: passing there means KV binds "
                        "(default: on for mixtral-kvbind, off for mixtral)")
    m.add_argument("--pool-scale", type=float, default=1.0,
                   help="search with the GPU pool this many times the real one, all else equal (a counterfactual: "
                        "with a pool that never fills, fcfs's knee is the compute ceiling no KV policy can pass)")
    m.add_argument("--host-gb", type=float, default=32.0,
                   help="the host pool rotation writes to (goodput_knee.py's --host-gb, --kv-host-size-gb of rotate "
                        "runs; 32 as on the GPU runs so far)")
    m.add_argument("--reuse", type=Path, help="an earlier output JSON whose points of the same setting and plan "
                   "are taken instead of replayed (deterministic: same results, minutes saved)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    if a.what == "plot":  # redraw every plot from its JSON
        for name in ("weaver", "pd", "rotation", "fleet", "mixtral", "mixtral-kvbind"):
            f = a.out / f"{name}.json"
            if f.is_file():
                plot(name, json.loads(f.read_text()), a.out)
        return 0
    if a.what in ("mixtral", "mixtral-kvbind") and a.settings:
        own = [st.name for st in (kvbind_settings() if a.what == "mixtral-kvbind" else mixtral_settings())]
        unknown = [s for s in a.settings if s not in own]
        if unknown:  # the other command's workload: exit 2 naming the flag and this command's workloads
            p.error(f"--settings: {', '.join(unknown)} is not a workload of {a.what} (its workloads: {', '.join(own)})")
    if a.what in ("mixtral", "mixtral-kvbind"):  # --model/--gpu: a usage error naming the known ones
        from bench.sim.instance import known_gpus
        from sglang_ext.configs import preset_names

        if a.model not in preset_names():
            p.error(f"--model: unknown preset {a.model!r} (known: {', '.join(preset_names())})")
        if a.gpu not in known_gpus():
            p.error(f"--gpu: unknown GPU {a.gpu!r} (known: {', '.join(known_gpus())})")
    if a.pool_check is None:
        a.pool_check = a.what == "mixtral-kvbind"
    if not a.host_gb > 0:
        p.error(f"--host-gb: {a.host_gb:g} is not a positive size")
    if not a.pool_scale > 0:
        p.error(f"--pool-scale: {a.pool_scale:g} is not a positive factor")
    if a.reuse is not None and not a.reuse.is_file():
        p.error(f"--reuse: {a.reuse} is not a file")
    data = {"weaver": weaver, "pd": pd, "rotation": rotation, "fleet": fleet, "mixtral": mixtral,
            "mixtral-kvbind": mixtral}[a.what](a)
    data["args"] = {k: str(v) for k, v in vars(a).items()}
    _save(a.out, a.what, data)
    plot(a.what, json.loads((a.out / f"{a.what}.json").read_text()), a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
