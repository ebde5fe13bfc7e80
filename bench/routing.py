"""Routing policies compared: the same workload against a router with two replicas of one model, once per
policy (`--routing`), each on a fresh launcher (empty prefix caches, empty router index).

    python bench/routing.py --policies cache_aware,round_robin,shortest_queue \\
        --out bench/results/DATE-cpu-routing-mooncake.json -- \\
        --trace mooncake --trace-offset 1000 --num-requests 200 --block-scale 16 --max-input-len 512 \\
        --max-output-len 8 --arrival poisson --request-rate 2 --vocab-size 2048 --min-token-id 5

Everything after `--` is `bench/serving.py`'s (the workload; `--base-url` and warmup are set here).

A contiguous window of the Mooncake trace holds few turns of one conversation: they are minutes apart
(114 s median between a session's requests in its first 5,000 rows), so a window of a hundred requests has
almost none. `--sessions-from N` replays only the multi-turn sessions of the trace's first N rows instead:
the rows whose first two hash blocks another of those rows shares (consecutive requests of a session share
82 % of their blocks at the median), whole sessions in trace order, written as a trace file that
serving.py then reads (with `--trace mooncake`, `--trace-offset 0`), and compressed in time by the
arrival process serving.py is given.

The
launcher runs the embedded default model unless `--server-args` says otherwise (`--dp-size 2` replicas;
on CPU with `--device cpu --dtype float32`). Before each run both replicas get one unrelated warmup
request, so that neither starts cold and neither holds a prompt of the trace. The report has, per policy,
serving.py's metrics (TTFT, throughput, the prefix cache hit rate the workers report) and the router's
view (requests per replica, cache_aware's decisions); `--repeats N` runs the policies N times, in
alternating order, to expose drift on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # executed as ``python bench/routing.py``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp

from bench import serving
from bench.traces import repo_root

POLICIES = ("cache_aware", "round_robin", "shortest_queue", "prefix_affinity")
CPU_ARGS = "--device cpu --dtype float32"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default="cache_aware,round_robin,shortest_queue",
                   help=f"comma-separated, of {', '.join(POLICIES)}")
    p.add_argument("--run", action="append", default=[], metavar="LABEL=FLAGS",
                   help="one more run, named LABEL, with these launcher flags (e.g. 'ca_abs2=--routing cache_aware "
                        "--balance-abs-threshold 2'); repeatable")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--server-args", default=CPU_ARGS, help="more launcher flags, one string (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=1, help="run the policies this many times, alternating the order")
    p.add_argument("--out", type=Path, required=True, help="the combined JSON report")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--sessions-from", type=int, default=0,
                   help="replay only the multi-turn sessions among the trace's first N rows (0: off)")
    p.add_argument("serving_args", nargs=argparse.REMAINDER, help="-- then bench/serving.py's flags")
    return p


def session_trace(rows_from: int, out_dir: Path) -> tuple[Path, dict[str, Any]]:
    """The multi-turn sessions of the Mooncake trace's first `rows_from` rows, as a trace file in `out_dir`."""
    from bench.traces import TRACE_FILES, default_traces_dir

    name = TRACE_FILES["mooncake"]
    with (default_traces_dir() / name).open() as f:
        rows = [json.loads(line) for _, line in zip(range(rows_from), f, strict=False)]
    sessions: dict[tuple[int, ...], list[int]] = {}
    for i, r in enumerate(rows):
        if len(r["hash_ids"]) >= 2:
            sessions.setdefault(tuple(r["hash_ids"][:2]), []).append(i)
    keep = sorted(i for members in sessions.values() if len(members) > 1 for i in members)
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / name).open("w") as f:
        for i in keep:
            f.write(json.dumps(rows[i]) + "\n")
    return out_dir, {"rows_from": rows_from, "sessions": sum(len(m) > 1 for m in sessions.values()),
                     "rows": len(keep)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Launcher:
    """`python -m sglang_ext.launch` in its own process group, its output in a log file."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.log = log
        self._out = log.open("wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "sglang_ext.launch", *argv], cwd=repo_root(),
                                     stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._out.close()


async def get_json(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url) as r:
        r.raise_for_status()
        data: dict[str, Any] = await r.json()
        return data


async def wait_up(session: aiohttp.ClientSession, base: str, n: int, launcher: Launcher, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if launcher.proc.poll() is not None:
            raise RuntimeError(f"the launcher exited:\n{launcher.log.read_text(errors='replace')[-3000:]}")
        with contextlib.suppress(aiohttp.ClientError, OSError):
            info = await get_json(session, f"{base}/get_server_info")
            if sum(w["up"] for m in info["models"].values() for w in m["workers"]) >= n:
                return
        await asyncio.sleep(0.5)
    raise TimeoutError(f"{n} replicas not up after {timeout} s")


async def warm(session: aiohttp.ClientSession, base: str, n: int) -> None:
    """One request per replica, at once (so every policy spreads them), on prompts the trace never sends."""
    async def one(k: int) -> None:
        ids = [7 + (k * 131 + i * 17) % 1500 for i in range(96)]
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
        async with session.post(f"{base}/generate", json=body) as r:
            r.raise_for_status()
            await r.read()

    await asyncio.gather(*(one(k) for k in range(n)))


def router_view(info: dict[str, Any]) -> dict[str, Any]:
    (name, model), = info["models"].items()
    return {"served": {w["worker_id"]: w["num_served"] for w in model["workers"]},
            "routing": info.get("routing", {}).get(name, {})}


async def run_policy(policy: str, flags: list[str], args: argparse.Namespace, serving_argv: list[str],
                     logs: Path) -> dict[str, Any]:
    """One run, named `policy`, of a launcher with `flags` (its routing among them)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = ["--dp-size", str(args.replicas), *flags, "--port", str(port), "--log-level", "warning",
            *shlex.split(args.server_args)]
    launcher = Launcher(argv, logs / f"launcher-{policy}.log")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            await wait_up(session, base, args.replicas, launcher, args.startup_timeout)
            await warm(session, base, args.replicas)
            before = router_view(await get_json(session, f"{base}/get_server_info"))
            sargs = serving.build_parser().parse_args(
                [*serving_argv, "--base-url", base, "--warmup-requests", "0", "--disable-tqdm"])
            print(f"==> {policy}: {shlex.join(argv)}", flush=True)
            load_before = os.getloadavg()  # the machine may be shared: its load says how much
            report = await serving.run(sargs)
            load_after = os.getloadavg()
            after = router_view(await get_json(session, f"{base}/get_server_info"))
    finally:
        launcher.stop()
    served = {w: n - before["served"].get(w, 0) for w, n in after["served"].items()}
    return {"policy": policy, "launcher_argv": argv, "metrics": report["metrics"], "workload": report["workload"],
            "served_per_replica": served, "routing": after["routing"],
            "loadavg_1_5_15": {"before": load_before, "after": load_after}}


def summary_row(r: dict[str, Any]) -> str:
    m = r["metrics"]
    t = m["ttft_ms"]
    hit = m.get("prefix_cache_hit_rate")
    split = "/".join(str(v) for v in r["served_per_replica"].values())
    return (f"{r['policy']:<16}{m['completed']:>5}/{m['sent']:<5}{t['mean']:>9.0f}{t['median']:>9.0f}{t['p90']:>9.0f}"
            f"{t['p99']:>9.0f}{m['request_throughput_rps']:>8.2f}{m['output_throughput_tok_s']:>9.1f}"
            f"{(hit if hit is not None else float('nan')):>8.3f}  {split}")


def hardware() -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError):
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), "")
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in names if p not in POLICIES]
    if bad:
        raise SystemExit(f"unknown policies: {', '.join(bad)} (known: {', '.join(POLICIES)})")
    policies = [(p, ["--routing", p]) for p in names]
    for spec in args.run:
        label, sep, flags = spec.partition("=")
        if not sep or not label:
            raise SystemExit(f"--run wants LABEL=FLAGS, got {spec!r}")
        policies.append((label, shlex.split(flags)))
    serving_argv = [a for a in args.serving_args if a != "--"]
    logs = repo_root() / "bench" / "results" / "tmp" / f"{args.out.stem}.logs"  # git-ignored
    logs.mkdir(parents=True, exist_ok=True)
    sessions = None
    if args.sessions_from:
        traces_dir, sessions = session_trace(args.sessions_from, logs / "sessions")
        serving_argv += ["--traces-dir", str(traces_dir)]
    runs = []
    for k in range(args.repeats):
        for policy, flags in policies if k % 2 == 0 else policies[::-1]:
            runs.append({"repeat": k, **await run_policy(policy, flags, args, serving_argv, logs)})
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "hardware": hardware(),
            "commit": serving.git_commit(), "command": shlex.join([sys.executable, *sys.argv]),
            "replicas": args.replicas, "server_args": args.server_args, "serving_args": serving_argv,
            "sessions": sessions, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    report = asyncio.run(main_async(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str))
    print(f"\n{'policy':<16}{'ok/sent':^11}{'TTFT ms: mean':>14}{'median':>8}{'p90':>9}{'p99':>9}{'req/s':>8}"
          f"{'out tok/s':>9}{'hit':>8}  served per replica")
    for r in report["runs"]:
        print(summary_row(r))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
