"""Predict every one-GPU goodput sweep in bench/results with the simulator, beside what was measured.

    python -m bench.sim.replay_sweeps                       # every panel (about 10 min on one core)
    python -m bench.sim.replay_sweeps --panels s3/c2 12-03 --limit 4 --out /tmp/v.json

For each bench/serving.py report of a sweep (`gp_<run>_r<rate>[_k<repeat>].json`) the replay rebuilds
the request list with serving.py's own function from the report's `config` (trace, offset, number of
requests, arrival process and seed, length caps: the same rows and arrival times, see
tests/test_sim_replay.py), and runs it through bench/policy_sim.py: the real Scheduler with the run's
policy and preemption mode, the report's SLOs, the KV pool the server had, the host pool of the sweep
(HOST_GB, 32 GiB) and the calibrated H200 clock for the sweep's model. Requests not sent before the
report's `max_duration`, or unfinished then, are misses, as in serving.py.

KV pool: the server log beside the report (`gp_server_<run>.log`, "kv pool (N pages x P tokens") where
the sweep kept it, else the memory math of the engine (sglang_ext/engine/model_runner.py: share x GPU
memory - weights - what the process holds besides, in pages), whose two constants, the GPU's memory as
torch reports it and the process's own use, are fitted by least squares to every logged pool under
bench/results (`memory_constants`). Each point says which source it used.

The cost model is fitted to the offline / micro-benchmarks only (bench/sim/fit.py); nothing here is
fitted to the goodput results it predicts. A sweep run on another card is priced on that card's file
(`Sweep.gpu`; the H100's is derived), or on another with `--card-file GPU=JSON` (a diagnosis: the
Qwen3 H100 panel priced on the H200's file told the derivation's error from the model's). Panels whose
servers logged a step profile (bench/step_profile.py, knee calls since 2026-12-06 session 4) also get
their decode-only steps priced against what the servers measured ("decode-only steps in serving").
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Final, cast

import numpy as np
import torch

from bench import goodput as G
from bench import step_profile
from bench.policy_sim import Clock, make_scheduler, replay, serving_workload
from bench.serving import build_parser as serving_parser
from bench.serving import workload_config
from bench.sim.cost import DEFAULT_CALIBRATION, CostModel, Uncalibrated
from bench.sim.expert_load import with_record
from bench.sim.instance import gpu_calibration
from bench.traces import WorkloadConfig, repo_root
from sglang_ext.configs import preset_config_file
from sglang_ext.engine.cuda_graph import DEFAULT_MAX_BS, capture_sizes
from sglang_ext.models.config import ModelConfig
from sglang_ext.server_args import ServerArgs

RESULTS: Final = repo_root() / "bench" / "results"
POOL_LINE: Final = re.compile(r"kv pool [0-9.]+ s \((?P<pages>\d+) pages x (?P<page>\d+) tokens")
GiB: Final = 2**30
DETAIL: Final = ("ttft_median_ms", "tpot_mean_ms", "end_s")
SIM_FLAGS: Final = frozenset({"lvf_missed_last"})  # server arguments of a variant run the simulated scheduler reads


@dataclass(frozen=True)
class Sweep:
    """One folder of reports (one device call) and what the reports do not record: the memory share,
    the geometry, the host pool, and what code ran."""

    folder: str  # under bench/results
    share: float
    model: str = "llama-3-8b"
    host_gb: float = 32.0
    note: str = ""
    gpu: str = "h200"  # the card it ran on: its calibration file prices it (bench/sim/instance.py)


@dataclass(frozen=True)
class Panel:
    """One goodput setting: one folder, or the folders a panel merges (as docs/benchmarks.md does)."""

    name: str
    sweeps: tuple[Sweep, ...]


OLD_LVF = "older engine (lvf before EDF and the rotation bound); the replay runs today's scheduler"
PANELS: Final[tuple[Panel, ...]] = (
    Panel("12-01/c1 1/4", (Sweep("2026-12-01-goodput-fair/c1-gates-landed", 0.25,
                                 note="4046a55: rotation held steps to landed state; fcfs 6 paid JIT"),)),
    Panel("12-01/c2 1/4", (Sweep("2026-12-01-goodput-fair/c2-gates-landed", 0.25,
                                 note="4046a55: rotation held steps to landed state (fcfs-rotate slow)"),)),
    Panel("12-01/c3 1/4", (Sweep("2026-12-01-goodput-fair/c3-overlap", 0.25, note="a944f9e: " + OLD_LVF),)),
    Panel("12-01/c4 1/4 burst", (Sweep("2026-12-01-goodput-fair/c4-burst-share025", 0.25,
                                       note="a944f9e: " + OLD_LVF),)),
    Panel("12-01/c4 1/2", (Sweep("2026-12-01-goodput-fair/c4-share05", 0.5, note="a944f9e: " + OLD_LVF),)),
    Panel("12-01/c5 1/4 burst", (Sweep("2026-12-01-goodput-fair/c5-edf-burst-share025", 0.25,
                                       note="262e9b1: lvf EDF, before the rotation bound"),)),
    Panel("12-01/c5 1/2", (Sweep("2026-12-01-goodput-fair/c5-edf-share05", 0.5,
                                 note="262e9b1: lvf EDF, before the rotation bound"),)),
    Panel("12-01 mooncake 1/4", (
        Sweep("2026-12-01-goodput-share025-mooncake", 0.25, note="first lvf (rotation whenever ahead)"),
        Sweep("2026-12-01-goodput-share025-mooncake/high-rates", 0.25, note="first lvf"))),
    Panel("12-02/c1 1/2 lvf", (Sweep("2026-12-02-h200/c1-disagg-sampling-share05-lvf/goodput", 0.5),)),
    Panel("12-02/c2 0.9", (Sweep("2026-12-02-h200/c2-routing-share09/goodput", 0.9),)),
    Panel("12-02/c3 1/8", (Sweep("2026-12-02-h200/c3-share0125/goodput", 0.125),)),
    Panel("12-02/c4 qwen32b 1/2", (Sweep("2026-12-02-h200/c4-qwen32b-share05/goodput", 0.5, "qwen2.5-32b"),)),
    Panel("12-02/c5 azure 1/4", (Sweep("2026-12-02-h200/c5-window-sampling-azure-share025/goodput", 0.25),)),
    Panel("s2/c1 1/4 ttft2", (Sweep("2026-12-02-h200-s2/c1-window-sampling-ttft2-share025/goodput", 0.25),)),
    Panel("s2/c2 1/4 burst", (Sweep("2026-12-02-h200-s2/c2-window-pick-burst-share025/goodput", 0.25),)),
    Panel("s3/c1 1/4 ttft2", (Sweep("2026-12-02-h200-s3/c1-ttft2-share025-20s/goodput", 0.25),)),
    Panel("s3/c2 1/2 burst", (Sweep("2026-12-02-h200-s3/c2-burst-share05/goodput", 0.5),)),
    Panel("s3/c4 1/4 burst", (Sweep("2026-12-02-h200-s3/c4-burst-share025-repeat/goodput", 0.25),)),
    Panel("s3/c5+c6 1/8 burst", (Sweep("2026-12-02-h200-s3/c5-burst-share0125/goodput", 0.125),
                                 Sweep("2026-12-02-h200-s3/c6-burst-share0125-high/goodput", 0.125))),
    Panel("12-03/c1+c2 1/4 ttft2 knee", (Sweep("2026-12-03-h200/c1-poisson-share025-ttft2/knee", 0.25),
                                         Sweep("2026-12-03-h200/c2-poisson-share025-ttft2-r4/knee", 0.25))),
    Panel("s5/c3 mixtral 0.9 knee", (Sweep("2026-12-03-h200-s5/c3-mixtral-knee", 0.9, "mixtral-8x7b",
                                           note="94bc18e: tuned MoE table, dummy weights, TTFT 5 s; lvf only"),)),
    Panel("12-06 h100 1/2 ttft5 knee", (Sweep("2026-12-06-h100-s3/knee-share05-ttft5", 0.5, gpu="h100",
                                              note="32fc2a6 + 823fa1c, one H100: priced on the derived h100 file"),)),
    Panel("12-06 h100 1/2 azure off", (Sweep("2026-12-06-h100-s3/knee-adaptive-azure-share05", 0.5, gpu="h100",
                                             note="823fa1c, one H100: 'off' only (fixed and adaptive share the GPU "
                                                  "with an in-process executor, not priced)"),)),
    Panel("12-06 h100 qwen3 0.9 kvbind", (Sweep("2026-12-06-h100-s4/qwen3-kvbind-tpot02", 0.9, "qwen3-30b-a3b",
                                                gpu="h100", note="9b6b58d, one H100: Mooncake outputs <= 1,024, "
                                                                 "TPOT 0.2 s; H200 MoE tables (same chip); the "
                                                                 "dummy router's own choice (decode >= 1.5x "
                                                                 "cheaper than uniform routing in serving)"),)),
    Panel("12-06 h100 qwen3 0.9 uniform", (Sweep("2026-12-06-h100-s7/qwen3-uniform-knee", 0.9, "qwen3-30b-a3b",
                                                 gpu="h100", note="52326cc + f02de33 + dde4182 (six calls), one "
                                                                  "H100: the kvbind setting with "
                                                                  "--moe-routing-simulation uniform (the routing "
                                                                  "the simulator prices)"),)),
    Panel("12-07 h100 qwen3 0.9 uniform s10", (
        Sweep("2026-12-07-h100-s10/qwen3-pair-2.5", 0.9, "qwen3-30b-a3b", gpu="h100",
              note="241f433 (two calls on one machine): fcfs and lvf at 2.5 req/s on the same rows"),
        Sweep("2026-12-07-h100-s10/qwen3-lvf-3", 0.9, "qwen3-30b-a3b", gpu="h100",
              note="241f433 (the third call on that machine): lvf at 3 and 4.5"))),
    Panel("12-07 h100 qwen3 0.9 uniform s11", (Sweep("2026-12-07-h100-s11/qwen3-fcfs", 0.9, "qwen3-30b-a3b", gpu="h100",
                                                     note="931e188 (two calls on one machine): fcfs at 2.125 and "
                                                          "2.25 on the rows of the s10 panel"),)),
    Panel("12-07 h100 qwen3 0.9 uniform s12", (
        Sweep("2026-12-07-h100-s12/qwen3-lvf-3.375", 0.9, "qwen3-30b-a3b", gpu="h100",
              note="09f6409 (with the overlap change 27f6692): lvf at 3.375 on the rows of the s10 panel"),
        Sweep("2026-12-07-h100-s12/qwen3-lvf-3.1875", 0.9, "qwen3-30b-a3b", gpu="h100",
              note="09f6409, the next call on that machine: lvf at 3.1875"))),
    Panel("12-07 h100 qwen3 0.9 uniform s13", tuple(
        Sweep(f"2026-12-07-h100-s13/qwen3-fcfs-{rate}", 0.9, "qwen3-30b-a3b", gpu="h100",
              note=f"9ac66fa (the library of s12's lvf points), call {call} of four on one machine: fcfs at {rate}")
        for call, rate in enumerate(("2.125", "2.25", "2.5", "2.375"), start=1))),
    Panel("12-07 h100 qwen3 0.9 uniform s14", (
        Sweep("2026-12-07-h100-s14/qwen3-lvf-3.1875", 0.9, "qwen3-30b-a3b", gpu="h100",
              note="9aafe95 (padding rows reach no expert since 2e5bb7a): lvf at 3.1875, call 2 on one machine"),
        Sweep("2026-12-07-h100-s14/qwen3-fcfs-2.25", 0.9, "qwen3-30b-a3b", gpu="h100",
              note="9aafe95, call 3 on that machine: fcfs at 2.25"))),
    Panel("12-07 h100 qwen3 0.9 uniform s15", (
        Sweep("2026-12-07-h100-s15/qwen3-fcfs-2.375", 0.9, "qwen3-30b-a3b", gpu="h100",
              note="5190170 (9aafe95's serving path), call 2 on one machine: fcfs at 2.375"),
        Sweep("2026-12-07-h100-s15/qwen3-lvf-3.375", 0.9, "qwen3-30b-a3b", gpu="h100",
              note="5190170, call 3 on that machine: lvf at 3.375"),
        Sweep("2026-12-07-h100-s15/qwen3-lvf-missed-3.375", 0.9, "qwen3-30b-a3b", gpu="h100",
              note="5190170, call 6 on that machine: lvf with --lvf-missed-last at 3.375"))),
    Panel("12-07 h100 qwen3 0.9 uniform s16", (
        Sweep("2026-12-07-h100-s16/qwen3-lvf-missed-3.5625", 0.9, "qwen3-30b-a3b", gpu="h100",
              note="9f7c6e4, call 1 on one machine: lvf with --lvf-missed-last at 3.5625"),)),
    Panel("12-07 h100 1/2 ttft5 lvf-missed s16", tuple(
        Sweep(f"2026-12-07-h100-s16/llama-share05-lvf-pair-{rate}", 0.5, gpu="h100",
              note=f"9f7c6e4, call {call} on one machine: lvf with and without --lvf-missed-last at {rate}")
        for call, rate in ((3, "5"), (4, "5.5")))),
    Panel("12-07 h100 1/2 ttft5 triple s18", tuple(
        Sweep(f"2026-12-07-h100-s18/{folder}", 0.5, gpu="h100",
              note=f"{commit} (the library of 2089f21), call {call} on one machine: fcfs, lvf and lvf with "
                   f"--lvf-missed-last at {rate}")
        for call, folder, rate, commit in ((1, "dense-share05-ttft5", "5", "2089f21"),
                                           (3, "dense-share05-ttft5-r5.5", "5.5", "47d9788")))),
    Panel("12-07 h100 qwen3 0.9 uniform s18", (
        Sweep("2026-12-07-h100-s18/qwen3-uniform-fcfs-2.25", 0.9, "qwen3-30b-a3b", gpu="h100",
              note="47d9788 (the library of 2089f21), call 6 on one machine: fcfs at 2.25"),)),
    Panel("12-08 h100 qwen3 0.9 uniform s19", tuple(
        Sweep(f"2026-12-08-h100-s19/qwen3-uniform-{run}-{rate}", 0.9, "qwen3-30b-a3b", gpu="h100",
              note=f"9815e69 (the library of 2089f21), call {call} on one machine, {part} knee search: {run} at {rate}")
        for call, part, run, rate in ((1, "first", "fcfs", "2.375"), (1, "second", "lvf", "3.1875"),
                                      (2, "first", "fcfs", "2.5"), (2, "second", "lvf", "3.375")))),
    Panel("12-06 h200 mixtral 0.9 uniform", (Sweep("2026-12-06-h200-s9/mixtral-uniform-knee", 0.9, "mixtral-8x7b",
                                                   note="ff40ae9 + df5d696 (five calls, sessions 8-9), one H200: "
                                                        "Mooncake outputs <= 1,024, TPOT 0.2 s, "
                                                        "--moe-routing-simulation uniform"),)),
)


# ---------------------------------------------------------------------------------------------- the pool


def weight_bytes(model: str) -> int:
    """bf16 bytes of the model's weights as the engine allocates them (embedding and LM head included)."""
    return 2 * ModelConfig.from_path(preset_config_file(model)).num_params()


def logged_pool(server_log: Path) -> tuple[int, int] | None:
    """(pages, tokens per page) from a server log's startup line, if the log is there and has it."""
    if not server_log.is_file():
        return None
    m = POOL_LINE.search(server_log.read_text(errors="replace"))
    return (int(m["pages"]), int(m["page"])) if m else None


def page_bytes(model: str, page: int) -> int:
    """bf16 KV bytes of one pool page of `page` tokens (K and V, every layer)."""
    cfg = ModelConfig.from_path(preset_config_file(model))
    return page * 2 * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim


def memory_constants(results: Path = RESULTS) -> tuple[float, float]:
    """(GPU bytes, bytes the process holds besides weights and pool), least squares over every logged
    pool of the sweeps in PANELS: pages x page bytes = share x total - weights - other."""
    rows, rhs = [], []
    for panel in PANELS:
        for sw in panel.sweeps:
            if sw.gpu != "h200":
                continue  # another card's memory: its pools are logged, never computed
            for log in plain_server_logs(results / sw.folder):
                got = logged_pool(log)
                if got is None:
                    continue
                pages, page = got
                pool_bytes = pages * page_bytes(sw.model, page)
                rows.append([sw.share, -1.0])
                rhs.append(pool_bytes + weight_bytes(sw.model))
    if len(rows) < 2 or len({r[0] for r in rows}) < 2:
        raise ValueError(f"need logged pools at two shares under {results} to fit the memory constants")
    (total, other), *_ = np.linalg.lstsq(np.array(rows), np.array(rhs), rcond=None)
    return float(total), float(other)


def plain_server_logs(folder: Path) -> list[Path]:
    """The folder's server logs of plain runs (gp_server_POLICY-MODE.log): a variant's server
    (POLICY-MODE.NAME, e.g. an in-process executor with its share set aside) has another pool."""
    return [p for p in sorted(folder.glob("gp_server_*.log")) if "." not in p.stem.removeprefix("gp_server_")]


def pages_from_share(share: float, model: str, page: int, total: float, other: float) -> int:
    """The engine's pool in pages at `share` of a GPU of `total` bytes (kv_budget_bytes // page bytes)."""
    return int((share * total - other - weight_bytes(model)) // page_bytes(model, page))


def logged_pool_tokens(folder: Path, run: str) -> tuple[int, int] | None:
    """(usable tokens: (pages - 1) x page, page 0 being reserved; pages) of the first of the run's server
    logs in a panel folder that names its pool. A merged panel (--resume) keeps the last call's server logs
    on top and every earlier call's under calls/."""
    for log in [folder / f"gp_server_{run}.log", *sorted(folder.glob(f"calls/*/gp_server_{run}.log"))]:
        got = logged_pool(log)
        if got is not None:
            return (got[0] - 1) * got[1], got[0]
    return None


def pool_tokens(report: Path, run: str, sw: Sweep, constants: tuple[float, float], page: int = 16
                ) -> tuple[int, str]:
    """The pool the server had, in tokens the scheduler can use, and where it came from."""
    logged = logged_pool_tokens(report.parent, run)
    if logged is not None:
        return logged[0], f"server log ({logged[1]} pages)"
    if sw.gpu != "h200":
        raise ValueError(f"{report}: no server log with the pool, and the memory math is fitted to H200 pools only")
    pages = pages_from_share(sw.share, sw.model, page, *constants)
    return (pages - 1) * page, f"memory math (share {sw.share:g}: {pages} pages)"


# ---------------------------------------------------------------------------------------------- a point


def serving_config(config: dict[str, Any]) -> WorkloadConfig:
    """A report's `config` (serving.py's parsed flags) as the WorkloadConfig serving.py built its
    requests from; flags a report predates take serving.py's defaults, relative paths the repository's."""
    ns = serving_parser().parse_args([])
    for key, value in config.items():
        if hasattr(ns, key):
            setattr(ns, key, value)
    if ns.traces_dir is not None and not Path(ns.traces_dir).is_absolute():
        ns.traces_dir = repo_root() / ns.traces_dir
    ns.traces_dir = Path(ns.traces_dir)
    ns.models = tuple(ns.models or ())
    return workload_config(ns)


def run_of(label: str) -> tuple[str, str]:
    """(policy, preemption mode) of a sweep label: `lvf-rotate`, `fcfs-recompute-burst`, `lvf-rotate.missed`
    (a knee's variant: its server arguments come from `variant_kwargs`)..."""
    policy, mode = label.split(".", 1)[0].split("-")[:2]
    return policy, mode


def measured(report: dict[str, Any]) -> dict[str, float]:
    """Attainment of both SLOs, of TTFT and of TPOT over the scheduled requests (unsent ones miss)."""
    m = report["metrics"]
    sent = int(m["sent"])
    scheduled = int(report["workload"].get("scheduled", sent))
    slo = m["slo"]
    out = {k: float(slo[f"{k}_attainment"] or 0.0) * sent / scheduled if scheduled else 0.0
           for k in ("both", "ttft", "tbt")}
    return {**out, "ttft_median_ms": float(m["ttft_ms"]["median"] or math.nan),
            "tpot_mean_ms": float(m["tpot_ms"]["mean"] or math.nan), "end_s": float(m["duration_s"])}


def predict(report: dict[str, Any], run: str, pool: int, sw: Sweep, cost: CostModel, host_time: bool = True,
            extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Replay one report's requests on the simulator: attainment (both, TTFT, TPOT) over the scheduled.
    `extra`: server arguments the measured run did not have (a what-if on the same rows and arrivals)."""
    cfg = report["config"]
    ttft, tpot = float(cfg["ttft_slo"]), float(cfg["tbt_slo"])
    if cfg.get("tbt_stat", "mean") != "mean":
        raise ValueError(f"tbt_stat {cfg['tbt_stat']!r}: the replay scores the mean TPOT only")
    wc = serving_config(cfg)
    reqs = serving_workload(wc)
    horizon = float(cfg["max_duration"])
    policy, mode = run_of(run)
    clock = Clock()
    context = max(len(ids) + n for _, ids, n in reqs) + 16
    s = make_scheduler(policy, mode, pool, sw.host_gb, ttft, tpot, clock, cost, 16, context, skip_forward=True,
                       host_time=host_time, extra=extra)
    res = replay(s, clock, [r for r in reqs if r[0] < horizon], horizon_s=horizon)
    met = {"both": 0, "ttft": 0, "tbt": 0}
    ttfts, tpots = [], []
    for i, (_, _, n_out) in enumerate(reqs):
        ts = res["times"].get(f"q{i}", [])
        if len(ts) < n_out:
            continue  # unsent, or unfinished at max_duration: cancelled, a miss of every SLO
        first = ts[0] - res["arrival"][f"q{i}"]
        mean = (ts[-1] - ts[0]) / (len(ts) - 1) if len(ts) > 1 else 0.0
        ttfts.append(first)
        tpots.append(mean)
        met["ttft"] += first <= ttft
        met["tbt"] += mean <= tpot
        met["both"] += first <= ttft and mean <= tpot
    n = len(reqs)
    return {**{k: v / n for k, v in met.items()}, "both_met": met["both"], "scheduled": n,
            "rotations_out": res["rotations"], "preemptions": res["preemptions"], "end_s": clock.t,
            "ttft_median_ms": 1e3 * float(np.median(ttfts)) if ttfts else math.nan,
            "tpot_mean_ms": 1e3 * float(np.mean(tpots)) if tpots else math.nan}


@dataclass(frozen=True)
class Row:
    """One report, measured beside predicted."""

    panel: str
    folder: str
    file: str
    run: str
    rate: float
    repeat: int
    requests: int
    pool_tokens: int
    pool_source: str
    measured: dict[str, float]
    predicted: dict[str, float]
    rotations_out: int
    preemptions: int
    wall_s: float


@functools.cache  # asked once per report when listing a panel and again when replaying it
def variant_kwargs(folder: Path, label: str) -> dict[str, Any] | None:
    """The server arguments a run adds to its POLICY-MODE, as keywords: {} for a plain run; for a variant
    (POLICY-MODE.NAME) its args as the knee's goodput.json records them, but None where the folder does not
    say or an arg is one the simulated scheduler does not read (an in-process executor sharing the GPU,
    say, which the simulator does not price)."""
    if "." not in label:
        return {}
    name = label.split(".", 1)[1].split("-", 1)[0]  # a burst run's label ends in -burst (NAME has no -)
    meta = folder / "goodput.json"
    args = json.loads(meta.read_text()).get("variants", {}).get(name) if meta.exists() else None
    if args is None:
        return None
    kw = ServerArgs.flags_to_kwargs(list(args))
    return kw if kw and set(kw) <= SIM_FLAGS else None


def reports(panel: Panel) -> list[tuple[Sweep, Path, str, float, int]]:
    """Every report of the panel's folders but those of a variant run the replay cannot price
    (`variant_kwargs`)."""
    out = []
    for sw in panel.sweeps:
        for path in sorted((RESULTS / sw.folder).glob("gp_*.json")):
            m = G.NAME.match(path.name)
            if m is not None and variant_kwargs(path.parent, m["label"]) is not None:
                out.append((sw, path, m["label"], float(m["rate"]), int(m["repeat"] or 0)))
    return sorted(out, key=lambda r: (r[2], r[3], r[4]))


class ForwardTally:
    """A cost model that also tallies the forwards it priced: decode-only ones (rows, time) apart from
    those with a prefill chunk (time, prefill tokens, decode rows riding, chunks, keys their tokens attend
    over). `--forwards` prints it per point: where a point's simulated time went, to set beside a server's
    step profile (whose prefill segment has counted chunks and keys since 2026-12-07 session 16)."""

    def __init__(self, cost: CostModel) -> None:
        self._cost = cost
        self.decode: list[tuple[int, float]] = []  # (rows, seconds)
        self.prefill: list[tuple[int, int, float, int, int]] = []  # (tokens, decode rows, seconds, chunks, pairs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cost, name)

    def forward_s(self, extend_lens: Sequence[int], seq_lens: Sequence[int], host: bool = False) -> float:
        t = self._cost.forward_s(extend_lens, seq_lens, host)
        ones = sum(1 for n in extend_lens if n == 1)
        if ones == len(extend_lens):
            self.decode.append((ones, t))
        else:
            chunks = [(n, end) for n, end in zip(extend_lens, seq_lens, strict=True) if n != 1]
            pairs = sum(n * (end - n) + n * (n + 1) // 2 for n, end in chunks)  # the step log's count
            self.prefill.append((sum(n for n, _ in chunks), ones, t, len(chunks), pairs))
        return t

    def text(self) -> str:
        d, p = self.decode, self.prefill
        dec = "no decode-only forward"
        if d:
            dec = (f"{len(d)} decode-only at {np.mean([r for r, _ in d]):.1f} rows, "
                   f"{1e3 * np.mean([t for _, t in d]):.2f} ms")
        pre = "none with a prefill"
        if p:
            pre = (f"{len(p)} with a prefill at {1e3 * np.mean([q[2] for q in p]):.1f} ms "
                   f"({np.mean([q[0] for q in p]):,.0f} prefill tokens in {np.mean([q[3] for q in p]):.1f} chunks, "
                   f"{sum(q[4] for q in p) / max(sum(q[0] for q in p), 1):,.0f} keys a prompt token, "
                   f"{np.mean([q[1] for q in p]):.1f} decode rows riding)")
        total = sum(t for _, t in d) + sum(q[2] for q in p)
        share = sum(q[2] for q in p) / total if total else 0.0
        return f"forwards: {dec}; {pre}; prefill forwards {100 * share:.0f} % of the priced time"


def replay_panel(panel: Panel, costs: dict[tuple[str, str], CostModel], constants: tuple[float, float],
                 limit: int | None = None, log: bool = True, host_time: bool = True, forwards: bool = False,
                 extra: dict[str, dict[str, Any]] | None = None) -> list[Row]:
    """Every report of the panel, replayed; `extra`: run label (`lvf-rotate`) -> server arguments added."""
    rows = []
    for sw, path, label, rate, repeat in reports(panel)[:limit]:
        report = json.loads(path.read_text())
        run = "-".join(run_of(label))
        pool, source = pool_tokens(path, label if "." in label else run, sw, constants)
        # a variant's own server arguments, then a --what-if's: one for the exact label
        # (`lvf-rotate.missed`), else for its POLICY-MODE (`lvf-rotate` covers `lvf-rotate-burst` and variants)
        wi = extra or {}
        added = {**(variant_kwargs(path.parent, label) or {}), **wi.get(label, wi.get(run, {}))}
        t0 = time.perf_counter()
        cost = costs[(sw.gpu, sw.model)]
        tally = ForwardTally(cost) if forwards else None
        pred = predict(report, run, pool, sw, cast(CostModel, tally) if tally else cost, host_time,
                       added or None)
        row = Row(panel.name, sw.folder, path.name, label, rate, repeat, pred["scheduled"], pool, source,
                  measured(report), {k: pred[k] for k in ("both", "ttft", "tbt", *DETAIL)}, pred["rotations_out"],
                  pred["preemptions"], time.perf_counter() - t0)
        rows.append(row)
        if log:
            print(_row_text(row), flush=True)
            if tally is not None:
                print("      " + tally.text(), flush=True)
    return rows


def step_check(panels: Sequence[Panel], costs: dict[tuple[str, str], CostModel], rows: Sequence[Row]
               ) -> list[dict[str, Any]]:
    """The cost model's decode step against the decode-only steps the servers logged in serving (panels
    run with a step profile: bench/step_profile.py). Where the servers log the rows' context (since
    2026-12-06 session 5) the model prices each logged interval (~2 s) at its own rows and KV and the point's
    figure is their mean weighted by forwards, as the measured one is: a step's time is concave in its rows
    (an MoE's experts are all hit from ~16 rows on), so pricing the point's mean rows, as older logs must
    (with the point's mean pool use as KV: prefix cache and rows waiting for a prefill included, an upper
    bound), reads a point that mixes near-empty and full batches slow (`model_at_mean_ms`)."""
    pools = {(r.folder, r.run): r.pool_tokens for r in rows}  # both keyed by the reports' run label
    out = []
    for pn in panels:
        for sw in pn.sweeps:
            for pt in step_profile.folder_points(RESULTS / sw.folder):
                pool = pools.get((sw.folder, pt.run))
                if pool is None or not pt.decode_steps or not pt.decode_rows:
                    continue
                cost = costs[(sw.gpu, sw.model)]
                logged = pt.decode_context > 0
                kv = int(pt.decode_rows * pt.decode_context) if logged else int(pt.kv_mean * pool)
                at_mean = 1e3 * cost.decode_s(max(1, round(pt.decode_rows)), kv)
                per = [(n, cost.decode_s(max(1, round(r)), int(r * c))) for n, _, r, c, _ in pt.decode_intervals
                       ] if logged else []
                model_ms = 1e3 * sum(n * t for n, t in per) / sum(n for n, _ in per) if per else at_mean
                by_overlap = _by_overlap(pt.decode_intervals, per) if per else {}
                out.append({"panel": pn.name, "run": pt.run, "rate": pt.rate, "repeat": pt.repeat,
                            "rows": pt.decode_rows, "kv_tokens": kv, "measured_ms": pt.decode_ms,
                            "model_ms": model_ms, "model_at_mean_ms": at_mean,
                            "priced": "per interval" if per else "at the point's mean rows",
                            "error": model_ms / pt.decode_ms - 1, "kv_peak": pt.kv_peak,
                            "waiting": pt.waiting, "steps": pt.decode_steps,
                            "kv_source": "rows' context" if logged else "pool use (upper bound)",
                            "steps_source": pt.decode_source, "by_overlap": by_overlap,
                            **_prefill_check(cost, pt)})
    return out


PLAIN_MAX, OVERLAPPED_MIN = 0.1, 0.9  # an interval's share of steps overlapped: (almost) none / (almost) all


def _by_overlap(intervals: Sequence[tuple[int, float, float, float, float]], priced: Sequence[tuple[int, float]]
                ) -> dict[str, tuple[int, float, float]]:
    """(forwards, measured ms, model ms) of the decode-only forwards in intervals the overlap loop ran
    (almost) wholly plain and (almost) wholly overlapped. The cost model prices a decode's forward alone, as
    an overlapped step costs; a plain step's ms also hold the host time of scheduling it while the GPU
    idles, which the simulator, running the plain loop, charges only to forwards with a prefill."""
    out: dict[str, list[float]] = {}
    for (n, ms, _r, _c, ov), (_, t) in zip(intervals, priced, strict=True):
        key = "plain" if ov <= PLAIN_MAX else "overlapped" if ov >= OVERLAPPED_MIN else None
        if key is not None:
            a = out.setdefault(key, [0, 0.0, 0.0])
            a[0] += n
            a[1] += n * ms
            a[2] += n * 1e3 * t
    return {k: (int(n), m / n, mm / n) for k, (n, m, mm) in out.items()}


def _prefill_check(cost: CostModel, pt: step_profile.PointSteps) -> dict[str, Any]:
    """The forwards that carried a prefill, from the step log (bench/step_profile.py: timed by the server
    since 2026-12-07 session 15, estimated before) and priced per interval as the simulator charges them: the
    interval's mean prompt tokens split into its mean number of chunks, each placed so that its tokens attend
    over the keys the log counted (since session 16; before, one chunk from its prompt's start, a lower bound
    for chunks after a prefix), its decode rows riding along, and the host time of a step the loop runs plain
    (`plain_host_s`, where calibrated: the server's time is the whole call's). `prefill_keys` is the mean
    number of keys a prompt token attended over. Empty for servers that logged no context (before 2026-12-06
    session 5)."""
    iv = pt.prefill_intervals
    n = sum(k for k, *_ in iv)
    if not n:
        return {}
    model = keys = 0.0
    for k, _, t, r, c, chunks, per_token in iv:
        m = max(1, round(chunks))
        new = max(1, round(t / m))
        before = max(0, round(per_token - (new + 1) / 2))  # a chunk's prefix, so its pairs match the log's
        try:
            host = cost.plain_host_s(round(r) + m)
        except Uncalibrated:
            host = 0.0
        model += k * (cost.prefill_s([(new, new + before)] * m, round(r), int(r * c)) + host)
        keys += k * per_token
    return {"prefill_forwards": n, "prefill_measured_ms": sum(k * ms for k, ms, *_ in iv) / n,
            "prefill_tokens": sum(k * t for k, _, t, *_ in iv) / n, "prefill_keys": keys / n,
            "prefill_model_ms": 1e3 * model / n}


def print_step_check(checks: Sequence[dict[str, Any]]) -> None:
    if not checks:
        print("\nno step profile in these panels' server logs (runs before 2026-12-06 session 4): no step check")
        return
    print("\ndecode-only steps in serving (the servers' step profile) against the cost model's decode step")
    for c in checks:
        print(f"{c['panel']:<26} {c['run']:<22} {c['rate']:>5g} k{c['repeat']}  {c['steps']:>5} steps at "
              f"{c['rows']:5.1f} rows, ~{c['kv_tokens']:>7} KV tokens ({c['kv_source']}): "
              f"{c['measured_ms']:6.1f} ms -> model "
              f"{c['model_ms']:6.1f} ms ({100 * c['error']:+.1f} %"
              + (f"; at the mean rows {c['model_at_mean_ms']:.1f}" if c["priced"] == "per interval" else "")
              + f")  KV peak {100 * c['kv_peak']:.0f} %, waiting {c['waiting']:.1f}")
    older = sum(c.get("steps_source") == step_profile.OLDER for c in checks)
    if older:
        print(f"({older} of these points from servers before 2026-12-06 session 6, which counted calls: their "
              f"decode-only steps are read from their wholly overlapped intervals only)")
    errs = [abs(c["error"]) for c in checks]
    print(f"{len(checks)} points: decode step error mean {100 * float(np.mean(errs)):.1f} %, "
          f"max {100 * max(errs):.1f} %")
    for key in ("overlapped", "plain"):
        got = [c["by_overlap"][key] for c in checks if key in c.get("by_overlap", {})]
        if got:
            n = sum(g[0] for g in got)
            meas, model = sum(g[0] * g[1] for g in got) / n, sum(g[0] * g[2] for g in got) / n
            print(f"  decode-only forwards in intervals run {'(almost) wholly ' + key:<26} {n:>6} forwards: "
                  f"{meas:6.1f} ms measured, {model:6.1f} ms model ({100 * (model / meas - 1):+.1f} %)")
    pre = [c for c in checks if c.get("prefill_forwards")]
    if pre:
        print("forwards with a prefill (the servers' time of those calls since 2026-12-07 session 15, before it "
              "the time left after the decode-only forwards; priced with the plain loop's host time)")
        for c in pre:
            err = c["prefill_model_ms"] / c["prefill_measured_ms"] - 1
            print(f"{c['panel']:<26} {c['run']:<22} {c['rate']:>5g} k{c['repeat']}  {c['prefill_forwards']:>4} x "
                  f"{c['prefill_measured_ms']:6.1f} ms at ~{c['prefill_tokens']:5.0f} tokens, "
                  f"{c['prefill_keys']:5.0f} keys a token -> model {c['prefill_model_ms']:6.1f} ms "
                  f"({100 * err:+.1f} %)")
        meas = sum(c["prefill_forwards"] * c["prefill_measured_ms"] for c in pre)
        model = sum(c["prefill_forwards"] * c["prefill_model_ms"] for c in pre)
        print(f"{len(pre)} points: forwards with a prefill priced {100 * (model / meas - 1):+.1f} % in all "
              f"(weighted by forwards)")


# ---------------------------------------------------------------------------------------------- goodput


def _points(rows: Sequence[Row], which: str) -> dict[str, list[G.Point]]:
    runs: dict[str, list[G.Point]] = {}
    for r in rows:
        att = r.measured["both"] if which == "measured" else r.predicted["both"]
        runs.setdefault(r.run, []).append(G.Point(r.run, r.rate, r.requests, round(att * r.requests), 0.0,
                                                  None, None, r.repeat))
    return runs


def grid_index(g: G.Goodput, grid: Sequence[float]) -> int:
    """Position of a strict goodput on the swept grid: -1 below the lowest rate."""
    return -1 if g.below_lowest is not None else grid.index(g.rate)


def goodput_table(rows: Sequence[Row], target: float = 0.9) -> list[dict[str, Any]]:
    """Per panel and run: strict goodput (bench/goodput.py's rule, mean curve over repeats) measured and
    predicted, and whether they are within one step of the swept grid."""
    out = []
    panels = dict.fromkeys(r.panel for r in rows)
    for panel in panels:
        mine = [r for r in rows if r.panel == panel]
        meas, pred = _points(mine, "measured"), _points(mine, "predicted")
        for run in meas:
            grid = sorted({p.rate for p in meas[run]})
            gm, gp = G.goodput_of(meas[run], target), G.goodput_of(pred[run], target)
            steps = abs(grid_index(gm, grid) - grid_index(gp, grid))
            errs = [abs(r.predicted["both"] - r.measured["both"]) for r in mine if r.run == run]
            out.append({"panel": panel, "run": run, "grid": grid, "measured": gm.text(), "predicted": gp.text(),
                        "steps_apart": steps, "within_one_step": steps <= 1,
                        "attainment_mae_points": 100 * float(np.mean(errs)), "points": len(errs),
                        "by_rate": by_rate([r for r in mine if r.run == run])})
    return out


def by_rate(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Per swept rate: both-SLO attainment over the repeats (their mean, as bench/goodput.py's mean curve;
    min and max of the repeats), measured and predicted, and the difference in points."""
    out = []
    for rate in sorted({r.rate for r in rows}):
        mine = [r for r in rows if r.rate == rate]
        n = sum(r.requests for r in mine)
        meas = [r.measured["both"] for r in mine]
        pred = [r.predicted["both"] for r in mine]
        m, p = float(np.mean(meas)), float(np.mean(pred))
        out.append({"rate": rate, "repeats": len(mine), "requests": n, "measured": m, "predicted": p,
                    "measured_range": [min(meas), max(meas)], "predicted_range": [min(pred), max(pred)],
                    "error_points": 100 * (p - m)})
    return out


def _row_text(r: Row) -> str:
    m, p = r.measured, r.predicted
    return (f"{r.panel:<26} {r.run:<22} {r.rate:>5g} k{r.repeat} n={r.requests:<4} both {100 * m['both']:5.1f} -> "
            f"{100 * p['both']:5.1f}  TTFT {100 * m['ttft']:5.1f} -> {100 * p['ttft']:5.1f}  TPOT "
            f"{100 * m['tbt']:5.1f} -> {100 * p['tbt']:5.1f}  TTFT p50 {m['ttft_median_ms']:5.0f} -> "
            f"{p['ttft_median_ms']:5.0f} ms  TPOT mean {m['tpot_mean_ms']:4.0f} -> {p['tpot_mean_ms']:4.0f} ms  "
            f"end {m['end_s']:5.1f} -> {p['end_s']:5.1f} s  rot {r.rotations_out}  ({r.wall_s:.0f} s)")


def summary(rows: Sequence[Row]) -> dict[str, Any]:
    def mae(key: str) -> float:
        return 100 * float(np.mean([abs(r.predicted[key] - r.measured[key]) for r in rows])) if rows else math.nan

    bias = 100 * float(np.mean([r.predicted["both"] - r.measured["both"] for r in rows])) if rows else math.nan
    return {"points": len(rows), "mae_both_points": mae("both"), "mae_ttft_points": mae("ttft"),
            "mae_tpot_points": mae("tbt"), "mean_signed_both_points": bias}


BANDS: Final = (("passing (measured >= 90 %)", 0.9, 2.0), ("near the knee (50-90 %)", 0.5, 0.9),
                ("past it (< 50 %)", 0.0, 0.5))


def latency_bias(points: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Where the simulator's latencies part from the measured ones, by how loaded the point was (its
    measured both-SLO attainment): the median relative error of the mean TPOT and of the median TTFT
    (predicted / measured - 1; negative: the simulator is fast), the share of points it under-predicts,
    and the median attainment error. A cost model within a few % of the offline step times that is fast
    here prices something serving pays and the offline bench does not."""
    out = []
    for name, lo, hi in (*BANDS, ("all", 0.0, 2.0)):
        sel = [p for p in points if lo <= p["measured"]["both"] < hi
               and all(p[k]["tpot_mean_ms"] and p[k]["ttft_median_ms"] for k in ("measured", "predicted"))
               and not any(math.isnan(p[k][m]) for k in ("measured", "predicted")
                           for m in ("tpot_mean_ms", "ttft_median_ms"))]
        if not sel:
            continue
        tpot = [p["predicted"]["tpot_mean_ms"] / p["measured"]["tpot_mean_ms"] - 1 for p in sel]
        ttft = [p["predicted"]["ttft_median_ms"] / p["measured"]["ttft_median_ms"] - 1 for p in sel]
        out.append({"band": name, "points": len(sel), "tpot_median_rel": float(np.median(tpot)),
                    "tpot_under_share": sum(x < 0 for x in tpot) / len(sel),
                    "ttft_median_rel": float(np.median(ttft)), "ttft_under_share": sum(x < 0 for x in ttft) / len(sel),
                    "both_median_error_points": 100 * float(np.median(
                        [p["predicted"]["both"] - p["measured"]["both"] for p in sel]))})
    return out


def print_bias(points: Sequence[dict[str, Any]]) -> None:
    print("\nlatency bias by load (predicted / measured - 1, median; under: share of points predicted faster)")
    for b in latency_bias(points):
        print(f"{b['band']:<28} {b['points']:>4} points  TPOT mean {100 * b['tpot_median_rel']:+5.1f} % "
              f"(under {100 * b['tpot_under_share']:3.0f} %)  TTFT p50 {100 * b['ttft_median_rel']:+5.1f} % "
              f"(under {100 * b['ttft_under_share']:3.0f} %)  both {b['both_median_error_points']:+5.1f} points")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--panels", nargs="*", default=None,
                   help="panels whose name or folder contains any of these strings (default: all)")
    p.add_argument("--limit", type=int, default=None, help="at most this many reports per panel")
    p.add_argument("--list", action="store_true", help="list the panels and their folders, run nothing")
    p.add_argument("--calibration", type=Path, default=DEFAULT_CALIBRATION)
    p.add_argument("--card-file", action="append", default=[], metavar="GPU=JSON",
                   help="price the sweeps run on GPU with this calibration instead of its own (a diagnosis: "
                        "h100=bench/sim/calibration/h200.json asks whether the derivation or the model is off)")
    p.add_argument("--forwards", action="store_true",
                   help="print per point the forwards the simulator priced (decode-only apart from those with a "
                        "prefill): where its time went")
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--padded-experts", action="store_true",
                   help="price an MoE decode step's experts at its CUDA graph's padded size, as the engine ran "
                        "before 2026-12-07 (2e5bb7a: padding rows now reach no expert); for replaying runs of then")
    p.add_argument("--expert-distribution", action="append", default=[], metavar="MODEL=JSON",
                   help="price MODEL's (a preset, e.g. qwen3-30b-a3b) decode experts by a recorded routing skew "
                        "(a dump of /dump_expert_distribution_record; bench/expert_record.py) instead of uniform "
                        "routing: for panels served with the model's own router (e.g. session 4's dummy router)")
    p.add_argument("--no-host-time", action="store_true",
                   help="price GPU time only (before 2026-12-03's fix: no host time for unoverlapped prefill steps)")
    p.add_argument("--what-if", action="append", default=[], metavar="RUN=FLAGS",
                   help="replay RUN (policy-mode, e.g. lvf-rotate) with these launcher flags added, which the "
                        "measured run did not have (repeatable; --what-if 'lvf-rotate=--lvf-missed-last'): the "
                        "table then compares a changed policy on the same rows and arrivals against the measured one")
    p.add_argument("--out", type=Path, default=None, help="JSON: every point, the goodput table, the MAE")
    p.add_argument("--bias-from", type=Path, default=None, metavar="JSON",
                   help="print the latency bias by load of an earlier --out file and exit (no replay)")
    a = p.parse_args(argv)
    if a.bias_from is not None:
        points = json.loads(a.bias_from.read_text())["points"]
        print_bias([p for p in points if a.panels is None or any(k in p["panel"] for k in a.panels)])
        return 0
    chosen = [pn for pn in PANELS if a.panels is None
              or any(k in pn.name or any(k in sw.folder for sw in pn.sweeps) for k in a.panels)]
    if a.list:
        for pn in chosen:
            print(f"{pn.name:<28} " + " + ".join(f"{sw.folder} (share {sw.share:g}, {sw.model})" for sw in pn.sweeps))
        return 0
    if not chosen:
        print(f"error: no panel matches {a.panels}", file=sys.stderr)
        return 2
    extra: dict[str, dict[str, Any]] = {}
    for spec in a.what_if:
        run, sep, flags = spec.partition("=")
        if not sep:
            print(f"error: --what-if {spec!r}: want RUN=FLAGS", file=sys.stderr)
            return 2
        extra[run] = {**extra.get(run, {}), **ServerArgs.flags_to_kwargs(flags.split())}
        print(f"WHAT-IF: {run} replayed with {flags} (not what the measured run ran)")
    torch.set_num_threads(1)
    constants = memory_constants()
    print(f"memory math: GPU {constants[0] / GiB:.2f} GiB, process besides weights and pool "
          f"{constants[1] / GiB:.2f} GiB (least squares over the logged pools)")
    # an H200 sweep takes --calibration; another card's sweep takes that card's file (h100: derived)
    cal_files = {g: a.calibration if g == "h200" else gpu_calibration(g)[0]
                 for g in {sw.gpu for pn in chosen for sw in pn.sweeps}}
    for spec in a.card_file:
        gpu, sep, path = spec.partition("=")
        if not sep or gpu not in cal_files:
            print(f"error: --card-file {spec!r}: want GPU=JSON for a card of the chosen panels "
                  f"({', '.join(sorted(cal_files))})", file=sys.stderr)
            return 2
        cal_files[gpu] = Path(path)
        print(f"sweeps run on {gpu} priced on {path} (--card-file)")
    pairs = {(sw.gpu, sw.model) for pn in chosen for sw in pn.sweeps}
    sizes = capture_sizes(DEFAULT_MAX_BS) if a.padded_experts else None
    costs = {(g, m): CostModel.load(cal_files[g], m, sizes) for g, m in pairs}
    for spec in a.expert_distribution:
        model, sep, path = spec.partition("=")
        hit = [k for k in costs if k[1] == model]
        if not sep or not hit:
            print(f"error: --expert-distribution {spec!r}: want MODEL=JSON for a model of the chosen panels "
                  f"({', '.join(sorted({m for _, m in costs}))})", file=sys.stderr)
            return 2
        for key in hit:
            costs[key] = replace(costs[key], geo=with_record(costs[key].geo, path))
        print(f"{model}: decode experts priced by the routing recorded in {path} (--expert-distribution)")
    rows: list[Row] = []
    for pn in chosen:
        rows += replay_panel(pn, costs, constants, a.limit, host_time=not a.no_host_time, forwards=a.forwards,
                             extra=extra)
    table = goodput_table(rows, a.target)
    print("\nstrict goodput (req/s), measured -> predicted, and attainment MAE (points)")
    for t in table:
        print(f"{t['panel']:<26} {t['run']:<22} {t['measured']:>7} -> {t['predicted']:<7} "
              f"{'ok' if t['within_one_step'] else 'MISS'} ({t['steps_apart']} steps)  "
              f"MAE {t['attainment_mae_points']:.1f} over {t['points']}")
        print("      " + "  ".join(
            f"{b['rate']:g}: {100 * b['measured']:.1f} [{100 * b['measured_range'][0]:.0f}-"
            f"{100 * b['measured_range'][1]:.0f}] -> {100 * b['predicted']:.1f} [{100 * b['predicted_range'][0]:.0f}-"
            f"{100 * b['predicted_range'][1]:.0f}] ({b['error_points']:+.1f})" for b in t["by_rate"]))
    checks = step_check(chosen, costs, rows)
    print_step_check(checks)
    s = summary(rows)
    ok = sum(t["within_one_step"] for t in table)
    print(f"\n{s['points']} points: both-SLO attainment MAE {s['mae_both_points']:.1f} points (mean signed "
          f"{s['mean_signed_both_points']:+.1f}), TTFT {s['mae_ttft_points']:.1f}, TPOT {s['mae_tpot_points']:.1f}; "
          f"goodput within one grid step for {ok} of {len(table)} runs")
    print_bias([asdict(r) for r in rows])
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({
            "calibration": str(a.calibration), "host_time": not a.no_host_time,
            "calibration_by_gpu": {g: str(path) for g, path in sorted(cal_files.items())},
            "memory_constants_bytes": constants, "target": a.target,
            "summary": {**s, "goodput_within_one_step": ok, "goodput_runs": len(table)},
            "goodput": table, "points": [asdict(r) for r in rows], "step_check": checks}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
