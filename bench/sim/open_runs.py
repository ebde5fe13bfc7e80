"""Issue 32's open one-GPU runs, predicted before they run. SIMULATED.

    python -m bench.sim.open_runs --out bench/results/2026-12-03-sim-open-runs
    python -m bench.sim.open_runs --rows 2 5 --out /tmp/open

docs/benchmarks.md "Open runs (issue 32)" lists the lvf/fcfs and rotate/recompute knees still owed on
one H200 (Llama-3-8B, Mooncake, dummy weights). Device time is scarce (30 min a session, often less),
so each row is first searched here with bench/goodput_knee.py's strict method on the simulator
(bench/sim/knee.py: the same plan, rows, union rule and bisection), at the pool a server logged at the
row's share (bench/results; else the engine's memory math). Per row this prints and saves:

- each run's predicted strict goodput and first failing rate, the lvf/fcfs (or rotate/recompute) ratio
  and what binds at the knee (KV or compute);
- a suggested GPU grid: every run's predicted bracket (goodput, first failing rate) and one guard rate a
  tolerance step under the lowest predicted goodput (the simulator reads attainment ~4 points high near
  the knee: docs/simulator.md, "Error band"), so a call starts on the bracket instead of walking to it;
- the points a call on that grid would measure if the GPU agrees with the prediction (under the union
  rule every run measures each grid rate up to its own first failing one) and an ESTIMATE of its device
  seconds (each point's span, first arrival to last token, taken from the simulated point of the same
  run nearest in rate, plus per-repeat and per-server overheads read off the s5 calls) and of the
  9-minute calls it needs.

These are predictions made before the runs: when a row runs, bench.sim.replay_sweeps scores the
prediction against it. Nothing here is fitted to the results it predicts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

from bench import goodput_knee as K
from bench.sim import knee as N
from bench.sim.cost import CostModel
from bench.sim.fleet import error_band
from bench.sim.instance import gpu_calibration
from bench.sim.replay_sweeps import (
    PANELS,
    RESULTS,
    logged_pool,
    memory_constants,
    page_bytes,
    pages_from_share,
    plain_server_logs,
    weight_bytes,
)

MODEL: Final = "llama-3-8b"
HOST_GB: Final = 32.0
PAGE: Final = 16
# device-time overheads of a knee call beyond the requests' own span, read off the s5 Mixtral call
# (c3-mixtral-knee: server ready in 35.5 s; a repeat's report, metrics scrape and flush ~4 s): estimates
SERVER_START_S: Final = 35.0
REPEAT_OVERHEAD_S: Final = 4.0
CALL_BUDGET_S: Final = 500.0  # KNEE_END_S=560 less warm-up and the tar


@dataclass(frozen=True)
class Row:
    """One open row of docs/benchmarks.md: its workload, share and runs, with a broad search grid."""

    row: str
    setting: N.Setting
    share: float
    runs: tuple[str, ...]
    note: str = ""
    # rates earlier calls measured for every run on this plan's rows and offsets (the panel merges them)
    measured: tuple[float, ...] = ()
    # guard steps under the predicted knee: 2 at TTFT 2 s, where the replay of the measured 1/4-share panel
    # (bench/results/2026-12-03-sim-validation/replay.txt, 12-03/c1+c2) read 5 req/s 13-31 points high
    guard_steps: int = 1


LVF: Final = ("fcfs-recompute", "lvf-rotate")


def rows(gpu: str = "h200") -> list[Row]:
    """Rows 1-8 of "Open runs (issue 32)". Row 7 (fcfs rotate vs recompute at two shares) folds into rows 2
    and 3 as a third run, at 1/4 and 1/2: shares within the brief's bound of at most 4 models a GPU (the
    doc's 1/8 is past it, so a gain there is not a result). Row 6 (bursts at 1/8) is the issue's and stays,
    marked past the bound. Of row 8 (in-process remote attention: adaptive vs off vs fixed) only "off" on
    Azure conversation is here: the simulator prices a remote executor on another GPU, not one sharing
    the sender's. Row 8h is row 8 at 1/2 of the GPU, where an H100 runs it (a quarter of an H100 cannot hold
    the executor's 7 GiB beside the weights). On another card (`gpu`) every row is a new panel: no rate is
    measured yet, no H200 note."""
    S = N.Setting
    out = [
        Row("1", S("share025-ttft2-poisson", "mooncake", "poisson", (4.0, 5.0), 7680, ttft=2.0), 0.25, LVF,
            "continues 2026-12-03-h200/c1 (5 req/s) + c2 (4 req/s)", (4.0, 5.0), 2),
        Row("2+7", S("share025-ttft5-poisson", "mooncake", "poisson", (4.0, 5.0, 6.0), 7680), 0.25,
            (*LVF, "fcfs-rotate")),
        Row("3+7", S("share05-ttft5-poisson", "mooncake", "poisson", (5.0, 6.0, 7.0), 7680), 0.5,
            (*LVF, "fcfs-rotate")),
        Row("4", S("share05-ttft2-poisson", "mooncake", "poisson", (4.0, 5.0, 6.0), 7680, ttft=2.0), 0.5, LVF,
            guard_steps=2),
        Row("5", S("share025-ttft5-burst", "mooncake", "burst", (3.0, 4.0, 5.0), 7680), 0.25, LVF),
        Row("6", S("share0125-ttft5-burst", "mooncake", "burst", (1.5, 2.0, 2.5), 7680), 0.125, LVF,
            "past the bound of 4 models a GPU: not a result"),
        Row("8", S("share025-azure-conv-ttft2-poisson", "azure-conv", "poisson", (24.0, 36.0, 48.0), 2048, ttft=2.0),
            0.25, ("fcfs-recompute",), "the 'off' run only: fixed and adaptive share the GPU with an in-process "
            "executor, which the simulator does not price; Mooncake's 'off' run is row 1's fcfs-recompute"),
        Row("8h", S("share05-azure-conv-ttft2-poisson", "azure-conv", "poisson", (24.0, 36.0, 48.0), 2048,
                    ttft=2.0), 0.5, ("fcfs-recompute",), "row 8 at 1/2 of the GPU, where an H100 runs it: a "
            "quarter of an H100 holds ~4 GiB of KV beside Llama-3-8B's weights, less than the executor's 7 GiB"),
    ]
    if gpu == "h200":
        return out
    return [dataclasses.replace(r, measured=(), note="" if r.measured else r.note) for r in out]


def _logged(gpu: str, model: str | None, share: float | None = None) -> list[tuple[float, int, str, str]]:
    """(share, pages, where, model) of every server log of this card (of `model` and at `share` where given),
    latest first."""
    out = []
    for panel in reversed(PANELS):
        for sw in panel.sweeps:
            if sw.gpu != gpu or model not in (None, sw.model) or (share is not None and sw.share != share):
                continue  # another card's pool at the same share differs
            for log in plain_server_logs(RESULTS / sw.folder):
                got = logged_pool(log)
                if got is not None and got[1] == PAGE:
                    out.append((sw.share, got[0], f"{sw.folder}/{log.name} ({got[0]} pages)", sw.model))
    return out


def memory_for(gpu: str, model: str = MODEL) -> tuple[float, float]:
    """(GPU bytes torch sees, process bytes besides weights and pool) for the engine's memory math: fitted
    to the H200's logged pools; on another card the H200's process term and the card's total solved from its
    latest logged pool, of any model (one server log is enough; without any the card cannot be priced).
    `model` is the model to be priced: a log of it on this card is preferred."""
    total, other = memory_constants()
    if gpu == "h200":
        return total, other
    logs = _logged(gpu, model) or _logged(gpu, None)  # the card's memory is the card's, whatever ran
    if not logs:
        raise ValueError(f"no server log on {gpu} under bench/results: its memory cannot be solved")
    share, pages, _, ran = logs[0]
    return (pages * page_bytes(ran, PAGE) + weight_bytes(ran) + other) / share, other


def pool_at(share: float, model: str = MODEL, gpu: str = "h200") -> tuple[int, str]:
    """Usable pool tokens at `share` ((pages - 1) x page: page 0 is reserved) and where the figure comes
    from: the latest server log of a sweep at that share, model and card, else the engine's memory math."""
    logs = _logged(gpu, model, share)
    if logs:
        _, pages, where, _ = logs[0]
        return (pages - 1) * PAGE, where
    pages = pages_from_share(share, model, PAGE, *memory_for(gpu, model))
    return (pages - 1) * PAGE, f"memory math ({pages} pages{'' if gpu == 'h200' else ', ' + gpu})"


def suggested_grid(good: dict[str, dict[str, Any]], tolerance: float, steps: int = 1,
                   measured: tuple[float, ...] = ()) -> tuple[float, ...]:
    """Every run's predicted bracket and a guard rate `steps` tolerance steps under the lowest predicted
    goodput, less the rates earlier calls measured already (the panel merges them; a measured rate at or
    under the lowest goodput anchors the bracket from below, so no guard is added then)."""
    rates = {r for g in good.values() for r in (g["goodput"], g["first_failing"]) if r is not None}
    lows = [g["goodput"] for g in good.values() if g["goodput"] is not None]
    if lows and not any(m <= min(lows) for m in measured):
        q = 0.25 if min(lows) >= 2 else 0.125  # rounded down to a quarter (an eighth under 2 req/s)
        guard = math.floor(min(lows) / (1 + tolerance) ** steps / q) * q
        if guard > 0:
            rates.add(guard)
    return tuple(sorted(rates - set(measured)))


def visits(good: dict[str, dict[str, Any]], grid: tuple[float, ...]) -> dict[str, list[float]]:
    """Per run, the grid rates a call would measure if the GPU agrees with the prediction: every rate up to
    the run's first failing one (all of them when none failed; the plan's extension is left out)."""
    return {run: [r for r in grid if g["first_failing"] is None or r <= g["first_failing"]] for run, g in good.items()}


def device_estimate(result: dict[str, Any], grid: tuple[float, ...], repeats: int) -> dict[str, Any]:
    """Seconds a GPU call on `grid` would spend: per visited point, `repeats` times the simulated span of
    the same run's point nearest in rate plus a per-repeat overhead, and one server start per run. An
    ESTIMATE, for planning calls only."""
    todo = visits(result["goodput"], grid)
    points: list[tuple[float, str, float]] = []  # (rate, run, seconds)
    for run, rates in todo.items():
        mine = [p for p in result["points"] if p["run"] == run]
        for rate in rates:
            near = min(mine, key=lambda p: abs(p["rate"] - rate))
            points.append((rate, run, repeats * (near["mean"]["end_s"] + REPEAT_OVERHEAD_S)))
    return {"points": len(points), "visits": todo,
            "seconds": round(SERVER_START_S * len(todo) + sum(sec for _, _, sec in points)),
            "calls": calls_needed(points),
            "basis": f"simulated spans of the nearest simulated point + {REPEAT_OVERHEAD_S:g} s a repeat + "
                     f"{SERVER_START_S:g} s a server start (one per run and call); {CALL_BUDGET_S:g} s a "
                     "9-minute call, points packed in rate order, a point never split across calls"}


def calls_needed(points: list[tuple[float, str, float]]) -> int:
    """9-minute calls for these (rate, run, seconds) points, packed in rate order as the search's passes
    visit them: a point that does not fit what is left of a call opens the next (points are never split,
    so a long point, ~6 minutes at 1.4 req/s, takes a call of its own), each run's server started once a
    call."""
    calls, left, started = 0, 0.0, set[str]()
    for _, run, sec in sorted(points):
        need = sec + (0.0 if run in started else SERVER_START_S)
        if calls == 0 or need > left:
            calls, left, started = calls + 1, CALL_BUDGET_S, set()
            need = sec + SERVER_START_S
        left -= need
        started.add(run)
    return calls


def _variant_flags(name: str) -> str:
    """A simulator variant's ServerArgs switches as the launcher's flags (lvf_missed_last -> --lvf-missed-last)."""
    return " ".join("--" + k.replace("_", "-") for k, on in N.VARIANTS[name].items() if on)


def gpu_command(row: Row, grid: tuple[float, ...]) -> str:
    st = row.setting
    # a variant run (lvf-rotate.missed) needs its launcher flags named on the GPU too (goodput_knee --variant)
    variants = sorted({run.split(".", 1)[1] for run in row.runs if "." in run})
    var = [f'VARIANTS="{";".join(f"{v}={_variant_flags(v)}" for v in variants)}"'] if variants else []
    env = [f'RUNS="{" ".join(row.runs)}"', *var, f"SHARE={row.share:g}", f"TRACE={st.trace}", f"ARRIVAL={st.arrival}",
           f"MAX_IN={st.max_in}", f"MAX_OUT={st.max_out}", f"TTFT={st.ttft:g}", f"TPOT={st.tpot:g}",
           f'GRID="{" ".join(f"{r:g}" for r in grid)}"', "REPEATS=3", "MIN_REQ=150", "SECONDS_PER_POINT=20",
           "KNEE_END_S=560"]
    return " ".join(env) + " bash bench/gpu_session.sh warm knee"


def predict_row(row: Row, cost: CostModel, a: argparse.Namespace) -> dict[str, Any]:
    pool, source = pool_at(row.share, MODEL, a.gpu)
    if pool < PAGE:  # the weights alone take the share (1/8 of an 80 GB card for an 8B model)
        why = f"no KV pool at share {row.share:g} on {a.gpu} ({source}): the model does not fit"
        print(f"== row {row.row} {row.setting.name}: skipped, {why}", flush=True)
        return {"row": row.row, "share": row.share, "skipped": why}
    server = N.Server(pool, HOST_GB, cost)
    st = row.setting
    plan = K.Plan(st.grid, a.repeats, a.seconds, a.min_req, 0.9, a.tolerance, a.extend)
    t0 = time.time()
    broad = N.search(st, row.runs, plan, server)
    for _ in range(3):  # a run below the lowest rate: search again with half that rate added (the top rate,
        # so the offsets, stay the same: every point already replayed is reused as is)
        if all(g["goodput"] is not None for g in broad["goodput"].values()):
            break
        reuse = {(p["run"], p["rate"]): p for p in broad["points"]}
        st = dataclasses.replace(st, grid=(min(st.grid) / 2, *st.grid))
        plan = dataclasses.replace(plan, grid=st.grid)
        broad = N.search(st, row.runs, plan, server, reuse=reuse)
    grid = suggested_grid(broad["goodput"], K.TOLERANCE, row.guard_steps, row.measured)
    est = device_estimate(broad, grid, plan.repeats) if grid else None
    out = {"row": row.row, "note": row.note, "share": row.share, "pool_tokens": pool, "pool_source": source,
           "runs": list(row.runs),
           "search": broad, "suggested_grid": list(grid), "device_estimate": est,
           "gpu_command": gpu_command(row, grid) if grid else None}
    say = ", ".join(f"{run} {g['text']}" for run, g in broad["goodput"].items())
    note = f" [{row.note}]" if row.note else ""
    print(f"== row {row.row} {st.name}{note} (share {row.share:g}, pool {pool:,} tokens from {source}): strict goodput "
          f"{say}; lvf/fcfs {broad['ratio']}, rotate/recompute "
          f"{N.ratio(broad['goodput'], 'fcfs-rotate', 'fcfs-recompute')}  [{time.time() - t0:.0f} s]", flush=True)
    for run, b in broad["binding"].items():
        if b["at"] is not None:
            print(f"   {run:<15} at {b['at']:g} req/s: {b['verdict']} (GPU busy {100 * b['gpu_busy']:.0f} %, KV peak "
                  f"{100 * b['kv_held_peak']:.0f} %, rotations {b['rotations_out']:.0f}, preemptions "
                  f"{b['preemptions']:.0f})", flush=True)
    if est is not None:
        print(f"   suggested GRID {' '.join(f'{r:g}' for r in grid)}: {est['points']} points if the GPU agrees, "
              f"~{est['seconds']} s of device time (ESTIMATE), {est['calls']} call(s)\n   {out['gpu_command']}",
              flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sim.open_runs", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", nargs="+", choices=[r.row for r in rows()], help="rows to predict (default: all)")
    p.add_argument("--runs", nargs="+", help="these runs in every chosen row instead of the row's own (POLICY-MODE"
                   "[.VARIANT], a variant of bench/sim/knee.py's VARIANTS, e.g. lvf-rotate lvf-rotate.missed)")
    p.add_argument("--gpu", default="h200", help="the card the rows would run on (a calibration file, e.g. h100: "
                   "derived; its pools from its server logs and the memory math)")
    p.add_argument("--out", type=Path, default=Path("bench/results/2026-12-03-sim-open-runs"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seconds", type=float, default=20.0, help="the plan's seconds per point (SECONDS_PER_POINT)")
    p.add_argument("--min-req", type=int, default=150)
    p.add_argument("--extend", type=int, default=1, help="grid steps tried above a grid that all passed")
    p.add_argument("--tolerance", type=float, default=K.TOLERANCE,
                   help="bisect until the first failing rate is within this fraction of the last passing one")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    try:
        path = gpu_calibration(a.gpu)[0]
        cost = CostModel.load(path, MODEL)
        memory_for(a.gpu)  # a card without any logged pool is refused here, before the searches
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    band = error_band(cost.cal)
    print(f"SIMULATED on {cost.cal.gpu} ({path.name})", flush=True)
    chosen = [r for r in rows(a.gpu) if not a.rows or r.row in a.rows]
    for run in a.runs or ():  # a usage error (exit 2) naming the run, before any search
        try:
            K.parse_run(run)
            N.variant_args(run)
        except ValueError as e:
            p.error(str(e))
        except SystemExit as e:
            p.error(f"--runs: {e}")
    if a.runs:  # rates earlier calls measured were the row's own runs': none of them for these
        chosen = [dataclasses.replace(r, runs=tuple(a.runs), measured=(), note="") for r in chosen]
    res = {"label": "SIMULATED", "error_band": band, "gpu": a.gpu, "calibration": path.name, "model": MODEL,
           "host_gb": HOST_GB,
           "rows": {r.row: predict_row(r, cost, a) for r in chosen}, "args": {k: str(v) for k, v in vars(a).items()}}
    a.out.mkdir(parents=True, exist_ok=True)
    name = (("open-runs" if not a.rows else "open-runs-" + "-".join(a.rows)) + ("" if a.gpu == "h200" else f"-{a.gpu}")
            + ("" if not a.runs else "-" + "-".join(r.replace(".", "_") for r in a.runs)))
    (a.out / f"{name}.json").write_text(json.dumps(res, indent=1, default=str))
    print(band)
    return 0


if __name__ == "__main__":
    sys.exit(main())
