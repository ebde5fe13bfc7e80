"""Plots for ``bench/serving.py``: CDFs of TTFT, TPOT and E2E latency, and throughput over time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes

from bench.metrics import RequestResult, tpot


def _groups(results: Sequence[RequestResult]) -> dict[str, list[RequestResult]]:
    ok = [r for r in results if r.success]
    models = sorted({r.model for r in ok if r.model is not None})
    groups = {"all": ok}
    if len(models) > 1:
        groups.update({m: [r for r in ok if r.model == m] for m in models})
    return groups


def _cdf(ax: Axes, values_by_label: dict[str, list[float]], title: str) -> None:
    for label, values in values_by_label.items():
        if values:
            xs = np.sort(np.asarray(values) * 1000.0)
            ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=f"{label} (n={len(xs)})")
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("CDF")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    if any(values_by_label.values()):
        ax.legend(fontsize=7)


def _throughput(ax: Axes, timeline: dict[str, object]) -> None:
    t = timeline["t_s"]
    tok = timeline["output_tok_s"]
    req = timeline["completed_rps"]
    assert isinstance(t, list) and isinstance(tok, list) and isinstance(req, list)
    if t:  # close the last bin so steps-post draws it
        t, tok, req = [*t, t[-1] + float(timeline["bin_s"])], [*tok, tok[-1]], [*req, req[-1]]  # type: ignore[arg-type]
    ax.plot(t, tok, drawstyle="steps-post", color="tab:blue", label="output tok/s")
    ax.set_xlabel(f"time since start (s), bins of {float(timeline['bin_s']):.2f} s")  # type: ignore[arg-type]
    ax.set_ylabel("output tokens/s", color="tab:blue")
    ax.set_title("Throughput over time")
    ax.grid(alpha=0.3)
    twin = ax.twinx()
    twin.plot(t, req, drawstyle="steps-post", color="tab:orange", label="completed req/s")
    twin.set_ylabel("completed requests/s", color="tab:orange")


def plot_results(
    results: Sequence[RequestResult], timeline: dict[str, object], path: Path, title: str = ""
) -> None:
    groups = _groups(results)
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    _cdf(axes[0][0], {k: [r.ttft_s for r in v if r.ttft_s is not None] for k, v in groups.items()}, "TTFT")
    _cdf(axes[0][1], {k: [t for t in map(tpot, v) if t is not None] for k, v in groups.items()}, "TPOT")
    _cdf(
        axes[1][0], {k: [r.e2e_s for r in v if r.e2e_s is not None] for k, v in groups.items()}, "E2E latency"
    )
    _throughput(axes[1][1], timeline)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
