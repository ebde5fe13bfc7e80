"""The fleet replay: many models on many simulated GPUs, each instance the real Scheduler (instance.py).

A `FleetPlan` says which model instances run on which GPU with what share of its memory (at most four
per GPU), which instances offload attention to which GPU (WEAVER pairings) and whether instances rotate
KV to host memory. `run_fleet` builds the instances, hands each model's requests to its replicas
(round robin weighted by their memory share), and runs the earliest-clock event loop. `place` turns a
model list into a plan for a strategy (`dedicated`, `weaver`, `rotation`, `both`) at a capacity scale,
and `fewest_gpus` walks the scales up until the fleet keeps the target share of requests within both
SLOs.

Everything it prints or writes is SIMULATED: see docs/simulator.md for what is modelled and the error
band of the cost model it runs on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np

from bench.policy_sim import VOCAB, summarize
from bench.sim.cost import Calibration, CostModel, GiB
from bench.sim.expert_load import with_record
from bench.sim.geometry import Geometry
from bench.sim.instance import Instance, InstanceSpec, SimGpu, gpu_calibration, pool_tokens_for, run_instances
from bench.traces import (
    MOONCAKE_BLOCK_TOKENS,
    SERVEGEN_RATES_FILE,
    TRACE_FILES,
    PromptBuilder,
    burst_arrivals,
    clip_lengths,
    default_traces_dir,
    load_trace,
    poisson_arrivals,
    servegen_day1_shares,
)
from sglang_ext.configs import preset_names
from sglang_ext.models.config import ModelConfig

STRATEGIES: Final = ("dedicated", "weaver", "rotation", "both")
FULL: Final = 0.9  # memory fraction of a whole GPU (mem_fraction_static), split in quarters between models
MAX_PER_GPU: Final = 4
ERROR_BAND: Final = ("SIMULATED. Cost model error (bench/sim/validate.py, H200): Llama-3-8B decode step <= 5 % on "
                     "35 held-out rows (mean 1.5 %), prefill <= 3.9 % on 4; MoE decode (Mixtral-8x7B, Qwen3-30B-A3B, "
                     "random routers) 3.9 % mean, 11.6 % max on 6 held-out rows; MoE prefill 2.5 % max on 2 held-out "
                     "rows, 11.1 % mean / 26.7 % max leave-one-out (its term needs both measured geometries); other "
                     "geometries, mixed prefill+decode batches, the executor's capped SMs and any non-H200 link are "
                     "unvalidated. Serving attainment (python -m bench.sim.replay_sweeps, 127 measured points, "
                     "Mixtral-8x7B's knee included): mean absolute error 4.2 points, optimistic by +3.7 on average "
                     "(TTFT near the knee), strict goodput within one grid step for 37 of 40 runs; latencies fast "
                     "(median TPOT -6.7 %, TTFT p50 -7.3 %, on 90 / 87 % of points: replay_sweeps --bias-from).")

DERIVED_BAND: Final = ("DERIVED calibration ({gpu}): the H200's rates scaled by datasheet ratios "
                       "(python -m bench.sim.derive). Checked against the H100's own runs (2026-12-07 session 15, "
                       "bench/results/2026-12-07-s15-sim-h100-refit/): step times, every Qwen3-30B-A3B decode row "
                       "of the current code within 1.1 % and every row at a CUDA-graph size within 5 %, Llama-3-8B "
                       "bs 96 / 128 within +3.8 %; serving, Llama-3-8B at 1/2 (33 points): attainment MAE 2.0 "
                       "points (optimistic by +1.8), strict goodput within one grid step for 3 of 3 runs, mean TPOT "
                       "+0.3 %, TTFT p50 -11.8 % (median); Qwen3-30B-A3B at 0.9 with uniform expert routing (75 "
                       "points, sessions 6-14): MAE 3.7 points, 9 of 9 runs within a step, TPOT +0.0 %, TTFT p50 "
                       "-9.0 %, decode-only forwards +8 % (overlapped) / -12 % (plain). A file fitted to the H100's "
                       "own offline rows does no better on serving (MAE 5.0 / 2.5). MoE predictions price a "
                       "trained router's spread of experts, so compare them only with runs on real weights or "
                       "--moe-routing-simulation uniform (a dummy router's own choice, priced as uniform: MAE 19.7 "
                       "points, TPOT +111 %; priced by its expert record: TPOT -29 %).")


def error_band(cal: Calibration) -> str:
    """What a figure priced on `cal` is worth: the H200's validation, and for a derived file what it rests on."""
    return ERROR_BAND if "derived" not in cal.raw else f"{ERROR_BAND}\n{DERIVED_BAND.format(gpu=cal.gpu)}"


def load_geometry(model: str, expert_distribution: str | None = None) -> Geometry:
    """A preset name (`llama-3-8b`, `preset:qwen2.5-32b`) or a config.json path (file or its folder);
    `expert_distribution`: a server's expert distribution record of it, for a trained router's skew."""
    name = model.removeprefix("preset:")
    if name in preset_names():
        geo = Geometry.preset(name)
    else:
        p = Path(model)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise ValueError(f"model {model!r} is neither a preset ({', '.join(preset_names())}) nor a config.json "
                             "path")
        geo = Geometry.from_model_config(ModelConfig.from_path(p), p.parent.name or p.stem)
    return geo if expert_distribution is None else with_record(geo, expert_distribution)


@dataclass
class ModelSpec:
    """One served model: its geometry, SLOs, traffic and request lengths."""

    name: str
    model: str  # preset or config.json path
    rate: float  # req/s (whole model, all replicas)
    ttft_s: float = 2.0
    tpot_s: float = 0.1
    trace: str = "azure-conv"  # request lengths: azure-conv, azure-code, mooncake
    max_in: int = 8192
    max_out: int = 512
    arrival: str = "poisson"  # or "burst" (4x for 5 s of every 30 s, same mean)
    trace_offset: int = 0
    expert_distribution: str | None = None  # an MoE's expert distribution record (bench/sim/expert_load.py)

    def __post_init__(self) -> None:
        if self.trace not in TRACE_FILES:
            raise ValueError(f"model {self.name}: trace must be one of {sorted(TRACE_FILES)}, not {self.trace!r}")
        if self.arrival not in ("poisson", "burst"):
            raise ValueError(f"model {self.name}: arrival must be poisson or burst, not {self.arrival!r}")
        if self.rate < 0 or self.ttft_s <= 0 or self.tpot_s <= 0:
            raise ValueError(f"model {self.name}: rate must be >= 0 and the SLOs > 0")

    @property
    def context(self) -> int:
        return self.max_in + self.max_out + 16


@dataclass
class Slot:
    model: str
    gpu: int
    mem_fraction: float  # of the GPU's memory (a whole GPU: 0.9)


@dataclass
class Pairing:
    """WEAVER: slot `sender` keeps `ratio` of its decoding requests' attention and KV on `executor_gpu`,
    which lends `executor_gib` of its KV memory for them."""

    sender: int
    executor_gpu: int
    ratio: float = 0.5
    executor_gib: float = 32.0


@dataclass
class FleetPlan:
    gpus: int
    slots: list[Slot]
    pairings: list[Pairing] = field(default_factory=list)
    rotation: bool = False
    host_gb_per_gpu: float = 64.0  # host KV pool per GPU for rotation (split by memory share)
    executor_sms: int | None = None  # WEAVER executors capped at this many SMs (None: uncapped)

    def describe(self) -> dict[str, Any]:
        gpus: list[list[str]] = [[] for _ in range(self.gpus)]
        for s in self.slots:
            gpus[s.gpu].append(f"{s.model} ({s.mem_fraction / FULL:.2g} GPU)")
        pairs = [f"{self.slots[p.sender].model}@gpu{self.slots[p.sender].gpu} -> gpu{p.executor_gpu} "
                 f"(ratio {p.ratio:g}, {p.executor_gib:g} GiB lent)" for p in self.pairings]
        return {"gpus": self.gpus, "per_gpu": gpus, "pairings": pairs, "rotation": self.rotation,
                "raw": asdict(self)}


# ---------------------------------------------------------------------------------------------- traffic


def servegen_rates(names: Sequence[str], total: float) -> dict[str, float]:
    """ServeGen's day-1 per-model request shares of the named ServeGen models, renormalised over them and
    scaled to `total` req/s."""
    shares = dict(servegen_day1_shares(default_traces_dir() / SERVEGEN_RATES_FILE))
    unknown = [n for n in names if n not in shares]
    if unknown:
        raise ValueError(f"no ServeGen model {unknown}; ServeGen has {sorted(shares)}")
    s = sum(shares[n] for n in names)
    return {n: total * shares[n] / s for n in names}


def make_requests(m: ModelSpec, seconds: float, seed: int) -> list[tuple[float, list[int], int]]:
    """(arrival, prompt, output length) for `rate x seconds` requests of model `m` (at least 2)."""
    n = max(2, round(m.rate * seconds))
    rows = clip_lengths(load_trace(m.trace, default_traces_dir(), m.trace_offset, n), m.max_in, m.max_out)
    while len(rows) < n:  # a short trace repeats
        rows += rows[: n - len(rows)]
    rng = np.random.default_rng([seed, sum(map(ord, m.name))])
    times = (poisson_arrivals(n, m.rate, 1.0, rng) if m.arrival == "poisson"
             else burst_arrivals(n, m.rate, 4.0, 5.0, 30.0, 1.0, rng))
    prompts = PromptBuilder(VOCAB, 2, seed, MOONCAKE_BLOCK_TOKENS)
    return [(t, prompts.build(r, i), r.output_len) for i, (t, r) in enumerate(zip(times, rows, strict=True))]


# ------------------------------------------------------------------------------------------------ replay


@dataclass
class FleetResult:
    plan: FleetPlan
    per_model: dict[str, dict[str, Any]]
    per_gpu: list[dict[str, Any]]
    attainment: float  # requests within both SLOs / requests, whole fleet
    scheduled: int
    iterations: int

    def as_dict(self) -> dict[str, Any]:
        return {"label": "SIMULATED", "error_band": ERROR_BAND, "plan": self.plan.describe(),
                "per_model": self.per_model, "per_gpu": self.per_gpu, "attainment": self.attainment,
                "scheduled": self.scheduled, "gpus_used": self.plan.gpus}


def run_fleet(plan: FleetPlan, models: Sequence[ModelSpec], cal: Calibration, gpu_mem_gib: float,
              seconds: float, seed: int = 0, horizon_factor: float = 3.0,
              requests: dict[str, list[tuple[float, list[int], int]]] | None = None,
              extra_tpot_s: Sequence[float] = ()) -> FleetResult:
    """Replay every model's requests on the plan's instances; all times on the calibrated clock.
    `extra_tpot_s`: also report both-SLO attainment under these mean-TPOT SLOs (exact for fcfs, whose
    decisions do not read the SLO; lvf's would differ under them)."""
    specs = {m.name: m for m in models}
    geos = {m.name: load_geometry(m.model, m.expert_distribution) for m in models}
    gpus = [SimGpu(i, executor_sms=plan.executor_sms) for i in range(plan.gpus)]
    lent = [0.0] * plan.gpus
    for p in plan.pairings:
        lent[p.executor_gpu] += p.executor_gib
    # memory lent to executors comes out of the GPU's models in proportion to their own KV room
    room = [pool_tokens_for(geos[s.model], s.mem_fraction, gpu_mem_gib) * geos[s.model].kv_bytes_per_token / GiB
            for s in plan.slots]
    gpu_room = [sum(r for r, s in zip(room, plan.slots, strict=True) if s.gpu == g) for g in range(plan.gpus)]
    by_sender = {p.sender: p for p in plan.pairings}
    instances: list[Instance] = []
    for i, s in enumerate(plan.slots):
        m, geo = specs[s.model], geos[s.model]
        minus = lent[s.gpu] * room[i] / gpu_room[s.gpu] if lent[s.gpu] else 0.0
        pair = by_sender.get(i)
        spec = InstanceSpec(
            name=f"{s.model}#{i}", model=s.model, pool_tokens=pool_tokens_for(geo, s.mem_fraction, gpu_mem_gib, minus),
            ttft_s=m.ttft_s, tpot_s=m.tpot_s, context=m.context,
            policy="lvf" if plan.rotation else "fcfs", mode="rotate" if plan.rotation else "recompute",
            host_gb=plan.host_gb_per_gpu * s.mem_fraction / FULL,
            offload_ratio=pair.ratio if pair else 0.0,
            executor_tokens=int(pair.executor_gib * GiB / geo.kv_bytes_per_token) if pair else 0)
        instances.append(Instance(spec, CostModel(cal, geo), gpus[s.gpu],
                                  gpus[pair.executor_gpu] if pair else None))
    reqs = requests if requests is not None else {m.name: make_requests(m, seconds, seed) for m in models}
    out_len: dict[str, dict[str, int]] = {}
    for name, rs in reqs.items():
        replicas = [inst for inst in instances if inst.spec.model == name]
        if not replicas:
            raise ValueError(f"model {name} has traffic but no instance in the plan")
        weight = [plan.slots[instances.index(r)].mem_fraction for r in replicas]
        sent = [0] * len(replicas)
        out_len[name] = {}
        for k, (t, prompt, n_out) in enumerate(rs):
            j = min(range(len(replicas)), key=lambda j: sent[j] / weight[j])
            sent[j] += 1
            rid = f"{name}/{k}"
            replicas[j].add(rid, t, prompt, n_out)
            out_len[name][rid] = n_out
    iterations = run_instances(instances, seconds * horizon_factor)
    per_model: dict[str, dict[str, Any]] = {}
    total_ok = total = 0
    for name, lens in out_len.items():
        m = specs[name]
        res: dict[str, Any] = {"arrival": {}, "times": {}, "rotations": 0, "preemptions": 0}
        failed: dict[str, str] = {}
        reps = [inst for inst in instances if inst.spec.model == name]
        for inst in reps:
            r = inst.result()
            res["arrival"].update(r["arrival"])
            res["times"].update(r["times"])
            res["rotations"] += r["rotations"]
            res["preemptions"] += r["preemptions"]
            failed.update(inst.failed)
        summ = summarize(res, len(lens), lens, m.ttft_s, m.tpot_s)
        ttft_ok = tpot_ok = 0
        at_tpot = dict.fromkeys(extra_tpot_s, 0)
        for rid, ts in res["times"].items():
            if len(ts) < lens[rid]:
                continue
            tpot = (ts[-1] - ts[0]) / (len(ts) - 1) if len(ts) > 1 else 0.0
            ttft_ok += ts[0] - res["arrival"][rid] <= m.ttft_s
            tpot_ok += tpot <= m.tpot_s
            for x in extra_tpot_s:
                at_tpot[x] += ts[0] - res["arrival"][rid] <= m.ttft_s and tpot <= x
        n = len(lens)
        summ.update(ttft_attainment=ttft_ok / n, tpot_attainment=tpot_ok / n, failed=len(failed),
                    unfinished=n - summ["finished"], rate=m.rate, replicas=len(reps),
                    goodput_rps=m.rate * summ["attainment"],
                    remote_row_steps=sum(i.remote_row_steps for i in reps),
                    exchange_s=sum(i.exchange_s for i in reps), slowed_by_guests_s=sum(i.slowed_s for i in reps),
                    both_at_tpot={f"{1e3 * x:g}ms": v / n for x, v in at_tpot.items()})
        per_model[name] = summ
        total_ok += summ["both_met"]
        total += n
    horizon = max((inst.clock.t for inst in instances), default=0.0) or 1.0
    per_gpu = [{"gpu": g.index, "busy_fraction": g.busy_s / horizon,
                "models": [s.model for s in plan.slots if s.gpu == g.index],
                "hosts_guests_of": [sd.spec.name for sd in g.senders]} for g in gpus]
    return FleetResult(plan, per_model, per_gpu, total_ok / total if total else 0.0, total, iterations)


# --------------------------------------------------------------------------------------------- placement


def demand(m: ModelSpec, cost: CostModel, batch: int = 32) -> float:
    """GPU-seconds per second the model's traffic asks for, at a decode batch of `batch` rows: a first
    estimate for sizing (the replay decides)."""
    rows = clip_lengths(load_trace(m.trace, default_traces_dir(), m.trace_offset, 500), m.max_in, m.max_out)
    n_in = float(np.mean([r.input_len for r in rows]))
    n_out = float(np.mean([r.output_len for r in rows]))
    ctx = int(n_in + n_out / 2)
    per_req = cost.prefill_s([(int(n_in), int(n_in))]) + n_out * cost.decode_s(batch, batch * ctx) / batch
    return m.rate * per_req


def min_units(m: ModelSpec, geo: Geometry, gpu_mem_gib: float) -> int:
    """Quarter GPUs the model needs at least: its weights and a pool of four longest requests."""
    for u in range(1, MAX_PER_GPU + 1):
        try:
            if pool_tokens_for(geo, FULL * u / MAX_PER_GPU, gpu_mem_gib) >= 4 * m.context:
                return u
        except ValueError:
            continue
    raise ValueError(f"model {m.name} ({geo.name}) does not fit one GPU of {gpu_mem_gib:.0f} GiB with a pool of "
                     f"4 x {m.context} tokens (tensor parallelism is not simulated)")


def place(models: Sequence[ModelSpec], cal: Calibration, gpu_mem_gib: float, strategy: str, scale: float,
          weaver_ratio: float = 0.5, weaver_lend: float = 0.5, executor_sms: int | None = None) -> FleetPlan:
    """Capacity in quarter GPUs in proportion to each model's demand x `scale` (at least its minimum);
    a model with a whole GPU or more gets whole-GPU replicas, the others share GPUs (first fit,
    largest first, at most four per GPU). `weaver`/`both`: each whole-GPU replica, busiest model first,
    is paired with a GPU of shared (colder) models, which lends it `weaver_lend` of its KV room;
    `rotation`/`both`: every instance rotates (lvf) into its share of the host pool."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, not {strategy!r}")
    geos = {m.name: load_geometry(m.model, m.expert_distribution) for m in models}
    need = {m.name: demand(m, CostModel(cal, geos[m.name])) for m in models}
    slots: list[Slot] = []
    small: list[tuple[int, str]] = []
    for m in sorted(models, key=lambda m: -need[m.name]):
        u = max(min_units(m, geos[m.name], gpu_mem_gib), math.ceil(MAX_PER_GPU * scale * need[m.name] - 1e-9))
        if u >= MAX_PER_GPU:
            for _ in range(math.ceil(u / MAX_PER_GPU)):
                slots.append(Slot(m.name, len({s.gpu for s in slots}), FULL))
        else:
            small.append((u, m.name))
    whole = len({s.gpu for s in slots})
    bins: list[list[tuple[int, str]]] = []
    for u, name in sorted(small, key=lambda x: -x[0]):
        for b in bins:
            if sum(x for x, _ in b) + u <= MAX_PER_GPU and len(b) < MAX_PER_GPU:
                b.append((u, name))
                break
        else:
            bins.append([(u, name)])
    for k, b in enumerate(bins):
        for u, name in b:
            slots.append(Slot(name, whole + k, FULL * u / MAX_PER_GPU))
    plan = FleetPlan(whole + len(bins), slots, rotation=strategy in ("rotation", "both"), executor_sms=executor_sms)
    if strategy in ("weaver", "both"):
        cold = list(range(whole, whole + len(bins)))
        for i, s in enumerate(slots):
            if not cold or s.mem_fraction < FULL:
                continue
            g = cold.pop(0)
            room = sum(pool_tokens_for(geos[c.model], c.mem_fraction, gpu_mem_gib) * geos[c.model].kv_bytes_per_token
                       for c in slots if c.gpu == g) / GiB
            plan.pairings.append(Pairing(i, g, weaver_ratio, round(weaver_lend * room, 1)))
    return plan


def fewest_gpus(models: Sequence[ModelSpec], cal: Calibration, gpu_mem_gib: float, strategy: str, seconds: float,
                target: float = 0.9, scales: Sequence[float] = (0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0),
                seed: int = 0, log: Any = None, per_model: bool = False, **kw: Any) -> dict[str, Any]:
    """Plans at growing scales (one per GPU count, fewest first), replayed until the fleet keeps
    `target` of all requests within both SLOs (`per_model`: of every model's requests). Returns the first
    passing plan and every one tried."""
    reqs = {m.name: make_requests(m, seconds, seed) for m in models}
    tried: list[dict[str, Any]] = []
    seen: set[int] = set()
    for scale in scales:
        plan = place(models, cal, gpu_mem_gib, strategy, scale, **kw)
        if plan.gpus in seen:
            continue
        seen.add(plan.gpus)
        res = run_fleet(plan, models, cal, gpu_mem_gib, seconds, seed, requests=reqs)
        tried.append({"scale": scale, **res.as_dict()})
        if log:
            log(f"  {strategy:9s} scale {scale:4.2f}: {plan.gpus} GPUs, both SLOs {100 * res.attainment:5.1f} %")
        if res.attainment >= target and (not per_model or all(v["attainment"] >= target
                                                               for v in res.per_model.values())):
            return {"strategy": strategy, "gpus": plan.gpus, "passed": True, "result": tried[-1], "tried": tried}
    return {"strategy": strategy, "gpus": None, "passed": False, "result": tried[-1] if tried else None,
            "tried": tried}


def load_gpu(gpu: str) -> tuple[Calibration, float]:
    path, mem = gpu_calibration(gpu)
    return Calibration.load(path), mem
