"""Open-loop serving benchmark for the sglang_ext HTTP API (SGLang-native ``/generate`` or OpenAI).

Replays a real trace (Azure conversation/code, Mooncake with shared prefixes) or a synthetic workload,
at the trace's own times (optionally rescaled) or as a Poisson process, against one or several models,
and reports SGLang ``bench_serving``-style metrics plus SLO attainment.

Examples:
  python bench/serving.py --trace azure-conv --num-requests 100 --max-input-len 256 --max-output-len 32
  python -m bench.serving --trace mooncake --block-scale 16 --max-input-len 512 --max-output-len 32 \\
      --arrival poisson --request-rate 2 --ttft-slo 1 --tbt-slo 0.2 --output-json out.json --plot out.png
  python bench/serving.py --trace synthetic --models a,b,c --servegen-skew --backend openai

Every run is bounded: at most --num-requests requests, nothing is sent after --max-duration seconds and
requests still running then are cancelled (counted as failed), and each request has --request-timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # executed as ``python bench/serving.py``: make ``bench.*`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
from tqdm import tqdm

from bench import metrics as M
from bench.backends import BACKENDS, BackendConfig, check_base_url, send_request
from bench.provenance import CALL_ENV, COMMIT_ENV, DIRTY_ENV, git_commit, new_call_id, provenance  # noqa: F401 (serving.* for callers)
from bench.traces import (
    TRACE_CHOICES,
    RequestSpec,
    WorkloadConfig,
    build_requests,
    default_traces_dir,
)

CANCELLED = "cancelled: --max-duration reached"


# ------------------------------------------------------------------------------------------------- CLI


def _csv(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in _csv(text))


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--trace", choices=TRACE_CHOICES, default="synthetic")
    g.add_argument(
        "--traces-dir",
        type=Path,
        default=default_traces_dir(),
        help="directory with the trace files (default: bench/data/traces)",
    )
    g.add_argument("--trace-offset", type=int, default=0, help="skip this many trace rows first")
    g.add_argument(
        "--arrival",
        choices=("trace", "poisson", "ramp", "burst"),
        default=None,
        help="trace: the trace's own times; poisson: exponential gaps; ramp: Poisson whose rate follows a "
        "ServeGen model's 10-minute rates (--ramp-*), peaking at --request-rate; burst: Poisson at "
        "--burst-factor times the quiet rate for --burst-s of every --burst-period-s, --request-rate on "
        "average (default: trace, or poisson for --trace synthetic)",
    )
    g.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="poisson: requests/s ('inf' = all at once; default: the trace's mean rate, 1 for "
        "synthetic). trace: speed-up factor, arrival = trace time / R (default 1)",
    )
    g.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply every arrival offset by this (0.5 = twice as dense)",
    )
    g.add_argument("--num-requests", type=int, default=200)
    g.add_argument("--max-input-len", type=int, default=None, help="clip prompt lengths to this many tokens")
    g.add_argument("--max-output-len", type=int, default=None, help="clip output lengths to this")
    g.add_argument(
        "--block-scale",
        type=float,
        default=1.0,
        help="mooncake: divide input lengths and the 512-token hash block by this factor "
        "(e.g. 16 -> 32-token blocks) so prefix sharing survives small --max-input-len",
    )
    g.add_argument("--synthetic-input-len", type=int, default=128)
    g.add_argument("--synthetic-output-len", type=int, default=32)
    g.add_argument(
        "--synthetic-range-ratio",
        type=float,
        default=1.0,
        help="synthetic lengths uniform in [len*ratio, len]",
    )
    g.add_argument("--vocab-size", type=int, default=32_000, help="prompt token ids are < this")
    g.add_argument("--min-token-id", type=int, default=100, help="prompt token ids are >= this")
    g.add_argument("--models", type=_csv, default=(), help="comma-separated model names (sent as 'model')")
    g.add_argument("--model-weights", type=_floats, default=None, help="comma-separated request shares")
    g.add_argument(
        "--servegen-skew",
        action="store_true",
        help="weights = the top-k day-1 request shares of servegen_model_rates.csv, in order",
    )
    g.add_argument("--ramp-model", default=None, help="ramp: the ServeGen model whose rates to follow "
                   "(default: the day-1 busiest)")
    g.add_argument("--ramp-start-window", type=int, default=0, help="ramp: first 10-minute window")
    g.add_argument("--ramp-windows", type=int, default=12, help="ramp: how many windows")
    g.add_argument("--ramp-window-s", type=float, default=10.0, help="ramp: seconds each window lasts here")
    g.add_argument("--burst-factor", type=float, default=4.0, help="burst: rate in a burst / quiet rate")
    g.add_argument("--burst-s", type=float, default=5.0, help="burst: seconds a burst lasts")
    g.add_argument("--burst-period-s", type=float, default=30.0, help="burst: one burst every this many seconds")
    g.add_argument("--seed", type=int, default=0)


def _add_run_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target and limits")
    g.add_argument(
        "--backend",
        choices=BACKENDS,
        default="sglang",
        help="sglang: POST /generate with input_ids; openai: POST /v1/completions",
    )
    g.add_argument("--base-url", default="http://127.0.0.1:30000")
    g.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --base-url")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    g.add_argument(
        "--max-duration",
        type=float,
        default=600.0,
        help="wall-clock cap (s): no sends after it; unfinished requests are cancelled",
    )
    g.add_argument("--request-timeout", type=float, default=300.0, help="per-request timeout (s)")
    g.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="cap on in-flight requests (default: none, fully open loop)",
    )
    g.add_argument(
        "--warmup-requests",
        type=int,
        default=1,
        help="unmeasured requests per model before the run (0 = none)",
    )


def _add_output_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("SLOs and output")
    g.add_argument("--ttft-slo", type=float, default=None, help="TTFT SLO in seconds")
    g.add_argument(
        "--tbt-slo",
        type=float,
        default=None,
        help="TBT SLO in seconds, checked against each request's own --tbt-stat of its ITLs",
    )
    g.add_argument(
        "--tbt-stat",
        choices=("p99", "max", "mean"),
        default="p99",
        help="per-request TBT statistic for --tbt-slo (default p99 of that request's ITLs; mean = its TPOT)",
    )
    g.add_argument("--output-json", type=Path, default=None, help="write config + all metrics here")
    g.add_argument(
        "--call-id",
        default=None,
        help="id of the driver invocation this run belongs to, recorded in the report so a goodput panel can "
        "say which calls it merges (default: $SGLANG_EXT_CALL_ID, else a fresh id for this run alone)",
    )
    g.add_argument(
        "--peak-window-s",
        type=float,
        default=5.0,
        help="realized_peak_rps: the most requests sent within any window this long, per second",
    )
    g.add_argument("--output-details", action="store_true", help="include per-request records in the JSON")
    g.add_argument("--plot", type=Path, default=None, help="PNG with latency CDFs and throughput over time")
    g.add_argument("--disable-tqdm", action="store_true")
    g.add_argument("--dry-run", action="store_true", help="build and describe the workload, send nothing")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, epilog=M.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _add_workload_args(p)
    _add_run_args(p)
    _add_output_args(p)
    return p


def validate(args: argparse.Namespace) -> None:
    check_base_url(args.base_url, args.allow_remote)
    positive = {
        "--num-requests": args.num_requests,
        "--max-duration": args.max_duration,
        "--request-timeout": args.request_timeout,
        "--time-scale": args.time_scale,
        "--block-scale": args.block_scale,
        "--peak-window-s": args.peak_window_s,
    }
    for name, value in positive.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0")
    if args.max_concurrency is not None and args.max_concurrency <= 0:
        raise ValueError("--max-concurrency must be > 0")


def workload_config(args: argparse.Namespace) -> WorkloadConfig:
    return WorkloadConfig(
        trace=args.trace,
        traces_dir=args.traces_dir,
        arrival=args.arrival,
        request_rate=args.request_rate,
        time_scale=args.time_scale,
        num_requests=args.num_requests,
        trace_offset=args.trace_offset,
        max_input_len=args.max_input_len,
        max_output_len=args.max_output_len,
        block_scale=args.block_scale,
        synthetic_input_len=args.synthetic_input_len,
        synthetic_output_len=args.synthetic_output_len,
        synthetic_range_ratio=args.synthetic_range_ratio,
        vocab_size=args.vocab_size,
        min_token_id=args.min_token_id,
        models=args.models,
        model_weights=args.model_weights,
        servegen_skew=args.servegen_skew,
        ramp_model=args.ramp_model,
        ramp_start_window=args.ramp_start_window,
        ramp_windows=args.ramp_windows,
        ramp_window_s=args.ramp_window_s,
        burst_factor=args.burst_factor,
        burst_s=args.burst_s,
        burst_period_s=args.burst_period_s,
        seed=args.seed,
    )


# ---------------------------------------------------------------------------------------------- running


async def warmup(
    session: aiohttp.ClientSession, cfg: BackendConfig, specs: list[RequestSpec], n: int
) -> None:
    """``n`` short unmeasured requests per model; raises if one fails (wrong URL, unknown model...)."""
    for model in dict.fromkeys(s.model for s in specs):
        base = next(s for s in specs if s.model == model)
        for _ in range(n):
            spec = RequestSpec(-1, 0.0, base.input_ids[::-1][:64], min(base.output_len, 8), model)
            result = M.RequestResult(-1, model, spec.input_len, spec.output_len, 0.0)
            await send_request(session, cfg, spec, result, time.perf_counter())
            if not result.success:
                raise RuntimeError(f"warmup request (model={model}) failed: {result.error}")


async def _run_one(
    session: aiohttp.ClientSession,
    cfg: BackendConfig,
    spec: RequestSpec,
    result: M.RequestResult,
    t0: float,
    sem: asyncio.Semaphore | None,
) -> None:
    try:
        if sem is None:
            await send_request(session, cfg, spec, result, t0)
        else:
            async with sem:
                await send_request(session, cfg, spec, result, t0)
    except asyncio.CancelledError:
        result.success, result.error = False, CANCELLED
        raise


async def dispatch(
    session: aiohttp.ClientSession, cfg: BackendConfig, specs: list[RequestSpec], args: argparse.Namespace
) -> tuple[list[M.RequestResult], float]:
    """Send every request at its scheduled offset (open loop) and wait, within --max-duration."""
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    bar = tqdm(total=len(specs), disable=args.disable_tqdm, unit="req", desc="requests")
    results: list[M.RequestResult] = []
    tasks: list[asyncio.Task[None]] = []
    t0 = time.perf_counter()
    for spec in specs:
        if spec.arrival_s >= args.max_duration:
            break
        delay = t0 + spec.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        result = M.RequestResult(spec.index, spec.model, spec.input_len, spec.output_len, spec.arrival_s)
        results.append(result)
        task = asyncio.create_task(_run_one(session, cfg, spec, result, t0, sem))
        task.add_done_callback(lambda _t: bar.update(1))
        tasks.append(task)
    bar.total = len(tasks)
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, t0 + args.max_duration - time.perf_counter()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    duration = time.perf_counter() - t0
    bar.close()
    return results, duration


# ---------------------------------------------------------------------------------------------- reports


def public_config(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed options, with the API key redacted."""
    return {**vars(args), "api_key": "<redacted>" if args.api_key else None}


def redact_argv(argv: list[str]) -> list[str]:
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--api-key" and i + 1 < len(out):
            out[i + 1] = "<redacted>"
        elif arg.startswith("--api-key="):
            out[i] = "--api-key=<redacted>"
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def build_report(
    args: argparse.Namespace,
    info: dict[str, object],
    results: list[M.RequestResult],
    duration: float,
    n_scheduled: int,
) -> dict[str, Any]:
    slo = M.SloConfig(args.ttft_slo, args.tbt_slo, args.tbt_stat)
    sends = [r.send_s if r.send_s is not None else r.scheduled_s for r in results]
    report: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **provenance(args.call_id),
        "command": redact_argv(sys.argv),
        "config": public_config(args),
        "workload": {**info, "scheduled": n_scheduled, "not_sent": n_scheduled - len(results),
                     **M.realized_rates(sends, args.peak_window_s)},
        "metrics": M.compute_metrics(results, duration, slo),
        "per_model": M.per_model_metrics(results, duration, slo) if len(args.models) > 1 else {},
        "errors": M.error_counts(results),
        "slo_records": M.slo_records(results),  # bench/goodput.py scores them against other SLOs
        "timeline": M.timeline(results, duration),
        "slo_timeline": M.slo_timeline(results, duration, slo),
    }
    if args.output_details:
        report["requests"] = [r.to_dict() for r in results]
    return _jsonable(report)


def _title(report: dict[str, Any], args: argparse.Namespace) -> str:
    work = report["workload"]
    return f"{args.backend} | {args.trace} | {work['arrival']} R={work['rate_parameter']}"


def print_report(report: dict[str, Any], args: argparse.Namespace) -> None:
    print(M.format_summary(report["metrics"], _title(report, args)))
    for model, m in report["per_model"].items():
        print(M.format_summary(m, f"model {model}"))
    for error, count in report["errors"].items():
        print(f"  {count} x {error}")


def write_outputs(report: dict[str, Any], results: list[M.RequestResult], args: argparse.Namespace) -> None:
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
        print(f"wrote {args.output_json}")
    if args.plot:
        from bench.plots import plot_results

        plot_results(results, report["timeline"], args.plot, _title(report, args))
        print(f"wrote {args.plot}")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the workload, run it, print and write the report, and return it."""
    validate(args)
    specs, info = build_requests(workload_config(args))
    if args.dry_run:
        report = _jsonable({"config": public_config(args), "workload": {**info, "scheduled": len(specs)}})
        print(json.dumps(report["workload"], indent=2))
        return report
    cfg = BackendConfig(args.backend, args.base_url, args.api_key, args.request_timeout)
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0)
    async with aiohttp.ClientSession(connector=connector) as session:
        if args.warmup_requests > 0:
            warm_cfg = BackendConfig(
                cfg.backend, cfg.base_url, cfg.api_key, min(cfg.request_timeout_s, args.max_duration)
            )
            await warmup(session, warm_cfg, specs, args.warmup_requests)
        results, duration = await dispatch(session, cfg, specs, args)
    report = build_report(args, info, results, duration, len(specs))
    print_report(report, args)
    write_outputs(report, results, args)
    return report


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        report = asyncio.run(run(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0 if args.dry_run or report["metrics"]["completed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
