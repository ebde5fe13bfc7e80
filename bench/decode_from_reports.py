"""What a goodput point's decode steps cost, from the client's reports alone, beside the servers' own
figure where they logged one and the HBM roofline of uniform expert routing.

    python bench/decode_from_reports.py bench/results/<date>/<panel> --model preset:qwen3-30b-a3b \
        --hbm-from bench/results/2026-12-06-h100-s4/c4-qwen3-decode/offline-qwen3-h100.json

Why: panels from before the servers' step profile (bench/step_profile.py) hold only the clients'
reports, and a claim such as "this run's decode was cheaper than uniform routing allows" needs a figure
anyone can recompute. Per report (all in ms, one decode step):

  bound     (run time - completed x p99 gap) / (output tokens / mean concurrency): each request's prompt
            is taken to cost one forward as long as the point's p99 inter-token gap (the gap decoding rows
            see when a prefill rides their step), and a step holds at most the mean concurrency in rows,
            so this is an upper bound on the step at <= that many rows (when the prefill guess holds)
  estimate  mean TPOT - concurrency x p99 gap / mean output length: a request's mean TPOT less the
            prefill stalls it lives through (Little's law: during its life, concurrency other arrivals)
  roofline  bytes one step at `concurrency` rows reads under uniform routing (dense weights, the experts
            expected hit, each row's KV at mean input + half the mean output), over the HBM read rate
  server    the servers' decode-only steps (ms @ rows), where the folder's logs have a step profile

The estimate, checked where both exist (Qwen3-30B-A3B on an H100, 2026-12-06 session 5): 14.0-24.3 ms,
where the servers logged 15.9-18.6 ms per call of Scheduler.step (those servers counted calls, not
forwards; bench/step_profile.py now reads such logs from their wholly overlapped intervals).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # executed as ``python bench/decode_from_reports.py``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import step_profile
from bench.goodput import reports


@dataclass
class PointDecode:
    run: str
    rate: float
    repeat: int
    concurrency: float
    p99_gap_ms: float
    bound_ms: float
    estimate_ms: float
    roofline_ms: float | None
    server: str


def point(report: dict, geo: object | None, hbm_tbps: float | None) -> tuple[float, float, float, float, float | None]:
    """(concurrency, p99 gap, bound, estimate, roofline) of one report, in ms where a time."""
    m, w = report["metrics"], report["workload"]
    conc, gap = float(m["concurrency"]), float(m["itl_ms"]["p99"]) / 1e3
    out_len, tokens = float(w["mean_output_len"]), float(m["total_output_tokens"])
    bound = (float(m["duration_s"]) - int(m["completed"]) * gap) / (tokens / conc)
    estimate = float(m["tpot_ms"]["mean"]) / 1e3 - conc * gap / out_len
    roof = None
    if geo is not None and hbm_tbps:
        ctx = float(w["mean_input_len"]) + out_len / 2
        read = geo.weight_read_bytes(conc) + conc * ctx * geo.kv_bytes_per_token  # type: ignore[attr-defined]
        roof = 1e3 * read / (hbm_tbps * 1e12)
    return conc, 1e3 * gap, 1e3 * bound, 1e3 * estimate, roof


def folder_points(folder: Path, model: str | None, hbm_tbps: float | None) -> list[PointDecode]:
    geo = None
    if model:
        from bench.sim.geometry import Geometry

        geo = Geometry.preset(model)
    server = {(p.run, p.rate, p.repeat): f"{p.decode_ms:.1f} @ {p.decode_rows:.1f}"
              for p in step_profile.folder_points(folder) if p.decode_steps}
    out = []
    for label, rate, repeat, rep in reports(folder):
        if rep.get("metrics", {}).get("completed"):
            key = (label, rate, repeat)
            out.append(PointDecode(*key, *point(rep, geo, hbm_tbps), server.get(key, "")))
    return sorted(out, key=lambda x: (x.run, x.rate, x.repeat))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path)
    p.add_argument("--model", default=None, help="the served geometry (preset:NAME), for the roofline column")
    p.add_argument("--hbm-from", type=Path, default=None,
                   help="a bench/offline.py JSON of the same card: its measured HBM read rate prices the roofline")
    a = p.parse_args(argv)
    hbm = None
    if a.hbm_from is not None:
        try:
            hbm = float(json.loads(a.hbm_from.read_text())["env"]["hbm_read_TBps"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            p.error(f"--hbm-from {a.hbm_from}: no env.hbm_read_TBps ({e})")
    try:
        pts = folder_points(a.folder, a.model, hbm)
    except ValueError as e:  # an unknown preset
        p.error(str(e))
    if not pts:
        print(f"no goodput reports with completed requests under {a.folder}", file=sys.stderr)
        return 1
    print(f"{'run':<22} {'rate':>5} {'k':>2} {'conc':>6} {'p99 gap':>8} {'bound':>7} {'estimate':>9} "
          f"{'roofline':>9}  server")
    for x in pts:
        roof = "" if x.roofline_ms is None else f"{x.roofline_ms:.1f}"
        print(f"{x.run:<22} {x.rate:>5g} {x.repeat:>2} {x.concurrency:>6.1f} {x.p99_gap_ms:>8.0f} "
              f"{x.bound_ms:>7.1f} {x.estimate_ms:>9.1f} {roof:>9}  {x.server}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
