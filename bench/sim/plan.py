"""Plan a fleet on a simulated GPU: which models share which GPUs, which WEAVER pairings, and the
attainment each model is expected to get. Every figure is SIMULATED (see docs/simulator.md).

    python -m bench.sim.plan --models bench/sim/examples/models.yaml --gpu h200 \
        --traffic servegen --total-rate 16 --strategy all --seconds 30 --out plan.json

The model list (YAML) gives per model: `name`, `model` (a preset of sglang_ext/configs or a
config.json path), `ttft_s`, `tpot_s` (mean TPOT), traffic (`rate` req/s; or `share` of --total-rate;
or, with --traffic servegen, `servegen`: the ServeGen model whose day-1 share of --total-rate it gets),
and request lengths (`trace`: azure-conv | azure-code | mooncake; `max_in`, `max_out`; `arrival`:
poisson | burst). --traffic FILE: a CSV with columns `name,rate` that sets the rates.

For each strategy it replays the traffic on plans of growing size (capacity in proportion to each
model's demand) and prints the smallest plan whose requests meet both SLOs at --target (default 90 %),
with each model's attainment. The GPU type must have a calibration file (bench/sim/calibration).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

from bench.sim.fleet import STRATEGIES, ModelSpec, error_band, fewest_gpus, load_gpu, servegen_rates
from bench.sim.instance import known_gpus

KEYS = {"name", "model", "rate", "share", "servegen", "ttft_s", "tpot_s", "trace", "max_in", "max_out", "arrival",
        "trace_offset", "expert_distribution"}


def read_models(path: Path, traffic: str, total_rate: float | None) -> list[ModelSpec]:
    """The YAML model list with each model's rate resolved from --traffic / --total-rate."""
    doc = yaml.safe_load(path.read_text())
    items = doc.get("models") if isinstance(doc, dict) else doc
    if not isinstance(items, list) or not items:
        raise ValueError(f"{path}: expected a list under `models:`")
    for i, it in enumerate(items):
        if not isinstance(it, dict) or "name" not in it or "model" not in it:
            raise ValueError(f"{path}: models[{i}] needs `name` and `model`")
        bad = set(it) - KEYS
        if bad:
            raise ValueError(f"{path}: models[{i}] ({it['name']}): unknown field(s) {sorted(bad)}; "
                             f"known: {sorted(KEYS)}")
    rates: dict[str, float] = {}
    if traffic == "servegen":
        if total_rate is None:
            raise ValueError("--traffic servegen needs --total-rate (req/s for the whole fleet)")
        named = [it for it in items if "servegen" in it]
        sg = servegen_rates([it["servegen"] for it in named], total_rate)
        rates = {it["name"]: sg[it["servegen"]] for it in named}
    elif traffic != "yaml":
        with Path(traffic).open(newline="") as f:
            for row in csv.DictReader(f):
                if "name" not in row or "rate" not in row:
                    raise ValueError(f"--traffic {traffic}: needs columns name,rate")
                rates[row["name"]] = float(row["rate"])
    out = []
    for it in items:
        name = it["name"]
        if name in rates:
            rate = rates[name]
        elif "rate" in it:
            rate = float(it["rate"])
        elif "share" in it and total_rate is not None:
            rate = float(it["share"]) * total_rate
        else:
            raise ValueError(f"model {name}: no traffic (give `rate`, `share` with --total-rate, `servegen` with "
                             "--traffic servegen, or a row in the --traffic file)")
        kw = {k: it[k] for k in KEYS - {"name", "model", "rate", "share", "servegen"} if k in it}
        if kw.get("expert_distribution"):  # a path in the model list is relative to the list's folder
            kw["expert_distribution"] = str(path.parent / str(kw["expert_distribution"]))
        out.append(ModelSpec(name=name, model=str(it["model"]), rate=rate, **kw))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sim.plan", description=__doc__.split("\n\n")[0],
                                epilog="Example: python -m bench.sim.plan --models bench/sim/examples/models.yaml "
                                       "--gpu h200 --traffic servegen --total-rate 16")
    p.add_argument("--models", type=Path, required=True, help="YAML model list (see bench/sim/examples/models.yaml)")
    p.add_argument("--gpu", default="h200", help=f"GPU type with a calibration file (known: {', '.join(known_gpus())})")
    p.add_argument("--traffic", default="yaml",
                   help="yaml: rates from the model list; servegen: ServeGen day-1 shares of --total-rate; "
                        "or a CSV file with columns name,rate")
    p.add_argument("--total-rate", type=float, help="req/s of the whole fleet (for servegen and share)")
    p.add_argument("--strategy", default="all", choices=[*STRATEGIES, "all"])
    p.add_argument("--target", type=float, default=0.9, help="share of requests to keep within both SLOs")
    p.add_argument("--per-model", action=argparse.BooleanOptionalAction, default=True,
                   help="every model must meet --target (the default: what a platform owes each model); "
                        "--no-per-model: the fleet's requests as a whole")
    p.add_argument("--seconds", type=float, default=30.0, help="traffic replayed (requests = rate x seconds)")
    p.add_argument("--scales", type=float, nargs="+", default=[0.25, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0],
                   help="capacity over demand tried, smallest first")
    p.add_argument("--weaver-ratio", type=float, default=0.5,
                   help="WEAVER: share of a hot replica's decoding requests offloaded")
    p.add_argument("--weaver-lend", type=float, default=0.5, help="WEAVER: share of the cold GPU's KV room lent")
    p.add_argument("--executor-sms", type=int, help="WEAVER: executor capped at this many SMs (measured: 8/16/24/32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write the full result (JSON)")
    a = p.parse_args(argv)
    try:
        cal, mem = load_gpu(a.gpu)
        models = read_models(a.models, a.traffic, a.total_rate)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    print(f"SIMULATED on {cal.gpu} ({mem:.0f} GiB), {a.seconds:g} s of traffic, "
          f"target {100 * a.target:g} % within both SLOs")
    for m in models:
        print(f"  {m.name:14s} {m.model:16s} {m.rate:7.3f} req/s  TTFT {m.ttft_s:g} s  "
              f"TPOT {1e3 * m.tpot_s:g} ms  {m.trace}")
    out: dict[str, Any] = {"label": "SIMULATED", "error_band": error_band(cal), "gpu": a.gpu, "calibration": cal.gpu,
                           "args": {k: str(v) for k, v in vars(a).items()}, "strategies": {}}
    for strat in STRATEGIES if a.strategy == "all" else (a.strategy,):
        r = fewest_gpus(models, cal, mem, strat, a.seconds, a.target, a.scales, a.seed, log=print,
                        per_model=a.per_model, weaver_ratio=a.weaver_ratio, weaver_lend=a.weaver_lend,
                        executor_sms=a.executor_sms)
        out["strategies"][strat] = r
        best = r["result"]
        head = f"{r['gpus']} GPUs" if r["passed"] else f"not met with up to {best['gpus_used']} GPUs (largest tried)"
        print(f"{strat}: {head}")
        for g, names in enumerate(best["plan"]["per_gpu"]):
            print(f"  gpu{g}: {', '.join(names)}")
        for pair in best["plan"]["pairings"]:
            print(f"  WEAVER pairing: {pair}")
        if strat in ("weaver", "both") and not best["plan"]["pairings"]:
            print("  no WEAVER pairing: pairings are made for models with whole GPUs, and none has one here")
        for name, s in best["per_model"].items():
            print(f"  {name:14s} both SLOs {100 * s['attainment']:5.1f} %  TTFT {100 * s['ttft_attainment']:5.1f} %  "
                  f"TPOT {100 * s['tpot_attainment']:5.1f} %  (TTFT p99 {s['ttft_p99_s']:.2f} s, "
                  f"TPOT mean {s['tpot_mean_ms']:.0f} ms; {s['scheduled']} requests, {s['failed']} failed)")
    print(error_band(cal))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
