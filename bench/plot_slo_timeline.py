"""Plot SLO attainment over time per model for several serving runs (bench/serving.py JSON reports with
`slo_timeline`), e.g. the adaptive vs fixed offload runs of bench/weaver_e2e.sh under `--arrival ramp`.

    python bench/plot_slo_timeline.py fixed=out/weaver_fixed.json adaptive=out/weaver_adaptive.json --out slo.png

One panel per model (both SLOs met, by the time requests were scheduled), one line per run; the bottom
panel shows the requests scheduled per bin (the offered load), from the first run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def load(specs: list[str]) -> dict[str, dict[str, Any]]:
    runs: dict[str, dict[str, Any]] = {}
    for spec in specs:
        label, _, path = spec.rpartition("=")
        report = json.loads(Path(path).read_text())
        if "slo_timeline" not in report:
            raise SystemExit(f"{path}: no slo_timeline (a report from an older bench/serving.py?)")
        runs[label or Path(path).stem] = report["slo_timeline"]
    return runs


def plot(runs: dict[str, dict[str, Any]], out: Path, title: str) -> None:
    models = sorted({k for tl in runs.values() for k in tl if k not in ("bin_s", "t_s", "all")}) or ["all"]
    fig, axes = plt.subplots(len(models) + 1, 1, figsize=(9, 2.6 * (len(models) + 1)), sharex=True)
    for ax, model in zip(axes, models, strict=False):
        for label, tl in runs.items():
            if model in tl:
                ax.plot(tl["t_s"], [v if v is not None else float("nan") for v in tl[model]["attainment"]],
                        marker=".", label=label)
        ax.set_ylabel(f"{model}: both SLOs")
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    first = next(iter(runs.values()))
    load_ax = axes[-1]
    for model in models:
        if model in first:
            load_ax.bar(first["t_s"], [k / first["bin_s"] for k in first[model]["requests"]], width=first["bin_s"],
                        alpha=0.5, align="edge", label=model)
    load_ax.set_ylabel("offered req/s")
    load_ax.set_xlabel("scheduled at (s)")
    load_ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="LABEL=report.json")
    p.add_argument("--out", type=Path, default=Path("slo_timeline.png"))
    p.add_argument("--title", default="SLO attainment over time")
    a = p.parse_args(argv)
    plot(load(a.runs), a.out, a.title)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
