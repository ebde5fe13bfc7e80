"""Goodput from a rate sweep: SLO attainment against request rate, per run (policy or setting).

Reads the `bench/serving.py` reports a sweep wrote (`bench/goodput_sweep.sh` names them
`gp_<label>_r<rate>.json`), prints attainment of both SLOs per rate, and each run's goodput: the highest
rate of the sweep at which at least `--target` (0.9) of the requests met both SLOs. Requests the client
never sent or that failed count as misses, so a run cut short cannot look better than it was.

  python bench/goodput.py RESULTS_DIR [--target 0.9] [--plot goodput.png] [--out goodput.json]
  python bench/goodput.py "1/4 share=DIR1" "1/2 share=DIR2" ... --plot grid.png   (one panel per setting)
  python bench/goodput.py DIR --model hot     (one model of multi-model runs: bench/weaver_e2e.sh RATES=...)
  python bench/goodput.py DIR --ttft-slo 2 --tpot-slo 0.1   (the same runs scored against other SLOs)

With several folders (each optionally TITLE=DIR), each is one setting: a table each, and the plot has
one panel per setting; `--out` then maps each title to its runs. A setting swept over several calls is
DIR1+DIR2 (their reports together; the same run at the same rate twice is an error).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repository's bench package

from bench.metrics import SloConfig, meets

NAME = re.compile(r"^gp_(?P<label>.+)_r(?P<rate>[0-9.]+)\.json$")


@dataclass(frozen=True)
class Point:
    """One run at one rate."""

    label: str
    rate: float
    scheduled: int
    both_met: int
    throughput_rps: float
    ttft_p99_ms: float | None
    tpot_p99_ms: float | None

    @property
    def attainment(self) -> float:
        return self.both_met / self.scheduled if self.scheduled else 0.0


def point_from_report(label: str, rate: float, report: dict[str, Any], model: str | None = None,
                      slo: SloConfig | None = None) -> Point:
    """`model`: that model's requests alone (a multi-model run's `per_model` section); the requests the
    client never sent count as misses of every model, not knowing whose they were. `slo`: score the
    report's per-request `slo_records` against these SLOs instead of the ones the run used."""
    if slo is not None:
        return _rescored(label, rate, report, model, slo)
    if model is None:
        m = report["metrics"]
        sent = int(m["sent"])
        scheduled = int(report["workload"].get("scheduled", sent))
    else:
        per_model = report.get("per_model") or {}
        if model not in per_model:
            raise KeyError(model)
        m = per_model[model]
        sent = int(m["sent"])
        scheduled = sent + int(report["workload"].get("not_sent", 0))
    both = m["slo"]["both_attainment"]
    if both is None:
        raise ValueError(f"{label} at {rate}: the run set no SLO (pass --ttft-slo/--tbt-slo to serving.py)")
    return Point(
        label=label,
        rate=rate,
        scheduled=scheduled,
        both_met=round(float(both) * sent),
        throughput_rps=float(m["request_throughput_rps"] or 0.0),
        ttft_p99_ms=m["ttft_ms"].get("p99"),
        tpot_p99_ms=m["tpot_ms"].get("p99"),
    )


def _rescored(label: str, rate: float, report: dict[str, Any], model: str | None, slo: SloConfig) -> Point:
    records = report.get("slo_records")
    if records is None:
        raise ValueError(f"{label} at {rate}: the report has no slo_records (written by serving.py since "
                         "2026-12-02) to score against other SLOs")
    mine = [r for r in records if model is None or r[0] == model]
    if model is not None and not mine:
        raise KeyError(model)
    work = report["workload"]
    sent = len(mine)
    scheduled = sent + int(work.get("not_sent", 0)) if model is not None else int(work.get("scheduled", sent))
    m = report["per_model"][model] if model is not None else report["metrics"]
    return Point(label=label, rate=rate, scheduled=scheduled, both_met=sum(meets(r, slo) for r in mine),
                 throughput_rps=float(m["request_throughput_rps"] or 0.0), ttft_p99_ms=m["ttft_ms"].get("p99"),
                 tpot_p99_ms=m["tpot_ms"].get("p99"))


def load(results_dir: Path, model: str | None = None, slo: SloConfig | None = None) -> dict[str, list[Point]]:
    """Every sweep report in the folder, grouped by run label, sorted by rate (of `model` alone if given,
    scored against `slo` if given)."""
    runs: dict[str, list[Point]] = {}
    for path in sorted(results_dir.glob("gp_*.json")):
        match = NAME.match(path.name)
        if match is None:
            continue
        label, rate = match["label"], float(match["rate"])
        try:
            runs.setdefault(label, []).append(point_from_report(label, rate, json.loads(path.read_text()), model, slo))
        except KeyError:  # the model had no request at this point (a small share of a short one)
            continue
    if model is not None and not any(runs.values()):
        raise ValueError(f"no report in {results_dir} has requests of model {model!r}")
    runs = {label: pts for label, pts in runs.items() if pts}
    for points in runs.values():
        points.sort(key=lambda p: p.rate)
    return runs


def goodput(points: Sequence[Point], target: float) -> float:
    """The highest swept rate whose attainment is at least `target`; 0.0 if none is."""
    return max((p.rate for p in points if p.attainment >= target), default=0.0)


def table(runs: dict[str, list[Point]], target: float) -> str:
    rates = sorted({p.rate for pts in runs.values() for p in pts})
    head = f"{'run':<28}" + "".join(f"{r:>9g}" for r in rates) + f"{'goodput':>10}"
    lines = [f"both-SLO attainment by request rate (req/s); goodput = highest rate with >= {target:.0%}", head]
    for label, pts in runs.items():
        by_rate = {p.rate: p for p in pts}
        cells = "".join(f"{by_rate[r].attainment:>9.1%}" if r in by_rate else f"{'-':>9}" for r in rates)
        lines.append(f"{label:<28}{cells}{goodput(pts, target):>10g}")
    return "\n".join(lines)


def plot(panels: dict[str, dict[str, list[Point]]], target: float, path: Path) -> None:
    """One panel per setting (title -> its runs), attainment against rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 if cols == 1 else 4.5 * cols, 4 * rows), squeeze=False)
    for ax, (title, runs) in zip(axes.flat, panels.items(), strict=False):
        _panel(ax, runs, target)
        if title:
            ax.set_title(title, fontsize=9)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _panel(ax: Any, runs: dict[str, list[Point]], target: float) -> None:
    for label, pts in runs.items():
        ax.plot([p.rate for p in pts], [100 * p.attainment for p in pts], marker="o", label=label)
    ax.axhline(100 * target, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("requests meeting both SLOs (%)")
    ax.set_ylim(0, 102)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _doc(runs: dict[str, list[Point]], target: float) -> dict[str, Any]:
    return {label: {"goodput_rps": goodput(pts, target),
                    "points": [{**asdict(pt), "attainment": pt.attainment} for pt in pts]}
            for label, pts in runs.items()}


def _merged(parts: list[dict[str, list[Point]]]) -> dict[str, list[Point]]:
    """One setting's runs from several folders (calls), each run's points by rate."""
    runs: dict[str, list[Point]] = {}
    for part in parts:
        for label, points in part.items():
            have = {p.rate for p in runs.get(label, [])}
            if twice := sorted(have & {p.rate for p in points}):
                raise ValueError(f"{label} at {twice[0]:g} req/s is in two of the folders")
            runs.setdefault(label, []).extend(points)
    for points in runs.values():
        points.sort(key=lambda p: p.rate)
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results_dir", nargs="+", help="a sweep's folder, or several as TITLE=DIR (one setting each)")
    p.add_argument("--target", type=float, default=0.9, help="attainment that counts as meeting the SLOs")
    p.add_argument("--plot", type=Path, default=None, help="PNG of attainment against rate")
    p.add_argument("--out", type=Path, default=None, help="JSON with every point and each run's goodput")
    p.add_argument("--model", default=None,
                   help="one model's requests of multi-model runs (weaver_e2e.sh's hot or cold), not all of them")
    p.add_argument("--ttft-slo", type=float, default=None, metavar="S",
                   help="score against this TTFT SLO (and --tpot-slo) instead of the run's own, from the reports' "
                        "per-request slo_records")
    p.add_argument("--tpot-slo", type=float, default=None, metavar="S", help="see --ttft-slo")
    p.add_argument("--tbt-stat", default="mean", choices=["mean", "p99", "max"],
                   help="what --tpot-slo bounds per request: its TPOT (mean gap, the default), P99 or max gap")
    args = p.parse_args(argv)
    slo = (SloConfig(args.ttft_slo, args.tpot_slo, args.tbt_stat)
           if args.ttft_slo is not None or args.tpot_slo is not None else None)
    panels: dict[str, dict[str, list[Point]]] = {}
    for spec in args.results_dir:
        title, sep, folder = spec.rpartition("=")
        try:
            runs = _merged([load(Path(f), args.model, slo) for f in folder.split("+")])
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if not runs:
            print(f"error: no gp_<label>_r<rate>.json reports in {folder}", file=sys.stderr)
            return 2
        panels[title if sep else ("" if len(args.results_dir) == 1 else folder)] = runs
    for title, runs in panels.items():
        print(f"== {title}\n{table(runs, args.target)}" if title else table(runs, args.target))
    if args.plot:
        plot(panels, args.target, args.plot)
    if args.out:
        if len(panels) == 1:
            doc: dict[str, Any] = {"target": args.target, "runs": _doc(next(iter(panels.values())), args.target)}
        else:
            doc = {"target": args.target, "settings": {t: _doc(r, args.target) for t, r in panels.items()}}
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
