"""How much KV the requests of a goodput point held, estimated from the client's side of the run.

    python bench/kv_inflight.py bench/results/<date>/<panel> [--pool TOKENS]

For points measured before the servers logged their pool use (bench/step_profile.py), whether "KV
binds" can still be bounded: each report's requests are rebuilt with serving.py's own function (the
same rows, lengths and arrival times), and its `slo_records` give each request's TTFT and mean TPOT.
A request is counted from its first token (prompt tokens, then one more per mean TPOT) to its last.
An estimate, with errors both ways: left out are the time before a first token (queue and prefill),
pages' rounding and the prefix cache's finished entries (evictable); counted as held is the KV of a
request preempted and recomputed (freed meanwhile) or rotated to host memory, and a request's growth is
taken as even over its life. So a peak above 100 % of the pool is demand the pool could not hold at
once: someone waited, was preempted or was rotated then. Read ~110 % as full: fcfs-recompute, which
cannot hold more than the pool, tops out at 109-111 % on every panel read so far (Qwen3 at 0.9 of an
H100, Llama-3-8B at 1/2 of an H100 and at 1/4 of an H200). The pool comes from the run's server log when
the folder has one (`--pool` otherwise). Servers since 2026-12-06 session 4 log their own pool use
(bench/step_profile.py): prefer it where it exists.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # executed as ``python bench/kv_inflight.py``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.goodput import reports
from bench.traces import build_requests


@dataclass
class PointKV:
    run: str
    rate: float
    repeat: int
    mean_tokens: float  # over the time from the first arrival to the last finish
    peak_tokens: float
    pool_tokens: int | None

    def share(self, x: float) -> float | None:
        return x / self.pool_tokens if self.pool_tokens else None


def inflight(report: dict, step_s: float = 0.05) -> tuple[float, float]:
    """(mean, peak) tokens the report's requests held, sampled every `step_s` seconds."""
    from bench.sim.replay_sweeps import serving_config  # the simulator's rebuild of serving.py's flags

    specs, _ = build_requests(serving_config(report["config"]))
    records = report["slo_records"]
    spans = []
    for spec, rec in zip(specs, records, strict=False):  # results are kept in send order
        ok, ttft, tpot = rec[1], rec[2], rec[3]
        if not ok or ttft is None:
            continue
        first = spec.arrival_s + ttft
        n = max(spec.output_len, 1)
        spans.append((first, first + (tpot or 0.0) * (n - 1), spec.input_len, tpot or 0.0))
    if not spans:
        return 0.0, 0.0
    t = np.arange(min(s[0] for s in spans), max(s[1] for s in spans), step_s)
    held = np.zeros_like(t)
    for first, end, prompt, tpot in spans:
        live = (t >= first) & (t <= end)
        grown = (t[live] - first) / tpot if tpot > 0 else 0.0
        held[live] += prompt + 1 + grown
    return float(held.mean()), float(held.max())


def folder_points(folder: Path, pool: int | None = None) -> list[PointKV]:
    from bench.sim.replay_sweeps import logged_pool_tokens

    out = []
    for label, rate, repeat, rep in reports(folder):
        if "slo_records" not in rep:
            continue
        mean, peak = inflight(rep)
        logged = logged_pool_tokens(folder, label) if pool is None else None
        held = pool if pool is not None else logged[0] if logged else None
        out.append(PointKV(label, rate, repeat, mean, peak, held))
    return sorted(out, key=lambda x: (x.run, x.rate, x.repeat))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path)
    p.add_argument("--pool", type=int, default=None, help="the pool in tokens (default: the server log's)")
    a = p.parse_args(argv)
    pts = folder_points(a.folder, a.pool)
    if not pts:
        print(f"no goodput reports with slo_records under {a.folder}", file=sys.stderr)
        return 1
    print(f"{'run':<22} {'rate':>5} {'k':>2} {'mean tokens':>12} {'peak tokens':>12} {'pool':>9} "
          f"{'mean %':>7} {'peak %':>7}")
    for x in pts:
        ms, ps = x.share(x.mean_tokens), x.share(x.peak_tokens)
        print(f"{x.run:<22} {x.rate:>5g} {x.repeat:>2} {x.mean_tokens:>12,.0f} {x.peak_tokens:>12,.0f} "
              f"{x.pool_tokens or 0:>9,} {'' if ms is None else f'{100 * ms:6.0f}%'} "
              f"{'' if ps is None else f'{100 * ps:6.0f}%'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
