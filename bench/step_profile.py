"""Per point of a knee search, what the server's steps did: step time, decode-only step time and rows,
the KV pool's use, the queue (the worker's `--step-log-interval-s` lines, between the markers
bench/goodput_knee.py writes into each gp_server_RUN.log).

    python bench/step_profile.py bench/results/<date>/<panel> [--json steps.json]

Why: a goodput point says whether the SLOs held, not why. "KV binds" is a claim about the pool (peak
use near 100 % and a queue waiting for pages), and a simulator's decode step is checked against the
decode-only steps measured in serving at the rows they ran with. Means are weighted by steps; the
peak is the highest of the intervals'. A point whose server logged no profile lines (a call before
2026-12-06 session 4, or --step-log-s 0) is left out.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

POINT_MARK = "=== knee point"  # bench/goodput_knee.py: "=== knee point begins RATE REPEAT" / "... ends ..."

_LINE = re.compile(
    r": steps (?P<steps>\d+) \((?P<per_s>[\d.]+)/s, (?P<ms>[\d.]+) ms mean, (?P<prefill_pct>\d+) % with a prefill, "
    r"(?P<overlapped>\d+) % overlapped\) \| running (?P<running>[\d.]+) \(remote [\d.]+\) "
    r"waiting (?P<waiting>[\d.]+) \| "
    r"rows (?P<rows>[\d.]+) \| tokens out (?P<tok_s>\d+)/s, prefill (?P<prefill_s>\d+)/s \| .*?"
    r"\| kv (?P<kv_mean>\d+) % mean, (?P<kv_peak>\d+) % peak \| "
    r"decode-only (?P<per_forward>forwards )?(?P<d_steps>\d+) x (?P<d_ms>[\d.]+) ms at (?P<d_rows>[\d.]+) rows"
    r"(?: of (?P<d_ctx>\d+) tokens)?"  # the context a row: servers since 2026-12-06 session 5
    # the forwards with a prefill, timed (servers since 2026-12-07 session 15; before, _prefill estimates them)
    r"(?: \| prefill forwards (?P<p_n>\d+) x (?P<p_ms>[\d.]+) ms of (?P<p_tok>\d+) tokens at (?P<p_rows>[\d.]+) rows"
    # ... their chunks, the keys a prompt token attended over, the decode rows riding along (since session 16)
    r"(?: \((?P<p_chunks>[\d.]+) chunks, (?P<p_keys>\d+) keys a prompt token; (?P<p_riding>[\d.]+) decoding at "
    r"(?P<p_rctx>\d+) tokens\))?)?")
_WHY = re.compile(r"\| not overlapped: (?P<why>[a-z]+ \d+(?:, [a-z]+ \d+)*)")  # servers since 2026-12-07
_MARK = re.compile(re.escape(POINT_MARK) + r" (?P<what>begins|ends) (?P<rate>[\d.]+) (?P<repeat>\d+)")


@dataclass
class PointSteps:
    """One point's step profile (one repeat of one rate on one run's server)."""

    run: str
    rate: float
    repeat: int
    intervals: int
    steps: int
    step_ms: float
    prefill_step_share: float
    rows: float
    running: float
    waiting: float
    prefill_tok_s: float
    kv_mean: float  # share of the pool, 0-1
    kv_peak: float
    decode_steps: int
    decode_ms: float
    decode_rows: float
    decode_context: float = 0.0  # KV tokens a decode-only row attended over (0: not logged, older servers)
    decode_source: str = "forwards"  # or OLDER: a log that counted calls, read from its overlapped intervals
    # (forwards, ms, rows, context a row, share of the interval's steps overlapped) of each logged interval
    # with decode-only forwards and a logged context: a step's time is far from linear in its rows (an MoE's
    # experts), so a model is checked interval by interval, not at the point's mean rows; and a decode the
    # overlap loop ran plain pays host time its forward's ms include
    decode_intervals: tuple[tuple[int, float, float, float, float], ...] = ()
    # (forwards with a prefill, ms each, prefill tokens each, decode rows riding along, their context a row,
    # prompt chunks each, keys a prompt token attended over) of each interval logged per forward: as the
    # server timed them (since 2026-12-07 session 15), else the time left after the decode-only forwards over
    # the forwards that launched a prefill (the share logged as a whole percent: an estimate). Lines before
    # session 16 log no chunks or keys: one chunk from its prompt's start is assumed (keys (tokens + 1) / 2,
    # a lower bound on the attention of chunks that follow a prefix), and their riding rows are the forward's
    # rows less that chunk (session 15's lines) or, estimated, the decode-only forwards' rows
    prefill_intervals: tuple[tuple[int, float, float, float, float, float, float], ...] = ()
    # why steps in flight were not followed by an overlapped one, summed over the point (the overlap loop's
    # reasons, sglang_ext.scheduler.overlap.NOT_OVERLAPPED; empty: an older server, or every step overlapped)
    not_overlapped: dict[str, int] = field(default_factory=dict)


OLDER = "overlapped intervals of an older log"
MIN_OVERLAP_PCT = 95  # an older log's interval whose calls were (almost) all overlapped: calls = forwards


def _summary(run: str, rate: float, repeat: int, lines: list[dict[str, float]],
             why: dict[str, int] | None = None) -> PointSteps:
    steps = sum(x["steps"] for x in lines) or 1
    decode, source = lines, "forwards"
    if not all("per_forward" in x for x in lines):
        # Servers before 2026-12-06 session 6 counted calls of Scheduler.step as decode-only steps: outside
        # the overlap loop's steady state a launched step lands in a call of its own, halving both time and
        # rows. Only intervals run (almost) wholly overlapped, where each call is one forward, say what a
        # forward took.
        decode, source = [x for x in lines if x["overlapped"] >= MIN_OVERLAP_PCT], OLDER
    dsteps = sum(x["d_steps"] for x in decode)
    drows = sum(x["d_rows"] * x["d_steps"] for x in decode)

    def mean(key: str) -> float:  # over every interval of the point
        return sum(x[key] * x["steps"] for x in lines) / steps

    def dmean(key: str) -> float:
        return sum(x[key] * x["d_steps"] for x in decode) / dsteps if dsteps else float("nan")

    context = (sum(x["d_ctx"] * x["d_rows"] * x["d_steps"] for x in decode) / drows
               if drows and all("d_ctx" in x for x in decode) else 0.0)  # weighted by rows
    return PointSteps(run, rate, repeat, len(lines), int(sum(x["steps"] for x in lines)), mean("ms"),
                      mean("prefill_pct") / 100, mean("rows"), mean("running"), mean("waiting"),
                      sum(x["prefill_s"] for x in lines) / len(lines), mean("kv_mean") / 100,
                      max(x["kv_peak"] for x in lines) / 100, int(dsteps), dmean("d_ms"), dmean("d_rows"),
                      context, source,
                      tuple((int(x["d_steps"]), x["d_ms"], x["d_rows"], x["d_ctx"], x["overlapped"] / 100)
                            for x in decode if x["d_steps"] and "d_ctx" in x),
                      tuple(pf for x in lines if "per_forward" in x and "d_ctx" in x and (pf := _prefill(x))[0]),
                      dict(why or {}))


def _prefill(x: dict[str, float]) -> tuple[int, float, float, float, float, float, float]:
    """One interval's forwards with a prefill: how many, their mean time and prefill tokens, ... (see
    PointSteps): as the server timed them where its line says (`p_n`), else estimated from the rest of the
    interval."""
    if "p_chunks" in x:
        return (int(x["p_n"]), x["p_ms"], x["p_tok"], x["p_riding"], x["p_rctx"], x["p_chunks"], x["p_keys"])
    if "p_n" in x:
        return (int(x["p_n"]), x["p_ms"], x["p_tok"], max(x["p_rows"] - 1.0, 0.0), x["d_ctx"], 1.0,
                (x["p_tok"] + 1) / 2)
    n = round(x["steps"] * x["prefill_pct"] / 100)
    if n < 1 or x["prefill_s"] <= 0:
        return (0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    span_s = x["steps"] / x["per_s"]
    ms = (x["steps"] * x["ms"] - x["d_steps"] * x["d_ms"]) / n
    tokens = x["prefill_s"] * span_s / n
    return (n, ms, tokens, x["d_rows"], x["d_ctx"], 1.0, (tokens + 1) / 2)


def parse_log(text: str, run: str) -> list[PointSteps]:
    """The points of one server log, each with the profile lines logged between its markers."""
    out: list[PointSteps] = []
    current: tuple[float, int] | None = None
    lines: list[dict[str, float]] = []
    why: dict[str, int] = {}
    for line in text.splitlines():
        if (m := _MARK.search(line)) is not None:
            if m["what"] == "begins":
                current, lines, why = (float(m["rate"]), int(m["repeat"])), [], {}
            elif current is not None:
                if lines:
                    out.append(_summary(run, *current, lines, why))
                current = None
        elif current is not None and (m := _LINE.search(line)) is not None:
            lines.append({k: (1.0 if k == "per_forward" else float(v)) for k, v in m.groupdict().items()
                          if v is not None})
            if (w := _WHY.search(line)) is not None:
                for part in w["why"].split(", "):
                    k, n = part.split(" ")
                    why[k] = why.get(k, 0) + int(n)
    return out


def folder_points(folder: Path) -> list[PointSteps]:
    """Every point of a panel folder: its own server logs and those of the calls it merges."""
    logs = [*sorted(folder.glob("gp_server_*.log")), *sorted(folder.glob("calls/*/gp_server_*.log"))]
    points = []
    for log in logs:
        points += parse_log(log.read_text(errors="replace"), log.stem.removeprefix("gp_server_"))
    return sorted(points, key=lambda p: (p.run, p.rate, p.repeat))


def format_table(points: list[PointSteps]) -> str:
    head = (f"{'run':<22} {'rate':>5} {'k':>2} {'steps':>6} {'step ms':>8} {'prefill':>8} {'rows':>6} "
            f"{'waiting':>8} {'kv mean':>8} {'kv peak':>8} {'decode-only ms @ rows':>22} {'ctx/row':>8}")
    rows = [head]
    for p in points:
        rows.append(f"{p.run:<22} {p.rate:>5g} {p.repeat:>2} {p.steps:>6} {p.step_ms:>8.1f} "
                    f"{100 * p.prefill_step_share:>7.0f}% {p.rows:>6.1f} {p.waiting:>8.1f} "
                    f"{100 * p.kv_mean:>7.0f}% {100 * p.kv_peak:>7.0f}% "
                    f"{p.decode_ms:>13.1f} @ {p.decode_rows:>5.1f} "
                    f"{f'{p.decode_context:.0f}' if p.decode_context else '-':>8}  "
                    + (", ".join(f"{k} {n}" for k, n in p.not_overlapped.items()) or "-"))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", nargs="+", type=Path)
    p.add_argument("--json", type=Path, default=None, help="write every point's profile here")
    a = p.parse_args(argv)
    points = [pt for f in a.folders for pt in folder_points(f)]
    if not points:
        print("no step profile in these folders (servers started without --step-log-interval-s, or before "
              "bench/goodput_knee.py marked its points)", file=sys.stderr)
        return 1
    print(format_table(points))
    if a.json is not None:
        a.json.write_text(json.dumps([asdict(pt) for pt in points], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
