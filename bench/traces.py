"""Workload construction for ``bench/serving.py``: trace loading, arrival schedules, prompts, model mix.

Trace formats are described in ``bench/data/traces/README.md``:

* Azure (Splitwise) CSVs: ``TIMESTAMP`` (``YYYY-MM-DD HH:MM:SS.fffffff``), ``ContextTokens``,
  ``GeneratedTokens``.
* Mooncake JSONL: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids`` (512-token blocks).
* ``servegen_model_rates.csv``: per-model request rate per 10-minute window (used for the model skew).

Prompts are lists of random token ids so that any tokenizer works; Mooncake requests that share
``hash_ids`` blocks share the same token prefix, so a prefix cache sees the trace's real reuse.
"""

from __future__ import annotations

import csv
import json
import math
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from itertools import islice
from pathlib import Path

import numpy as np

TRACE_FILES: dict[str, str] = {
    "azure-conv": "AzureLLMInferenceTrace_conv.csv",
    "azure-code": "AzureLLMInferenceTrace_code.csv",
    "mooncake": "mooncake_conversation_trace.jsonl",
}
TRACE_CHOICES: tuple[str, ...] = (*TRACE_FILES, "synthetic")
SERVEGEN_RATES_FILE = "servegen_model_rates.csv"
SERVEGEN_WINDOW_S = 600.0
DAY_S = 86_400.0
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRow:
    """One request of a trace: arrival (seconds from the first loaded row) and token lengths."""

    timestamp_s: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] | None = None


@dataclass
class RequestSpec:
    """A fully materialised request: when to send it, what to send, and to which model."""

    index: int
    arrival_s: float
    input_ids: list[int]
    output_len: int
    model: str | None

    @property
    def input_len(self) -> int:
        return len(self.input_ids)


@dataclass
class WorkloadConfig:
    trace: str = "synthetic"
    traces_dir: Path | None = None
    arrival: str | None = None  # "trace" | "poisson"; None = trace for trace files, poisson for synthetic
    request_rate: float | None = None
    time_scale: float = 1.0
    num_requests: int = 200
    trace_offset: int = 0
    max_input_len: int | None = None
    max_output_len: int | None = None
    block_scale: float = 1.0
    synthetic_input_len: int = 128
    synthetic_output_len: int = 32
    synthetic_range_ratio: float = 1.0
    vocab_size: int = 32_000
    min_token_id: int = 100
    models: tuple[str, ...] = ()
    model_weights: tuple[float, ...] | None = None
    servegen_skew: bool = False
    ramp_model: str | None = None  # --arrival ramp: whose ServeGen rate series (None: the day-1 busiest)
    ramp_start_window: int = 0
    ramp_windows: int = 12
    ramp_window_s: float = 10.0
    burst_factor: float = 4.0  # --arrival burst: the burst's rate over the quiet rate
    burst_s: float = 5.0  # ... its length, once every burst_period_s
    burst_period_s: float = 30.0
    seed: int = 0


def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


def default_traces_dir() -> Path:
    """The traces kept in the repository (``bench/data/traces``, described by its README)."""
    return repo_root() / "bench" / "data" / "traces"


# ----------------------------------------------------------------------------------------------- loading


def _parse_azure_time(text: str) -> datetime:
    base, _, frac = text.strip().partition(".")
    stamp = datetime.strptime(base, "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc)
    return stamp.replace(microsecond=int(frac[:6].ljust(6, "0"))) if frac else stamp


def _iter_azure(path: Path) -> Iterator[TraceRow]:
    first: datetime | None = None
    with path.open(newline="") as handle:
        for rec in csv.DictReader(handle):
            stamp = _parse_azure_time(rec["TIMESTAMP"])
            first = first or stamp
            yield TraceRow(
                (stamp - first).total_seconds(), int(rec["ContextTokens"]), int(rec["GeneratedTokens"])
            )


def _iter_mooncake(path: Path) -> Iterator[TraceRow]:
    with path.open() as handle:
        for line in handle:
            if line.strip():
                rec = json.loads(line)
                hashes = tuple(int(h) for h in rec.get("hash_ids") or ())
                yield TraceRow(
                    float(rec["timestamp"]) / 1000.0,
                    int(rec["input_length"]),
                    int(rec["output_length"]),
                    hashes or None,
                )


def load_trace(name: str, traces_dir: Path, offset: int = 0, limit: int | None = None) -> list[TraceRow]:
    """Rows ``offset .. offset+limit`` of a trace, sorted by time and rebased so the first is at 0 s."""
    if name not in TRACE_FILES:
        raise ValueError(f"unknown trace {name!r}; choose from {sorted(TRACE_FILES)}")
    path = traces_dir / TRACE_FILES[name]
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path} (see --traces-dir)")
    source = _iter_mooncake(path) if name == "mooncake" else _iter_azure(path)
    stop = None if limit is None else offset + limit
    rows = sorted(islice(source, offset, stop), key=lambda r: r.timestamp_s)
    if not rows:
        raise ValueError(f"trace {name} has no rows at offset {offset}")
    t0 = rows[0].timestamp_s
    return [TraceRow(r.timestamp_s - t0, r.input_len, r.output_len, r.hash_ids) for r in rows]


def synthetic_rows(
    n: int, input_len: int, output_len: int, range_ratio: float, rng: np.random.Generator
) -> list[TraceRow]:
    """Lengths uniform in ``[len * range_ratio, len]`` (range_ratio=1: fixed lengths); no timestamps."""

    def draw(length: int) -> np.ndarray:
        low = max(1, int(length * range_ratio))
        return rng.integers(low, max(low, length) + 1, size=n)

    ins, outs = draw(input_len), draw(output_len)
    return [TraceRow(0.0, int(i), int(o)) for i, o in zip(ins, outs, strict=True)]


def clip_lengths(
    rows: Iterable[TraceRow], max_in: int | None, max_out: int | None, block_scale: float = 1.0
) -> list[TraceRow]:
    """Scale block-structured inputs by ``1/block_scale``, then clip both lengths to the caps (min 1)."""
    out: list[TraceRow] = []
    for r in rows:
        n_in = math.ceil(r.input_len / block_scale) if r.hash_ids else r.input_len
        n_in = max(1, min(n_in, max_in) if max_in else n_in)
        n_out = max(1, min(r.output_len, max_out) if max_out else r.output_len)
        out.append(TraceRow(r.timestamp_s, n_in, n_out, r.hash_ids))
    return out


# ---------------------------------------------------------------------------------------------- arrivals


def trace_mean_rate(rows: Sequence[TraceRow]) -> float | None:
    span = rows[-1].timestamp_s - rows[0].timestamp_s if rows else 0.0
    return (len(rows) - 1) / span if len(rows) > 1 and span > 0 else None


def trace_arrivals(rows: Sequence[TraceRow], rate_factor: float, time_scale: float) -> list[float]:
    """Trace times divided by ``rate_factor`` (2 = twice as fast) and multiplied by ``time_scale``."""
    if rate_factor <= 0:
        raise ValueError("--request-rate must be > 0")
    if math.isinf(rate_factor):
        return [0.0] * len(rows)
    return [r.timestamp_s / rate_factor * time_scale for r in rows]


def poisson_arrivals(n: int, rate: float, time_scale: float, rng: np.random.Generator) -> list[float]:
    """Open-loop Poisson process of ``rate`` req/s (inf = all at t=0); the first request goes at 0."""
    if rate <= 0:
        raise ValueError("--request-rate must be > 0")
    if math.isinf(rate) or n == 0:
        return [0.0] * n
    gaps = rng.exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return [float(t) * time_scale for t in np.cumsum(gaps)]


def servegen_rate_series(path: Path, model: str | None, start: int, windows: int) -> tuple[str, list[float]]:
    """`windows` consecutive 10-minute request rates of `model` (None: the day-1 busiest) from window
    `start` on: the shape of a real load that changes over time."""
    if windows < 1 or start < 0:
        raise ValueError("--ramp-windows must be >= 1 and --ramp-start-window >= 0")
    name = model or servegen_day1_shares(path)[0][0]
    series: list[tuple[float, float]] = []
    with path.open(newline="") as handle:
        for rec in csv.DictReader(handle):
            if rec["model"] == name:
                series.append((float(rec["window_start_s"]), float(rec["total_rate_rps"])))
    if not series:
        raise ValueError(f"no ServeGen model {name!r} in {path}")
    rates = [r for _, r in sorted(series)][start:start + windows]
    if len(rates) < windows or max(rates) <= 0:
        raise ValueError(f"{name!r} has {len(series)} windows with traffic, {start + windows} needed")
    return name, rates


def ramp_arrivals(n: int, rates: Sequence[float], peak: float, window_s: float, time_scale: float,
                  rng: np.random.Generator) -> list[float]:
    """A Poisson process whose rate follows `rates` (one per `window_s` seconds, piecewise constant,
    repeated if `n` outlasts them), scaled so the busiest window runs at `peak` req/s. Unit-rate
    Poisson times are mapped through the inverse of the cumulative intensity."""
    if peak <= 0 or math.isinf(peak) or window_s <= 0:
        raise ValueError("--arrival ramp needs a finite --request-rate > 0 and --ramp-window-s > 0")
    scaled = [r / max(rates) * peak for r in rates]
    # Cumulative intensity each arrival must reach: 0 for the first (it goes at 0), then unit gaps.
    targets = np.cumsum(np.concatenate([[0.0], rng.exponential(1.0, size=max(0, n - 1))]))[:n]
    out: list[float] = []
    t = acc = 0.0  # time and cumulative intensity at the walk's position
    i = 0  # window index (wraps around the series)
    for target in targets:
        while True:
            lam, end = scaled[i % len(scaled)], (i + 1) * window_s
            if lam > 0 and acc + lam * (end - t) >= target:
                t += (target - acc) / lam
                acc = float(target)
                break
            acc += lam * (end - t)
            t, i = end, i + 1
        out.append(float(t) * time_scale)
    return out


def burst_arrivals(n: int, mean_rate: float, factor: float, burst_s: float, period_s: float, time_scale: float,
                   rng: np.random.Generator) -> list[float]:
    """Poisson arrivals whose rate is `factor` times higher for the first `burst_s` seconds of every
    `period_s`, with `mean_rate` req/s on average (so a rate sweep compares equal offered load)."""
    k = round(period_s / burst_s)
    if factor < 1 or burst_s <= 0 or k < 1 or abs(k * burst_s - period_s) > 1e-9:
        raise ValueError("--arrival burst needs --burst-factor >= 1 and --burst-period-s a multiple of --burst-s")
    quiet = mean_rate * k / (k - 1 + factor)
    return ramp_arrivals(n, [factor] + [1.0] * (k - 1), factor * quiet, burst_s, time_scale, rng)


# ----------------------------------------------------------------------------------------------- prompts


class PromptBuilder:
    """Random token-id prompts; hash blocks map deterministically to shared token blocks."""

    def __init__(self, vocab_size: int, min_token_id: int, seed: int, block_tokens: int) -> None:
        if not 0 <= min_token_id < vocab_size:
            raise ValueError("need 0 <= --min-token-id < --vocab-size")
        self.low, self.high, self.seed = min_token_id, vocab_size, seed
        self.block_tokens = max(1, block_tokens)
        self._blocks: dict[int, np.ndarray] = {}

    def _random(self, n: int, stream: int, key: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, stream, key])
        return rng.integers(self.low, self.high, size=n, dtype=np.int64)

    def block(self, hash_id: int) -> np.ndarray:
        if hash_id not in self._blocks:
            self._blocks[hash_id] = self._random(self.block_tokens, 1, hash_id)
        return self._blocks[hash_id]

    def build(self, row: TraceRow, index: int) -> list[int]:
        n = row.input_len
        parts: list[np.ndarray] = []
        have = 0
        for hash_id in row.hash_ids or ():
            if have >= n:
                break
            parts.append(self.block(hash_id))
            have += self.block_tokens
        if have < n:
            parts.append(self._random(n - have, 2, index))
        return np.concatenate(parts)[:n].tolist()


# -------------------------------------------------------------------------------------------- model mix


def servegen_day1_shares(path: Path) -> list[tuple[str, float]]:
    """Each model's share of all requests in the first 24 h (rate x window length), largest first."""
    totals: dict[str, float] = defaultdict(float)
    with path.open(newline="") as handle:
        for rec in csv.DictReader(handle):
            if float(rec["window_start_s"]) < DAY_S:
                totals[rec["model"]] += float(rec["total_rate_rps"]) * SERVEGEN_WINDOW_S
    grand = sum(totals.values())
    if grand <= 0:
        raise ValueError(f"no day-1 requests in {path}")
    return sorted(((m, v / grand) for m, v in totals.items()), key=lambda kv: -kv[1])


def resolve_model_weights(cfg: WorkloadConfig, traces_dir: Path) -> list[float]:
    """Normalised weights for ``cfg.models`` (uniform, explicit, or the ServeGen day-1 top-k shares)."""
    k = len(cfg.models)
    if cfg.model_weights is not None and cfg.servegen_skew:
        raise ValueError("use either --model-weights or --servegen-skew, not both")
    if cfg.servegen_skew:
        shares = servegen_day1_shares(traces_dir / SERVEGEN_RATES_FILE)
        if k > len(shares):
            raise ValueError(f"--servegen-skew has only {len(shares)} models, got {k}")
        raw = [s for _, s in shares[:k]]
    elif cfg.model_weights is not None:
        if len(cfg.model_weights) != k:
            raise ValueError("--model-weights needs one weight per --models entry")
        raw = list(cfg.model_weights)
    else:
        raw = [1.0] * k
    if any(w < 0 for w in raw) or sum(raw) <= 0:
        raise ValueError("model weights must be >= 0 with a positive sum")
    return [w / sum(raw) for w in raw]


def assign_models(
    n: int, models: Sequence[str], weights: Sequence[float], rng: np.random.Generator
) -> list[str | None]:
    if not models:
        return [None] * n
    picks = rng.choice(len(models), size=n, p=np.asarray(weights, dtype=float))
    return [models[int(i)] for i in picks]


# ---------------------------------------------------------------------------------------------- assembly


def resolve_arrival(cfg: WorkloadConfig) -> str:
    arrival = cfg.arrival or ("poisson" if cfg.trace == "synthetic" else "trace")
    if arrival not in ("trace", "poisson", "ramp", "burst"):
        raise ValueError(f"unknown arrival {arrival!r}")
    if arrival == "trace" and cfg.trace == "synthetic":
        raise ValueError("--trace synthetic has no timestamps: use --arrival poisson")
    return arrival


def load_rows(cfg: WorkloadConfig, rng: np.random.Generator) -> list[TraceRow]:
    if cfg.trace == "synthetic":
        return synthetic_rows(
            cfg.num_requests,
            cfg.synthetic_input_len,
            cfg.synthetic_output_len,
            cfg.synthetic_range_ratio,
            rng,
        )
    return load_trace(cfg.trace, cfg.traces_dir or default_traces_dir(), cfg.trace_offset, cfg.num_requests)


def schedule(
    cfg: WorkloadConfig, rows: Sequence[TraceRow], rng: np.random.Generator
) -> tuple[list[float], float]:
    """Arrival offsets and the effective rate parameter (trace factor, or Poisson req/s)."""
    if resolve_arrival(cfg) == "trace":
        rate = cfg.request_rate if cfg.request_rate is not None else 1.0
        return trace_arrivals(rows, rate, cfg.time_scale), rate
    rate = cfg.request_rate if cfg.request_rate is not None else (trace_mean_rate(rows) or 1.0)
    if resolve_arrival(cfg) == "ramp":
        _, rates = servegen_rate_series((cfg.traces_dir or default_traces_dir()) / SERVEGEN_RATES_FILE,
                                        cfg.ramp_model, cfg.ramp_start_window, cfg.ramp_windows)
        return ramp_arrivals(len(rows), rates, rate, cfg.ramp_window_s, cfg.time_scale, rng), rate
    if resolve_arrival(cfg) == "burst":
        return burst_arrivals(len(rows), rate, cfg.burst_factor, cfg.burst_s, cfg.burst_period_s, cfg.time_scale,
                              rng), rate
    return poisson_arrivals(len(rows), rate, cfg.time_scale, rng), rate


def build_requests(cfg: WorkloadConfig) -> tuple[list[RequestSpec], dict[str, object]]:
    """Materialise the workload; also return a description of it for the report."""
    if cfg.num_requests <= 0:
        raise ValueError("--num-requests must be > 0")
    traces_dir = cfg.traces_dir or default_traces_dir()
    rng = np.random.default_rng(cfg.seed)
    raw = load_rows(cfg, rng)
    rows = clip_lengths(raw, cfg.max_input_len, cfg.max_output_len, cfg.block_scale)
    arrivals, rate = schedule(cfg, raw, rng)
    weights = resolve_model_weights(cfg, traces_dir) if cfg.models else []
    models = assign_models(len(rows), cfg.models, weights, rng)
    block_tokens = max(1, round(MOONCAKE_BLOCK_TOKENS / cfg.block_scale))
    prompts = PromptBuilder(cfg.vocab_size, cfg.min_token_id, cfg.seed, block_tokens)
    specs = [
        RequestSpec(i, arrivals[i], prompts.build(r, i), r.output_len, models[i]) for i, r in enumerate(rows)
    ]
    info: dict[str, object] = {
        "arrival": resolve_arrival(cfg),
        "rate_parameter": rate,
        "trace_mean_rate_rps": trace_mean_rate(raw),
        "schedule_span_s": arrivals[-1] if arrivals else 0.0,
        "mean_input_len": float(np.mean([s.input_len for s in specs])),
        "mean_output_len": float(np.mean([s.output_len for s in specs])),
        "mean_trace_input_len": float(np.mean([r.input_len for r in raw])),
        "mean_trace_output_len": float(np.mean([r.output_len for r in raw])),
        "block_tokens": block_tokens if cfg.trace == "mooncake" else None,
        "model_weights": dict(zip(cfg.models, weights, strict=True)),
        "model_counts": {m: models.count(m) for m in cfg.models},
    }
    return specs, info
