"""Goodput from a rate sweep: SLO attainment against request rate, per run (policy or setting).

Reads the `bench/serving.py` reports a sweep wrote (`gp_<label>_r<rate>_k<repeat>.json`, written by
`bench/goodput_knee.py`; `gp_<label>_r<rate>.json`, `bench/goodput_sweep.sh`'s, read as repeat 0), prints
attainment of both SLOs per rate (the mean over repeats, with min-max), and each run's goodput.

Goodput is strict: the highest swept rate R such that every swept rate <= R met the target (at least
`--target`, 0.9, of the scheduled requests met both SLOs). A failing rate below a passing one caps it
there; when even the top swept rate passes, the goodput is only a lower bound (">= 7"), and when the
lowest fails it is "< lowest". With repeats, goodput comes from the mean curve (mean attainment over
repeats at each rate), each repeat's own goodput is printed beside it, and so is how many repeats agree
with the mean curve's. Ratios between runs (each against `--baseline`, default the first fcfs run) come
from the mean-curve goodputs. Requests the client never sent or that failed count as misses, so a run cut
short cannot look better than it was. Burst runs print the realized peak arrival rate (serving.py's
`realized_peak_rps`, the most sends in any 5 s) beside the nominal mean rate.

Provenance: per panel, the commits (and whether the tree was dirty) and driver call ids of the reports it
merges; a panel whose reports come from more than one commit or call, from a dirty tree, or from an
unknown commit is flagged with "!!!" lines (stdout and stderr), and so is a run whose folders' knee.json
(bench/goodput_knee.py's "servers") record other launcher flags for it (e.g. another --kv-host-size-gb:
"RUN SETTINGS DIFFER"; the port and the step log are not settings).

  python bench/goodput.py RESULTS_DIR [--target 0.9] [--plot goodput.png] [--out goodput.json]
  python bench/goodput.py "1/4 share=DIR1" "1/2 share=DIR2" ... --plot grid.png   (one panel per setting)
  python bench/goodput.py DIR --model hot     (one model of multi-model runs: bench/weaver_e2e.sh RATES=...)
  python bench/goodput.py DIR --ttft-slo 2 --tpot-slo 0.1   (the same runs scored against other SLOs)

With several folders (each optionally TITLE=DIR), each is one setting: a table each, and the plot has
one panel per setting; `--out` then maps each title to its runs. A setting swept over several calls is
DIR1+DIR2 (their reports together; the same run at the same rate and repeat twice is an error).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repository's bench package

from bench.metrics import SloConfig, meets

NAME = re.compile(r"^gp_(?P<label>.+)_r(?P<rate>[0-9.]+)(?:_k(?P<repeat>[0-9]+))?\.json$")
UNKNOWN = "unknown"


@dataclass(frozen=True)
class Point:
    """One run at one rate, one repeat."""

    label: str
    rate: float
    scheduled: int
    both_met: int
    throughput_rps: float
    ttft_p99_ms: float | None
    tpot_p99_ms: float | None
    repeat: int = 0
    git_commit: str = UNKNOWN
    git_dirty: bool | None = None
    call_id: str = UNKNOWN
    arrival: str | None = None
    realized_rate_rps: float | None = None
    realized_peak_rps: float | None = None
    # the run's launcher flags as its folder's knee.json records them (bench/goodput_knee.py), less the
    # port and the step log: what a panel merging folders must find equal for one run label
    server: tuple[str, ...] | None = None

    @property
    def attainment(self) -> float:
        return self.both_met / self.scheduled if self.scheduled else 0.0


@dataclass(frozen=True)
class RatePoint:
    """One run at one rate: attainment over its repeats."""

    rate: float
    mean: float
    low: float
    high: float
    repeats: int
    realized_peak_rps: float | None = None  # the mean over repeats, where the reports have it


@dataclass(frozen=True)
class Goodput:
    """Strict goodput of one curve. `rate` 0.0 with `below_lowest`: even the lowest swept rate failed."""

    rate: float
    lower_bound: bool = False  # the top swept rate passed: the knee is at or above `rate`
    below_lowest: float | None = None  # the lowest swept rate, when it failed

    def text(self) -> str:
        if self.below_lowest is not None:
            return f"< {self.below_lowest:g}"
        return f">= {self.rate:g}" if self.lower_bound else f"{self.rate:g}"


def _provenance_fields(report: dict[str, Any]) -> dict[str, Any]:
    work = report.get("workload") or {}
    return {"git_commit": report.get("git_commit") or UNKNOWN, "git_dirty": report.get("git_dirty"),
            "call_id": report.get("call_id") or UNKNOWN, "arrival": work.get("arrival"),
            "realized_rate_rps": work.get("realized_rate_rps"), "realized_peak_rps": work.get("realized_peak_rps")}


def point_from_report(label: str, rate: float, report: dict[str, Any], model: str | None = None,
                      slo: SloConfig | None = None, repeat: int = 0) -> Point:
    """`model`: that model's requests alone (a multi-model run's `per_model` section); the requests the
    client never sent count as misses of every model, not knowing whose they were. `slo`: score the
    report's per-request `slo_records` against these SLOs instead of the ones the run used."""
    if slo is not None:
        return _rescored(label, rate, report, model, slo, repeat)
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
        repeat=repeat,
        **_provenance_fields(report),
    )


def _rescored(label: str, rate: float, report: dict[str, Any], model: str | None, slo: SloConfig,
              repeat: int) -> Point:
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
                 tpot_p99_ms=m["tpot_ms"].get("p99"), repeat=repeat, **_provenance_fields(report))


def reports(folder: Path) -> Iterator[tuple[str, float, int, dict[str, Any]]]:
    """(run label, rate, repeat, report) of every sweep report in the folder (`NAME`), in file-name order."""
    for path in sorted(folder.glob("gp_*.json")):
        match = NAME.match(path.name)
        if match is not None:
            yield match["label"], float(match["rate"]), int(match["repeat"] or 0), json.loads(path.read_text())


# launcher flags that say where a run was measured, not what it ran: two calls of one setting may differ here
_NOT_SETTINGS = frozenset({"--port", "--step-log-interval-s"})


def server_flags(results_dir: Path) -> dict[str, tuple[str, ...]]:
    """Each run's launcher flags from the folder's knee.json ("servers"), without `_NOT_SETTINGS`; {} for a
    folder without one (bench/goodput_sweep.sh's)."""
    knee = results_dir / "knee.json"
    if not knee.is_file():
        return {}
    try:
        servers = json.loads(knee.read_text()).get("servers") or {}
        if not isinstance(servers, dict) or not all(isinstance(v, list) for v in servers.values()):
            raise ValueError('"servers" is not {run: [flags]}')
    except ValueError as e:  # provenance only: the reports still count, their flags are not compared
        print(f"note: {knee} unreadable ({e}): its runs' launcher flags are not compared", file=sys.stderr)
        return {}
    flags: dict[str, tuple[str, ...]] = {}
    for label, argv in servers.items():
        kept, skip = [], False
        for tok in argv:
            if skip:
                skip = False
            elif tok in _NOT_SETTINGS:
                skip = True  # and its value
            elif tok.split("=", 1)[0] not in _NOT_SETTINGS:
                kept.append(tok)
        flags[label] = tuple(kept)
    return flags


def _flag_values(argv: Sequence[str]) -> dict[str, str]:
    """--flag value / --flag=value / a bare --flag, as flag -> value ("" for a bare one). Not
    ServerArgs.flags_to_kwargs: that parser exits on a flag the launcher no longer has, and an old
    folder's flags must still read."""
    out: dict[str, str] = {}
    for i, tok in enumerate(argv):
        if tok.startswith("--"):
            name, eq, value = tok.partition("=")
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            out[name] = value if eq else (nxt if nxt is not None and not nxt.startswith("--") else "")
    return out


def load(results_dir: Path, model: str | None = None, slo: SloConfig | None = None) -> dict[str, list[Point]]:
    """Every sweep report in the folder, grouped by run label, sorted by rate then repeat (of `model` alone
    if given, scored against `slo` if given), each with its run's launcher flags where knee.json has them."""
    runs: dict[str, list[Point]] = {}
    flags = server_flags(results_dir)
    for label, rate, repeat, report in reports(results_dir):
        try:
            point = point_from_report(label, rate, report, model, slo, repeat)
        except KeyError:  # the model had no request at this point (a small share of a short one)
            continue
        if label in flags:
            point = replace(point, server=flags[label])
        runs.setdefault(label, []).append(point)
    if model is not None and not any(runs.values()):
        raise ValueError(f"no report in {results_dir} has requests of model {model!r}")
    runs = {label: pts for label, pts in runs.items() if pts}
    for points in runs.values():
        points.sort(key=lambda p: (p.rate, p.repeat))
    return runs


# ------------------------------------------------------------------------------------------ goodput


ROUNDING = 1e-9  # a mean of repeats equal to the target in exact arithmetic may land a hair under it in floats


def at_target(attainment: float, target: float) -> bool:
    """attainment >= target, with a mean that is exactly the target (405 of 450 requests at 0.9) passing
    whatever order its repeats were summed in."""
    return attainment >= target - ROUNDING


def strict_goodput(curve: Sequence[tuple[float, float]], target: float) -> Goodput:
    """(rate, attainment) pairs -> the highest rate R such that every rate <= R has attainment >= target."""
    ordered = sorted(curve)
    if not ordered:
        return Goodput(0.0)
    best: float | None = None
    for rate, attainment in ordered:
        if not at_target(attainment, target):
            break
        best = rate
    if best is None:
        return Goodput(0.0, below_lowest=ordered[0][0])
    return Goodput(best, lower_bound=best == ordered[-1][0])


def mean_curve(points: Sequence[Point]) -> list[RatePoint]:
    """Per rate: mean attainment over the repeats, and their min and max."""
    by_rate: dict[float, list[Point]] = {}
    for p in points:
        by_rate.setdefault(p.rate, []).append(p)
    out = []
    for rate in sorted(by_rate):
        att = [p.attainment for p in by_rate[rate]]
        peaks = [p.realized_peak_rps for p in by_rate[rate] if p.realized_peak_rps is not None]
        out.append(RatePoint(rate, sum(att) / len(att), min(att), max(att), len(att),
                             sum(peaks) / len(peaks) if peaks else None))
    return out


def goodput_of(points: Sequence[Point], target: float) -> Goodput:
    """Strict goodput of the mean curve over repeats."""
    return strict_goodput([(c.rate, c.mean) for c in mean_curve(points)], target)


def goodput(points: Sequence[Point], target: float) -> float:
    """The strict goodput rate of the mean curve (0.0 when even the lowest swept rate failed)."""
    return goodput_of(points, target).rate


def per_repeat(points: Sequence[Point], target: float) -> dict[int, Goodput]:
    """Each repeat's own strict goodput, over the rates that repeat ran."""
    repeats = sorted({p.repeat for p in points})
    return {k: strict_goodput([(p.rate, p.attainment) for p in points if p.repeat == k], target) for k in repeats}


def agreement(points: Sequence[Point], target: float) -> tuple[int, int]:
    """(repeats whose own goodput equals the mean curve's, repeats)."""
    mean = goodput_of(points, target)
    each = per_repeat(points, target)
    return sum(g == mean for g in each.values()), len(each)


def ratio_text(num: Goodput, den: Goodput) -> tuple[float | None, str]:
    """num / den of two mean-curve goodputs, saying when a bound makes it one-sided or unknown."""
    if num.below_lowest is not None and den.below_lowest is not None:
        return None, "n/a (both below the lowest swept rate)"
    if den.below_lowest is not None:  # the baseline failed every swept rate: one-sided, from its lowest
        r = num.rate / den.below_lowest
        return r, f"> {r:.2f}x (baseline < {den.below_lowest:g})"
    if num.below_lowest is not None:
        if den.rate <= 0:
            return None, "n/a (below the lowest swept rate)"
        upper = num.below_lowest / den.rate
        return upper, f"< {upper:.2f}x ({num.text()})"
    if den.rate <= 0:
        return None, "n/a (below the lowest swept rate)"
    r = num.rate / den.rate
    if num.lower_bound and den.lower_bound:
        return r, f"n/a (both lower bounds; {r:.2f}x at the top rates)"
    if num.lower_bound:
        return r, f">= {r:.2f}x"
    if den.lower_bound:
        return r, f"<= {r:.2f}x"
    return r, f"{r:.2f}x"


def pick_baseline(labels: Sequence[str], baseline: str | None) -> str | None:
    if baseline is not None:
        return baseline if baseline in labels else None
    # a knee run variant (POLICY-MODE.VARIANT, e.g. fcfs-recompute.fixed) is compared with its plain run
    plain = [lb for lb in labels if "." not in lb] or list(labels)
    return next((lb for lb in plain if lb.startswith("fcfs")), plain[0] if plain else None)


def ratios(runs: dict[str, list[Point]], target: float, baseline: str | None = None) -> dict[str, dict[str, Any]]:
    base = pick_baseline(list(runs), baseline)
    if base is None or len(runs) < 2:
        return {}
    den = goodput_of(runs[base], target)
    out = {}
    for label, pts in runs.items():
        if label != base:
            value, text = ratio_text(goodput_of(pts, target), den)
            out[label] = {"vs": base, "ratio": value, "text": text}
    return out


# ------------------------------------------------------------------------------------------ provenance


def provenance(runs: dict[str, list[Point]]) -> dict[str, Any]:
    """The commits and calls a panel's reports come from, and the warnings a reader must see."""
    points = [p for pts in runs.values() for p in pts]
    commits = Counter(p.git_commit for p in points)
    calls = Counter(p.call_id for p in points)
    dirty = sum(p.git_dirty is True for p in points)
    dirty_unknown = sum(p.git_dirty is None for p in points)
    warnings = []
    if len(commits) > 1:
        warnings.append("PANEL MIXES COMMITS: " + ", ".join(f"{c[:12]} ({n} reports)" for c, n in commits.items()))
    if len(calls) > 1:
        warnings.append("PANEL MERGES CALLS: " + ", ".join(f"{c} ({n} reports)" for c, n in calls.items()))
    if dirty:
        warnings.append(f"DIRTY TREE: {dirty} of {len(points)} reports ran from a tree with uncommitted changes")
    if commits.get(UNKNOWN):
        warnings.append(f"COMMIT UNKNOWN for {commits[UNKNOWN]} of {len(points)} reports")
    if dirty_unknown:
        warnings.append(f"DIRTY STATE UNKNOWN for {dirty_unknown} of {len(points)} reports (no git_dirty)")
    if calls.get(UNKNOWN):
        warnings.append(f"CALL UNKNOWN for {calls[UNKNOWN]} of {len(points)} reports (no call_id)")
    for label, pts in runs.items():  # one run label, merged from folders whose servers ran other flags
        servers = Counter(p.server for p in pts if p.server is not None)
        if len(servers) > 1:
            values = [(_flag_values(argv), n) for argv, n in servers.items()]
            differ = sorted(f for f in {f for v, _ in values for f in v} if len({v.get(f) for v, _ in values}) > 1)
            warnings.append(f"RUN SETTINGS DIFFER for {label}: " + "; ".join(
                f"{f} " + " / ".join(f"{v.get(f, '(absent)') or '(set)'} ({n} reports)" for v, n in values)
                for f in differ))
    return {"commits": dict(commits), "calls": dict(calls), "dirty_reports": dirty,
            "dirty_unknown_reports": dirty_unknown, "warnings": warnings}


# ------------------------------------------------------------------------------------------ output


def _cell(c: RatePoint) -> str:
    if c.repeats == 1:
        return f"{c.mean:.1%}"
    return f"{c.mean:.1%} [{100 * c.low:.0f}-{100 * c.high:.0f}]"


def table(runs: dict[str, list[Point]], target: float, baseline: str | None = None) -> str:
    rates = sorted({p.rate for pts in runs.values() for p in pts})
    width = 17 if any(len({p.repeat for p in pts}) > 1 for pts in runs.values()) else 9
    head = f"{'run':<28}" + "".join(f"{r:>{width}g}" for r in rates) + f"{'goodput':>10}  per repeat (agree)"
    lines = [f"both-SLO attainment by request rate (req/s), mean over repeats [min-max]; goodput = highest rate "
             f"with every swept rate up to it >= {target:.0%} (strict, mean curve)", head]
    for label, pts in runs.items():
        curve = {c.rate: c for c in mean_curve(pts)}
        cells = "".join(f"{_cell(curve[r]):>{width}}" if r in curve else f"{'-':>{width}}" for r in rates)
        each = per_repeat(pts, target)
        agree, total = agreement(pts, target)
        reps = ", ".join(g.text() for g in each.values())
        lines.append(f"{label:<28}{cells}{goodput_of(pts, target).text():>10}  {reps} ({agree}/{total})")
        if any(p.arrival == "burst" for p in pts):
            peaks = "".join(f"{curve[r].realized_peak_rps:>{width}.1f}" if r in curve and
                            curve[r].realized_peak_rps is not None else f"{'-':>{width}}" for r in rates)
            lines.append(f"{'  realized peak (req/s)':<28}{peaks}")
    for label, r in ratios(runs, target, baseline).items():
        lines.append(f"goodput ratio {label} / {r['vs']}: {r['text']}")
    prov = provenance(runs)
    commits = ", ".join(f"{c[:12]} x{n}" for c, n in prov["commits"].items())
    lines.append(f"commits: {commits}; dirty: {prov['dirty_reports']} reports"
                 + (f" ({prov['dirty_unknown_reports']} unknown)" if prov["dirty_unknown_reports"] else ""))
    lines.append("calls: " + ", ".join(f"{c} x{n}" for c, n in prov["calls"].items()))
    lines.extend(f"!!! {w}" for w in prov["warnings"])
    return "\n".join(lines)


def plot(panels: dict[str, dict[str, list[Point]]], target: float, path: Path) -> None:
    """One panel per setting (title -> its runs), mean attainment against rate with min-max bars."""
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
        curve = mean_curve(pts)
        mean = [100 * c.mean for c in curve]
        err = [[max(0.0, m - 100 * c.low) for m, c in zip(mean, curve, strict=True)],  # the mean of equal
               [max(0.0, 100 * c.high - m) for m, c in zip(mean, curve, strict=True)]]  # repeats can be 1 ulp off
        ax.errorbar([c.rate for c in curve], mean, yerr=err, marker="o", capsize=3,
                    label=f"{label} ({goodput_of(pts, target).text()})")
    ax.axhline(100 * target, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("requests meeting both SLOs (%)")
    ax.set_ylim(0, 102)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _run_doc(pts: list[Point], target: float) -> dict[str, Any]:
    g = goodput_of(pts, target)
    agree, total = agreement(pts, target)
    return {"goodput_rps": g.rate, "goodput_lower_bound": g.lower_bound,
            "goodput_below_lowest_rate": g.below_lowest is not None, "goodput_text": g.text(),
            "repeats": total, "repeats_agree": agree,
            "goodput_per_repeat": {str(k): {"goodput_rps": v.rate, "lower_bound": v.lower_bound, "text": v.text()}
                                   for k, v in per_repeat(pts, target).items()},
            "curve": [asdict(c) for c in mean_curve(pts)],
            "points": [{**asdict(pt), "attainment": pt.attainment} for pt in pts]}


def _doc(runs: dict[str, list[Point]], target: float) -> dict[str, Any]:
    return {label: _run_doc(pts, target) for label, pts in runs.items()}


def _panel_doc(runs: dict[str, list[Point]], target: float, baseline: str | None) -> dict[str, Any]:
    return {"ratios": ratios(runs, target, baseline), "provenance": provenance(runs)}


def _merged(parts: list[dict[str, list[Point]]]) -> dict[str, list[Point]]:
    """One setting's runs from several folders (calls), each run's points by rate and repeat."""
    runs: dict[str, list[Point]] = {}
    for part in parts:
        for label, points in part.items():
            have = {(p.rate, p.repeat) for p in runs.get(label, [])}
            if twice := sorted(have & {(p.rate, p.repeat) for p in points}):
                rate, k = twice[0]
                raise ValueError(f"{label} at {rate:g} req/s, repeat {k}, is in two of the folders")
            runs.setdefault(label, []).extend(points)
    for points in runs.values():
        points.sort(key=lambda p: (p.rate, p.repeat))
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results_dir", nargs="+", help="a sweep's folder, or several as TITLE=DIR (one setting each)")
    p.add_argument("--target", type=float, default=0.9, help="attainment that counts as meeting the SLOs")
    p.add_argument("--baseline", default=None,
                   help="the run the goodput ratios divide by (default: the first fcfs run without a knee variant)")
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
            print(f"error: no gp_<label>_r<rate>[_k<repeat>].json reports in {folder}", file=sys.stderr)
            return 2
        panels[title if sep else ("" if len(args.results_dir) == 1 else folder)] = runs
    for title, runs in panels.items():
        print(f"== {title}\n{table(runs, args.target, args.baseline)}" if title
              else table(runs, args.target, args.baseline))
        for w in provenance(runs)["warnings"]:
            print(f"!!! {title + ': ' if title else ''}{w}", file=sys.stderr)
    if args.plot:
        plot(panels, args.target, args.plot)
    if args.out:
        if len(panels) == 1:
            only = next(iter(panels.values()))
            doc: dict[str, Any] = {"target": args.target, "runs": _doc(only, args.target),
                                   **_panel_doc(only, args.target, args.baseline)}
        else:
            doc = {"target": args.target, "settings": {t: _doc(r, args.target) for t, r in panels.items()},
                   "panels": {t: _panel_doc(r, args.target, args.baseline) for t, r in panels.items()}}
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
