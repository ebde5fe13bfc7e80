"""Plot KV-rotation end-to-end runs (bench/rotation_e2e.sh): SLO attainment per policy and output
throughput over time, from the `rot_<policy>.json` files of one results folder.

    python bench/plot_rotation.py bench/results/2026-11-30-rotation-e2e-2 --out rotation.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def load(folder: Path) -> dict[str, dict[str, Any]]:
    runs = {}
    for f in sorted(folder.glob("rot_*.json")):
        name = f.stem.removeprefix("rot_")
        runs[name] = json.loads(f.read_text())
    if not runs:
        raise SystemExit(f"no rot_*.json in {folder}")
    return runs


def plot(runs: dict[str, dict[str, Any]], out: Path, title: str) -> None:
    fig, (bars, line) = plt.subplots(1, 2, figsize=(12, 4.2))
    names = list(runs)
    width = 0.38
    for i, (key, label) in enumerate((("ttft_attainment", "TTFT SLO"), ("tbt_attainment", "TPOT SLO"))):
        vals = [100 * runs[n]["metrics"]["slo"][key] for n in names]
        xs = [j + (i - 0.5) * width for j in range(len(names))]
        bars.bar(xs, vals, width, label=label)
        for x, v in zip(xs, vals, strict=True):
            bars.text(x, v + 1, f"{v:.0f}", ha="center", fontsize=8)
    bars.set_xticks(range(len(names)), names)
    bars.set_ylim(0, 110)
    bars.set_ylabel("requests meeting the SLO (%)")
    bars.set_title("SLO attainment")
    bars.legend(loc="lower right")
    for n in names:
        tl = runs[n]["timeline"]
        rps = runs[n]["metrics"]["request_throughput_rps"]
        line.plot(tl["t_s"], tl["output_tok_s"], label=f"{n} ({rps:.1f} req/s)")
    line.set_xlabel("time (s)")
    line.set_ylabel("output tokens/s")
    line.set_title("output throughput over time")
    line.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--out", type=Path, default=Path("rotation.png"))
    p.add_argument("--title", default="KV rotation end to end (H200, Llama-3-8B geometry, 32K-token KV pool)")
    a = p.parse_args()
    plot(load(a.folder), a.out, a.title)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
