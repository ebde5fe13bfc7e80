"""Per-request results and the serving metrics computed from them (SGLang ``bench_serving`` definitions).

* TTFT: request send -> first chunk that carries at least one output token.
* ITL: gap between consecutive token-carrying chunks (one value per chunk, even when a chunk carries
  several tokens, as SGLang does).
* TPOT: per request ``(e2e - ttft) / (output_tokens - 1)``; requests with one output token are skipped.
* E2E latency: request send -> end of the stream.
* Throughputs divide completed-request totals by the benchmark duration (first send -> last finish).

SLO attainment (``--ttft-slo`` / ``--tbt-slo``): the fraction of all sent requests that succeeded and met
the SLO. A request's TBT is the P99 (default) or max of its own ITLs (``--tbt-stat``); a request with
fewer than two token chunks has no gaps and meets the TBT SLO. Failed requests miss every SLO.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

STAT_KEYS = ("mean", "median", "p90", "p99")


@dataclass
class RequestResult:
    index: int
    model: str | None
    input_len: int
    target_output_len: int
    scheduled_s: float
    send_s: float | None = None  # all times are seconds from the benchmark start
    end_s: float | None = None
    success: bool = False
    error: str = ""
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    cached_tokens: int | None = None  # prompt tokens the server's prefix cache held (when it says)
    # The worker's own TTFT (meta_info "ttft": from the request reaching the worker, tokenized, to its first
    # token), when the server says. The client's TTFT minus it is what the serving path outside the worker
    # costs (HTTP, tokenizer, the trips between front end and worker, streaming), which no offline bench sees.
    server_ttft_s: float | None = None
    server_e2e_s: float | None = None  # the worker's e2e_latency on the last chunk (same clock as server_ttft_s)
    itls_s: list[float] = field(default_factory=list)
    chunk_times_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class SloConfig:
    ttft_s: float | None = None
    tbt_s: float | None = None
    tbt_stat: str = "p99"  # "p99" | "max" | "mean" (= TPOT)

    def definition(self) -> str:
        return (
            f"TTFT attainment: fraction of sent requests that succeeded with TTFT <= ttft_slo_s. "
            f"TBT attainment: fraction of sent requests that succeeded with per-request TBT <= "
            f"tbt_slo_s, "
            f"where per-request TBT = {self.tbt_stat} of that request's inter-token (chunk) gaps; a "
            f"request with < 2 token chunks has no gaps and meets it. Both: meets every SLO that is "
            f"set. Failed requests miss every SLO. Goodput = requests meeting both / duration."
        )


def describe(values: Sequence[float], scale: float = 1000.0) -> dict[str, float | None]:
    """mean/median/std/p90/p99/max of ``values`` times ``scale`` (seconds -> ms by default)."""
    if not values:
        return {k: None for k in (*STAT_KEYS, "std", "max")}
    arr = np.asarray(values, dtype=float) * scale
    return {
        "mean": float(arr.mean()),
        "median": float(np.median(arr)),
        "p90": float(np.percentile(arr, 90)),
        "p99": float(np.percentile(arr, 99)),
        "std": float(arr.std()),
        "max": float(arr.max()),
    }


def tpot(result: RequestResult) -> float | None:
    if not result.success or result.output_tokens < 2 or result.e2e_s is None or result.ttft_s is None:
        return None
    return (result.e2e_s - result.ttft_s) / (result.output_tokens - 1)


def server_tpot(result: RequestResult) -> float | None:
    """The worker's own TPOT of a request, ``(server_e2e - server_ttft) / (output_tokens - 1)``, where the
    server reported both; None otherwise (as ``tpot``, requests with one output token have none)."""
    if not result.success or result.output_tokens < 2 or result.server_e2e_s is None or result.server_ttft_s is None:
        return None
    return (result.server_e2e_s - result.server_ttft_s) / (result.output_tokens - 1)


def request_tbt(result: RequestResult, stat: str) -> float | None:
    if stat == "mean":  # the request's TPOT: what a TPOT SLO (the worker's tpot_slo_ms) checks
        return tpot(result)
    if not result.itls_s:
        return None
    if stat == "max":
        return max(result.itls_s)
    return float(np.percentile(result.itls_s, 99))


def _meets_ttft(r: RequestResult, slo: SloConfig) -> bool:
    return r.success and (slo.ttft_s is None or (r.ttft_s is not None and r.ttft_s <= slo.ttft_s))


def _meets_tbt(r: RequestResult, slo: SloConfig) -> bool:
    tbt = request_tbt(r, slo.tbt_stat)
    return r.success and (slo.tbt_s is None or tbt is None or tbt <= slo.tbt_s)


def slo_attainment(results: Sequence[RequestResult], slo: SloConfig, duration_s: float) -> dict[str, object]:
    n = len(results)
    ttft_ok = [_meets_ttft(r, slo) for r in results]
    tbt_ok = [_meets_tbt(r, slo) for r in results]
    n_both = sum(a and b for a, b in zip(ttft_ok, tbt_ok, strict=True))
    any_set = slo.ttft_s is not None or slo.tbt_s is not None

    def frac(count: int, enabled: bool) -> float | None:
        return count / n if enabled and n else None

    return {
        "ttft_slo_s": slo.ttft_s,
        "tbt_slo_s": slo.tbt_s,
        "tbt_stat": slo.tbt_stat,
        "ttft_attainment": frac(sum(ttft_ok), slo.ttft_s is not None),
        "tbt_attainment": frac(sum(tbt_ok), slo.tbt_s is not None),
        "both_attainment": frac(n_both, any_set),
        "goodput_rps": n_both / duration_s if any_set and duration_s > 0 else None,
        "definition": slo.definition(),
    }


SloRecord = tuple[str | None, bool, float | None, float | None, float | None, float | None]


def slo_records(results: Sequence[RequestResult]) -> list[SloRecord]:
    """Per request (model, success, TTFT, TPOT, P99 and max inter-token gap), in seconds: what scoring it
    against any TTFT / TBT SLO later needs (`meets`), in a few numbers instead of its whole record."""
    return [(r.model, r.success, r.ttft_s, request_tbt(r, "mean"), request_tbt(r, "p99"), request_tbt(r, "max"))
            for r in results]


_TBT_FIELD = {"mean": 3, "p99": 4, "max": 5}


def meets(record: Sequence[Any], slo: SloConfig) -> bool:
    """Whether a `slo_records` entry meets every SLO of `slo` (the rules of `slo_attainment`)."""
    success, ttft, tbt = bool(record[1]), record[2], record[_TBT_FIELD[slo.tbt_stat]]
    ttft_ok = slo.ttft_s is None or (ttft is not None and ttft <= slo.ttft_s)
    tbt_ok = slo.tbt_s is None or tbt is None or tbt <= slo.tbt_s
    return success and ttft_ok and tbt_ok


def compute_metrics(results: Sequence[RequestResult], duration_s: float, slo: SloConfig) -> dict[str, object]:
    ok = [r for r in results if r.success]
    total_in = sum(r.input_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    tpots = [t for t in (tpot(r) for r in ok) if t is not None]
    told = [r for r in ok if r.cached_tokens is not None]
    told_in = sum(r.input_len for r in told)
    pairs = [(r.ttft_s, r.server_ttft_s) for r in ok if r.ttft_s is not None and r.server_ttft_s is not None]
    server_tpots = [t for t in (server_tpot(r) for r in ok) if t is not None]

    def per_s(x: float) -> float | None:
        return x / duration_s if duration_s > 0 else None

    return {
        "sent": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput_rps": per_s(len(ok)),
        "input_throughput_tok_s": per_s(total_in),
        "output_throughput_tok_s": per_s(total_out),
        "total_throughput_tok_s": per_s(total_in + total_out),
        "concurrency": per_s(sum(e2e)),
        # Prompt tokens served from a prefix cache, over the prompt tokens of requests whose server said.
        "prefix_cache_hit_rate": sum(r.cached_tokens or 0 for r in told) / told_in if told_in else None,
        "ttft_ms": describe([r.ttft_s for r in ok if r.ttft_s is not None]),
        # the worker's TTFT and the rest of the client's (see RequestResult.server_ttft_s), where the server said
        "server_ttft_ms": describe([w for _, w in pairs]),
        "ttft_outside_worker_ms": describe([c - w for c, w in pairs]),
        "server_tpot_ms": describe(server_tpots),  # the worker's TPOT: what the client's adds is streaming
        "tpot_ms": describe(tpots),
        "itl_ms": describe([g for r in ok for g in r.itls_s]),
        "e2e_latency_ms": describe(e2e),
        "slo": slo_attainment(results, slo, duration_s),
    }


def per_model_metrics(
    results: Sequence[RequestResult], duration_s: float, slo: SloConfig
) -> dict[str, dict[str, object]]:
    models = sorted({r.model for r in results if r.model is not None})
    return {m: compute_metrics([r for r in results if r.model == m], duration_s, slo) for m in models}


def error_counts(results: Sequence[RequestResult], limit: int = 20) -> dict[str, int]:
    return dict(Counter(r.error[:200] for r in results if not r.success).most_common(limit))


def realized_rates(send_times_s: Sequence[float], window_s: float = 5.0) -> dict[str, float | None]:
    """The arrival rates a run really offered, which a nominal mean rate hides for bursts (a 15 s burst
    point at "4 req/s" can send 60 requests in 9 s). `realized_rate_rps`: sends / span of the send times
    (first to last). `realized_peak_rps`: the most sends within any `window_s`-long window, per second
    (every window starts at a send; a run shorter than the window reports its realized rate)."""
    times = sorted(send_times_s)
    n = len(times)
    span = times[-1] - times[0] if n else 0.0
    if n < 2 or span <= 0:
        return {"realized_rate_rps": None, "realized_peak_rps": None, "peak_window_s": window_s}
    rate = n / span
    if span < window_s:
        return {"realized_rate_rps": rate, "realized_peak_rps": rate, "peak_window_s": window_s}
    most, j = 0, 0
    for i, start in enumerate(times):  # two pointers: times[i:j] lie in [start, start + window)
        while j < n and times[j] < start + window_s:
            j += 1
        most = max(most, j - i)
    return {"realized_rate_rps": rate, "realized_peak_rps": most / window_s, "peak_window_s": window_s}


def timeline(
    results: Sequence[RequestResult], duration_s: float, bin_s: float | None = None
) -> dict[str, object]:
    """Output-token and completed-request throughput per time bin (about 60 bins by default)."""
    if bin_s is None:
        bin_s = max(0.1, duration_s / 60.0)
    n_bins = max(1, math.ceil(duration_s / bin_s))
    tokens = np.zeros(n_bins)
    done = np.zeros(n_bins)
    for r in results:
        for t, k in zip(r.chunk_times_s, r.chunk_tokens, strict=True):
            tokens[min(n_bins - 1, int(t // bin_s))] += k
        if r.success and r.end_s is not None:
            done[min(n_bins - 1, int(r.end_s // bin_s))] += 1
    return {
        "bin_s": bin_s,
        "t_s": [i * bin_s for i in range(n_bins)],
        "output_tok_s": (tokens / bin_s).tolist(),
        "completed_rps": (done / bin_s).tolist(),
    }


# ---------------------------------------------------------------------------------------------- printing


def slo_timeline(
    results: Sequence[RequestResult], duration_s: float, slo: SloConfig, bin_s: float | None = None
) -> dict[str, object]:
    """SLO attainment over time, per model (all requests under "all"): the requests scheduled in each
    time bin and the share of them that met both SLOs (None for an empty bin)."""
    if bin_s is None:
        bin_s = max(1.0, duration_s / 30.0)
    n_bins = max(1, math.ceil(duration_s / bin_s))
    groups: dict[str, list[RequestResult]] = {"all": list(results)}
    for r in results:
        if r.model is not None:
            groups.setdefault(r.model, []).append(r)
    out: dict[str, object] = {"bin_s": bin_s, "t_s": [i * bin_s for i in range(n_bins)]}
    for name, rs in groups.items():
        sent = np.zeros(n_bins)
        met = np.zeros(n_bins)
        for r in rs:
            b = min(n_bins - 1, int(r.scheduled_s // bin_s))
            sent[b] += 1
            met[b] += _meets_ttft(r, slo) and _meets_tbt(r, slo)
        out[name] = {"requests": sent.astype(int).tolist(),
                     "attainment": [float(m / k) if k else None for m, k in zip(met, sent, strict=True)]}
    return out


def _fmt(value: object, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _latency_rows(m: dict[str, object]) -> list[str]:
    head = f"{'':<18}" + "".join(f"{k:>11}" for k in (*STAT_KEYS, "max"))
    rows = [head]
    for key, label in (
        ("ttft_ms", "TTFT (ms)"),
        ("tpot_ms", "TPOT (ms)"),
        ("itl_ms", "ITL (ms)"),
        ("e2e_latency_ms", "E2E (ms)"),
        ("server_ttft_ms", "TTFT, worker (ms)"),
        ("ttft_outside_worker_ms", "TTFT, path (ms)"),
        ("server_tpot_ms", "TPOT, worker (ms)"),
    ):
        stats = m.get(key)
        if not isinstance(stats, dict) or stats.get("mean") is None:
            continue  # a server that reports no TTFT of its own (or an older report)
        rows.append(f"{label:<18}" + "".join(f"{_fmt(stats[k]):>11}" for k in (*STAT_KEYS, "max")))
    return rows


def _slo_rows(slo: dict[str, object]) -> list[str]:
    rows: list[str] = []

    def pct(v: object) -> str:
        return "-" if v is None else f"{100 * float(v):.1f} %"  # type: ignore[arg-type]

    if slo["ttft_slo_s"] is not None:
        rows.append(f"{'TTFT <= ' + _fmt(slo['ttft_slo_s'], 3) + ' s':<40}{pct(slo['ttft_attainment'])}")
    if slo["tbt_slo_s"] is not None:
        label = f"TBT ({slo['tbt_stat']}) <= {_fmt(slo['tbt_slo_s'], 3)} s"
        rows.append(f"{label:<40}{pct(slo['tbt_attainment'])}")
    if rows:
        rows.append(f"{'Both SLOs':<40}{pct(slo['both_attainment'])}")
        rows.append(f"{'Goodput (req/s)':<40}{_fmt(slo['goodput_rps'])}")
    return rows


def format_summary(m: dict[str, object], title: str = "Serving Benchmark Result") -> str:
    lines = [f"{' ' + title + ' ':=^73}"]
    for label, key in (
        ("Successful requests", "completed"),
        ("Failed requests", "failed"),
        ("Benchmark duration (s)", "duration_s"),
        ("Total input tokens", "total_input_tokens"),
        ("Total generated tokens", "total_output_tokens"),
        ("Request throughput (req/s)", "request_throughput_rps"),
        ("Input token throughput (tok/s)", "input_throughput_tok_s"),
        ("Output token throughput (tok/s)", "output_throughput_tok_s"),
        ("Total token throughput (tok/s)", "total_throughput_tok_s"),
        ("Concurrency", "concurrency"),
    ):
        lines.append(f"{label:<40}{_fmt(m[key])}")
    if m.get("prefix_cache_hit_rate") is not None:
        lines.append(f"{'Prefix cache hit rate':<40}{_fmt(m['prefix_cache_hit_rate'], 3)}")
    lines.append(f"{' Latency ':-^73}")
    lines.extend(_latency_rows(m))
    slo = m["slo"]
    assert isinstance(slo, dict)
    slo_rows = _slo_rows(slo)
    if slo_rows:
        lines.append(f"{' SLO attainment ':-^73}")
        lines.extend(slo_rows)
    lines.append("=" * 73)
    return "\n".join(lines)
