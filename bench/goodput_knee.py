"""Knee search for goodput: per run (POLICY-MODE, as bench/goodput_sweep.sh, or POLICY-MODE.VARIANT), a coarse
rate grid, then bisection between the last passing and the first failing rate until they are within 10 % of
each other.

  python bench/goodput_knee.py --runs fcfs-recompute lvf-rotate --share 0.25 --grid 6 7 8 --repeats 3 \
      --budget-s 500 --out /tmp/out/knee
  python bench/goodput_knee.py --runs fcfs-recompute fcfs-recompute.fixed \
      --variant fixed="--offload-executor local --offload-ratio 0.5 --executor-mem-gb 7" ...

Run variants: `--variant NAME="LAUNCHER ARGS"` (repeatable; NAME letters, digits and _; the args split as a
shell would) names extra launcher flags, and a run POLICY-MODE.NAME is POLICY-MODE's server plus them (after
every --server-arg, so a variant's flag wins). It is one more run of the call: the same rows, plan, repeats,
budget share, union rule, --resume and reports (gp_POLICY-MODE.NAME_r<rate>_k<k>.json); knee.json records
each variant's args and each run's launcher flags, goodput.txt lists them under the table. So "off" and
"fixed" offload (both fcfs-recompute) compare in one call on the same rows.

Method (docs/benchmarks.md, "Method"):
- A point (run, rate) is REPEATS serving.py runs of n = max(MIN_REQ, rate x SECONDS) requests each.
  Repeat k replays trace rows from offset k x stride (stride = n at the highest rate the search can
  reach, so repeats never share rows) with arrival seed k: the same rows and arrival times for every
  run at a given rate and repeat. The server's prefix cache is flushed (POST /flush_cache) before each
  repeat, so rows replayed at another rate do not hit the cache.
- A point passes when the mean both-SLO attainment over its repeats is >= --target (0.9). A run's
  bracket is (lo, hi): hi its lowest failing rate, lo its highest rate below hi (every rate below hi
  passed, so lo is its strict goodput). Its next point is, in order: the lowest unmeasured rate below hi
  among the grid and every rate another run measured (the union rule: a point is run for every run
  whose strict goodput it can still change, i.e. below that run's first failing rate; points above it
  cannot change it and are skipped); when every rate passed, up to --extend more grid steps above the
  top; else the midpoint of (lo, hi) while hi > lo x 1.1. A run whose lowest rate fails stops there
  ("< lowest"); one whose every rate passed is a lower bound (">= top").
- Runs go one after another, one server each (the flags of goodput_sweep.sh), each given an equal share
  of the budget left; a pass ends when every run had its turn. Later passes restart a run's server only
  to run points other runs added since (the union rule), while the budget allows. A point is started
  only when its estimate (learned from the points so far) fits its run's share, or for a turn's first
  point the call's deadline (a low-rate point can outlast any share); the budget stops the search cleanly
  and knee.json says, per run, where it stopped and what it would have run next, and where a resumed
  call begins (resume_at: the first run left without a point, else the first turn cut short).
- Out: every serving report (gp_<run>_r<rate>_k<repeat>.json, with its log), server logs and rotation
  metrics, knee.json (the plan, the offsets, per run its curve, bracket, status; rewritten after each
  point, so a killed call still leaves it), and bench/goodput.py's table (goodput.txt, goodput.json,
  goodput.png).
- --resume PREV_DIR (bench/knee_resume.py): continue an earlier call's search where it stopped, in a new
  folder, with the same flags (a plan that differs is refused, naming the field); its points are not
  rerun, its reports are copied, and knee.json and goodput.txt list the calls merged.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple, Protocol

if __package__ in (None, ""):  # executed as ``python bench/goodput_knee.py``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import goodput as G
from bench import knee_resume as R
from bench import serving
from bench.step_profile import POINT_MARK
from bench.traces import TRACE_CHOICES, default_traces_dir, repo_root
from bench.warm import prompt_lengths

MIN_REQ = 150  # requests per point and repeat: one request is then at most 0.67 points of attainment
RUN = re.compile(r"^(?P<policy>[a-z0-9_]+)-(?P<mode>[a-z0-9_]+)(?:\.(?P<variant>[A-Za-z0-9_]+))?$")
VARIANT_NAME = re.compile(r"^[A-Za-z0-9_]+$")
TOLERANCE = 0.10  # bisect until the first failing rate is within 10 % of the last passing one


# ---------------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Plan:
    """What every point of one call shares; offsets depend on the repeat alone, never on the run."""

    grid: tuple[float, ...]
    repeats: int = 3
    seconds: float = 30.0
    min_req: int = MIN_REQ
    target: float = 0.9
    tolerance: float = TOLERANCE
    extend: int = 1

    def __post_init__(self) -> None:
        if not self.grid or any(r <= 0 for r in self.grid):
            raise ValueError("--grid needs at least one rate, every rate > 0")
        if self.repeats < 1 or self.min_req < 1 or self.seconds <= 0 or self.extend < 0:
            raise ValueError("--repeats, --min-req and --seconds must be > 0, --extend >= 0")

    @property
    def rates(self) -> tuple[float, ...]:
        return tuple(sorted(set(self.grid)))

    def extension(self) -> tuple[float, ...]:
        """The rates above the grid tried when every grid rate passed, one grid step apart."""
        rates = self.rates
        step = rates[-1] - rates[-2] if len(rates) > 1 else rates[-1] / 2
        return tuple(round(rates[-1] + i * step, 3) for i in range(1, self.extend + 1))

    def n(self, rate: float) -> int:
        return max(self.min_req, math.ceil(round(rate * self.seconds, 6)))

    @property
    def stride(self) -> int:
        """Trace rows between repeats: n at the highest rate the search can reach (bisection stays below it)."""
        return self.n(max((*self.rates, *self.extension())))

    def offset(self, repeat: int) -> int:
        return repeat * self.stride


def bracket(curve: dict[float, float], target: float) -> tuple[float | None, float | None]:
    """(lo, hi): hi the lowest failing rate (None: none failed), lo the highest rate below it (None: the
    lowest rate failed, or nothing measured). Every measured rate below hi passed, so lo is the strict goodput."""
    rates = sorted(curve)
    hi = next((r for r in rates if not G.at_target(curve[r], target)), None)
    below = [r for r in rates if hi is None or r < hi]
    return (below[-1] if below else None), hi


def midpoint(lo: float, hi: float) -> float:
    return round((lo + hi) / 2, 3)


def next_rate(curve: dict[float, float], others: Sequence[float], plan: Plan) -> float | None:
    """The next rate to measure for a run with `curve` (rate -> mean attainment), `others` the rates other
    runs measured; None when its goodput is settled (to the tolerance, or as a bound)."""
    lo, hi = bracket(curve, plan.target)
    todo = sorted(r for r in {*plan.rates, *others} if r not in curve and (hi is None or r < hi))
    if todo:
        return todo[0]
    if hi is None:
        return next((r for r in plan.extension() if r not in curve), None)
    if lo is None or hi <= lo * (1 + plan.tolerance):
        return None
    mid = midpoint(lo, hi)
    return None if mid in (lo, hi) else mid


def status(curve: dict[float, float], others: Sequence[float], plan: Plan) -> str:
    lo, hi = bracket(curve, plan.target)
    if not curve:
        return "not run"
    if next_rate(curve, others, plan) is not None:
        return "stopped by the budget"
    if lo is None:
        return "below the lowest rate"
    if hi is None:
        return "lower bound (every rate passed)"
    return "converged"


# ---------------------------------------------------------------------------------------------- the search


class Executor(Protocol):
    """Runs points for the search: a real server and serving.py, or a synthetic function in tests."""

    def start(self, run: str) -> None: ...

    def stop(self, run: str) -> None: ...

    def measure(self, run: str, rate: float) -> float:
        """Mean both-SLO attainment over the plan's repeats at `rate`."""
        ...


@dataclass
class Estimator:
    """Seconds a server start (the last one seen) and a point (the largest overhead seen) take."""

    plan: Plan
    start_s: float = 60.0
    overhead_s: float = 15.0  # per repeat, beyond the arrivals: warmup, drain, flush

    def point(self, rate: float) -> float:
        return self.plan.repeats * (self.plan.n(rate) / rate + self.overhead_s)

    def saw_start(self, seconds: float) -> None:
        self.start_s = seconds

    def saw_point(self, rate: float, seconds: float) -> None:
        self.overhead_s = max(self.overhead_s, seconds / self.plan.repeats - self.plan.n(rate) / rate)


@dataclass
class RunState:
    curve: dict[float, float] = field(default_factory=dict)
    order: list[dict[str, Any]] = field(default_factory=list)  # rate, attainment, seconds, call, in order
    error: str | None = None


@dataclass
class Cursor:
    """Where a search stands: pass `pass_no`, turn `index` of that pass's runs `todo` (None: a pass not begun,
    its runs are those with a point pending then). A resumed call starts there (``--resume``)."""

    pass_no: int = 0
    todo: list[str] | None = None
    index: int = 0


@dataclass
class Search:
    plan: Plan
    runs: list[str]
    executor: Executor
    budget_s: float
    clock: Callable[[], float] = time.monotonic
    estimator: Estimator | None = None
    max_passes: int = 3
    on_point: Callable[[Search], None] | None = None
    state: dict[str, RunState] = field(default_factory=dict)  # preloaded by --resume: the points measured before
    start_at: Cursor = field(default_factory=Cursor)  # preloaded by --resume: where the earlier call stopped
    call_id: str | None = None  # tags each point this call measures (knee.json's order, per call)
    first: str | None = None  # --first: this run takes the call's first turn (its pass's other turns follow)
    stopped: str = "running"
    elapsed_s: float = 0.0
    budget_hit: bool = False
    at: Cursor = field(default_factory=Cursor)  # the turn in progress (the pass after the last one, at the end)
    cut: Cursor | None = None  # the first turn the budget cut short
    starved: Cursor | None = None  # the first turn the budget left without a point

    @property
    def resume_at(self) -> Cursor:
        """Where a resumed call goes on: the first run this call gave no point to (a long point may take
        a whole call, see _turn), else the first turn the budget cut short, else after the last pass."""
        return self.starved or self.cut or self.at

    def others(self, run: str) -> list[float]:
        return sorted({r for name, s in self.state.items() if name != run for r in s.curve})

    def pending(self, run: str) -> float | None:
        s = self.state[run]
        return None if s.error else next_rate(s.curve, self.others(run), self.plan)

    def run(self) -> Search:
        est = self.estimator = self.estimator or Estimator(self.plan)
        t0 = self.clock()
        deadline = t0 + self.budget_s
        self.state = {r: self.state.get(r) or RunState() for r in self.runs}
        p, todo, first = self.start_at.pass_no, self.start_at.todo, self.start_at.index
        while p < self.max_passes:
            if todo is None:
                todo = [r for r in self.runs if self.pending(r) is not None]
                if not todo:
                    break
            if self.first in todo[first:]:  # only the call's first pass: later passes keep the runs' order
                todo = [*todo[:first], self.first, *(r for r in todo[first:] if r != self.first)]
            self.first = None
            for i in range(first, len(todo)):
                self.at = Cursor(p, list(todo), i)
                share_end = self.clock() + (deadline - self.clock()) / (len(todo) - i)
                self._turn(todo[i], share_end, deadline, est)
            p, todo, first = p + 1, None, 0
        self.at = Cursor(p)
        self.elapsed_s = self.clock() - t0
        left = [r for r in self.runs if self.pending(r) is not None]
        self.stopped = ("budget" if self.budget_hit else "max passes") if left else "settled"
        if self.on_point:
            self.on_point(self)
        return self

    def _turn(self, run: str, share_end: float, deadline: float, est: Estimator) -> None:
        s, started = self.state[run], False
        try:
            while (rate := self.pending(run)) is not None:
                # A turn's first point may run past its equal share up to the deadline: at low rates one
                # point (3 x 150 requests at 1.4 req/s, ~6 min) is longer than any share of a 9-minute
                # call, and would otherwise never start. The runs after it are then cut, and the next
                # call (--resume) begins with them.
                end = share_end if started else deadline
                if self.clock() + est.point(rate) + (0 if started else est.start_s) > end:
                    self.budget_hit = True
                    self.cut = self.cut or self.at
                    if not started:
                        self.starved = self.starved or self.at
                    return
                if not started:
                    t = self.clock()
                    self.executor.start(run)
                    started = True
                    est.saw_start(self.clock() - t)
                t = self.clock()
                s.curve[rate] = self.executor.measure(run, rate)
                seconds = self.clock() - t
                est.saw_point(rate, seconds)
                s.order.append({"rate": rate, "attainment": s.curve[rate], "seconds": round(seconds, 1),
                                **({"call": self.call_id} if self.call_id else {})})
                if self.on_point:
                    self.on_point(self)
        except Exception as exc:  # a server that died: this run stops, the others go on
            s.error = f"{type(exc).__name__}: {exc}"[:500]
        finally:
            if started:
                with contextlib.suppress(Exception):
                    self.executor.stop(run)

    def summary(self) -> dict[str, Any]:
        runs = {}
        for run, s in self.state.items():
            lo, hi = bracket(s.curve, self.plan.target)
            others = self.others(run)
            g = G.strict_goodput(list(s.curve.items()), self.plan.target)
            runs[run] = {"status": "error: " + s.error if s.error else status(s.curve, others, self.plan),
                         "goodput_rps": g.rate, "goodput_text": g.text(), "goodput_lower_bound": g.lower_bound,
                         "last_passing": lo, "first_failing": hi, "next_rate": self.pending(run),
                         "curve": {f"{r:g}": a for r, a in sorted(s.curve.items())}, "order": s.order}
        est = self.estimator or Estimator(self.plan)
        return {"stopped": self.stopped, "elapsed_s": round(self.elapsed_s, 1), "budget_s": self.budget_s,
                "resume_at": asdict(self.resume_at),
                "estimator": {"start_s": round(est.start_s, 1), "overhead_s": round(est.overhead_s, 1)},
                "runs": runs}


# ---------------------------------------------------------------------------------------------- real points


def label(run: str, arrival: str) -> str:
    return run if arrival == "poisson" else f"{run}-{arrival}"  # burst reports: gp_<run>-burst_r<rate>_k<k>.json


def report_name(run: str, arrival: str, rate: float, repeat: int) -> str:
    return f"gp_{label(run, arrival)}_r{rate:g}_k{repeat}.json"


def serving_argv(a: argparse.Namespace, plan: Plan, run: str, rate: float, repeat: int, base_url: str,
                 out: Path, call_id: str) -> list[str]:
    """serving.py's arguments for one repeat of one point: rows, seed and arrivals depend on (rate,
    repeat) alone, so every run replays the same requests there. --max-duration is the arrival span plus
    the longest a request sent last could take and still meet both SLOs (later finishes are misses anyway)."""
    n = plan.n(rate)
    cap = n / rate + a.ttft + a.tpot * a.max_out + 15
    return ["--trace", a.trace, "--traces-dir", str(a.traces_dir), "--num-requests", str(n),
            "--trace-offset", str(plan.offset(repeat)), "--seed", str(repeat), "--arrival", a.arrival,
            "--request-rate", f"{rate:g}", "--max-input-len", str(a.max_in), "--max-output-len", str(a.max_out),
            "--ttft-slo", f"{a.ttft:g}", "--tbt-slo", f"{a.tpot:g}", "--tbt-stat", "mean",
            "--vocab-size", str(a.vocab_size), "--base-url", base_url, "--max-duration", f"{cap:.0f}",
            "--disable-tqdm", "--call-id", call_id,
            "--output-json", str(out / report_name(run, a.arrival, rate, repeat))]


class Run(NamedTuple):
    policy: str
    mode: str
    variant: str | None  # a --variant's name: its launcher args on top of POLICY-MODE's


def parse_run(run: str) -> Run:
    """POLICY-MODE or POLICY-MODE.VARIANT; ValueError naming --runs otherwise."""
    m = RUN.match(run)
    if m is None:
        raise ValueError(f"--runs: {run!r} is not POLICY-MODE or POLICY-MODE.VARIANT (e.g. lvf-rotate, "
                         "fcfs-recompute.fixed)")
    return Run(m["policy"], m["mode"], m["variant"])


def parse_variants(specs: Sequence[str]) -> dict[str, list[str]]:
    """--variant NAME=ARGS, each ARGS split as a shell would; ValueError naming --variant."""
    out: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, rest = spec.partition("=")
        if not sep or not VARIANT_NAME.match(name):
            raise ValueError(f"--variant {spec!r}: give NAME=\"LAUNCHER ARGS\", NAME letters, digits and _")
        if name in out:
            raise ValueError(f"--variant {name}: defined twice")
        try:
            args = shlex.split(rest)
        except ValueError as e:
            raise ValueError(f"--variant {name}: cannot split its args ({e})") from e
        if not args:
            raise ValueError(f"--variant {name}: no launcher args")
        out[name] = args
    return out


def check_runs(runs: Sequence[str], variants: dict[str, list[str]]) -> None:
    """Every run well formed, named once, its variant defined; every variant used by a run."""
    seen = set()
    for run in runs:
        v = parse_run(run).variant
        if v is not None and v not in variants:
            raise ValueError(f"--runs: {run!r} names variant {v!r}, which no --variant defines")
        if run in seen:
            raise ValueError(f"--runs: {run!r} given twice")
        seen.add(run)
    unused = sorted(set(variants) - {parse_run(r).variant for r in runs})
    if unused:
        raise ValueError(f"--variant {unused[0]}: no run uses it (a run POLICY-MODE.{unused[0]})")


def extra_args(a: argparse.Namespace, run: str) -> list[str]:
    """The launcher args a run adds to POLICY-MODE's: every --server-arg, then its variant's."""
    v = parse_run(run).variant
    return [*a.server_arg, *(parse_variants(a.variant)[v] if v is not None else [])]


def routing_warning(model: str, servers: dict[str, list[str]]) -> str | None:
    """A warning when an MoE model is served (on dummy weights, as every knee search serves it) by a run
    without --moe-routing-simulation uniform: the dummy router's own choice made Qwen3-30B-A3B's decode
    steps >= 1.5x cheaper than a trained router's spread (docs/benchmarks.md, 2026-12-06)."""
    if not model:
        return None
    try:
        from sglang_ext.models.config import ModelConfig
        from sglang_ext.models.resolve import resolve_model_path

        if ModelConfig.from_path(resolve_model_path(model)).moe is None:
            return None
    except (OSError, ValueError, KeyError):
        return None  # the server names a model it cannot read at its start
    plain = [run for run, argv in servers.items()
             if "--moe-routing-simulation=uniform" not in argv
             and ("--moe-routing-simulation", "uniform") not in itertools.pairwise(argv)]
    if not plain:
        return None
    return (f"MoE model {model} on dummy weights without --moe-routing-simulation uniform ({', '.join(plain)}): "
            "the dummy router's own choice made decode >= 1.5x cheaper than a trained router would; not an "
            "MoE-realistic result (SERVER_ARGS=\"--moe-routing-simulation=uniform\")")


def server_argv(a: argparse.Namespace, run: str) -> list[str]:
    """The launcher flags of bench/goodput_sweep.sh for POLICY-MODE, then --server-arg's and the variant's."""
    pol, mode, _ = parse_run(run)
    model = ["--model-path", a.model, "--load-format", "dummy"] if a.model else []
    share = ["--mem-fraction-static", f"{a.share:g}"] if a.share > 0 else []
    host = ["--kv-host-size-gb", f"{a.host_gb:g}"] if mode == "rotate" else []
    # the step profile is a measurement, not a setting: a resumed search may add it (knee_resume skips it)
    steps = ["--step-log-interval-s", f"{a.step_log_s:g}"] if a.step_log_s > 0 else []
    return [*model, "--device", a.device, "--dtype", a.dtype, "--port", str(a.port), *share,
            "--schedule-policy", pol, "--preemption-mode", mode, "--ttft-slo-ms", f"{a.ttft * 1000:g}",
            "--tpot-slo-ms", f"{a.tpot * 1000:g}", *host, *steps, *extra_args(a, run)]


def _http(url: str, method: str = "GET", timeout: float = 5.0, body: dict[str, Any] | None = None
          ) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    req = urllib.request.Request(url, method=method, data=data,
                                 headers={"Content-Type": "application/json"} if body is not None else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


class ServerExecutor:
    """One server per run (python -m sglang_ext.launch on 127.0.0.1), points through serving.py in process."""

    def __init__(self, a: argparse.Namespace, plan: Plan, out: Path, call_id: str) -> None:
        self.a, self.plan, self.out, self.call_id = a, plan, out, call_id
        self.url = f"http://127.0.0.1:{a.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.flush_refused = 0

    def start(self, run: str) -> None:
        log = open(self.out / f"gp_server_{label(run, self.a.arrival)}.log", "ab")  # noqa: SIM115 - the child's
        self.proc = subprocess.Popen([sys.executable, "-m", "sglang_ext.launch", *server_argv(self.a, run)],
                                     cwd=repo_root(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        log.close()
        deadline = time.monotonic() + self.a.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.proc = None
                raise RuntimeError(f"server for {run} exited early (see its log)")
            with contextlib.suppress(OSError):
                if _http(self.url + "/health", timeout=2)[0] == 200:
                    try:
                        self.warm(run)
                    except (OSError, ValueError):  # a server that cannot serve its warm-up: this run fails
                        self._kill()
                        raise RuntimeError(f"server for {run} failed its warm-up (see its log)") from None
                    return
            time.sleep(1)
        self._kill()
        raise TimeoutError(f"server for {run} not healthy after {self.a.start_timeout_s:g} s")

    def warm(self, run: str) -> None:
        """Unmeasured prompts of every doubling of length up to --max-in, one at a time, before the run's
        first point: what a server pays on first use (a kernel its flags select that gpu_session.sh's `warm`
        did not compile, first allocations) lands here, not in a timed repeat. On 2026-12-06 (session 6)
        the call's first timed repeat ran its first ~14 s of prefills 2-5x slow and collapsed."""
        if not self.a.server_warmup:
            return
        self.mark(run, "warm-up")
        t0 = time.monotonic()
        lengths = [*prompt_lengths(self.a.max_in)[:-1], self.a.max_in]  # warm.py's doublings, then --max-in
        for i, n in enumerate(lengths):
            ids = [100 + (7 * j + i) % (self.a.vocab_size - 100) for j in range(n)]
            code, text = _http(self.url + "/generate", "POST", self.a.start_timeout_s,
                               {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})
            if code != 200:
                raise OSError(f"warm-up prompt of {n} tokens: HTTP {code}: {text[:200]}")
        self.flush()
        print(f"{label(run, self.a.arrival)}: server warmed with {len(lengths)} prompts of 1-{self.a.max_in} tokens "
              f"in {time.monotonic() - t0:.1f} s", flush=True)

    def mark(self, run: str, what: str) -> None:
        """A line in the server's log between its step-profile lines: which point they belong to."""
        with open(self.out / f"gp_server_{label(run, self.a.arrival)}.log", "a") as f:
            f.write(f"{POINT_MARK} {what}\n")

    def _kill(self) -> None:
        """SIGINT to the server's process group (a clean shutdown), SIGKILL after 10 s."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def flush(self) -> None:
        """Empty the prefix cache; refused while requests still run (cancelled ones draining): retry."""
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError):
                if _http(self.url + "/flush_cache", "POST", timeout=10)[0] == 200:
                    return
            if time.monotonic() > deadline:
                self.flush_refused += 1
                print(f"warning: /flush_cache refused for 60 s at {self.url}", file=sys.stderr)
                return
            time.sleep(0.5)

    def measure(self, run: str, rate: float) -> float:
        scores = []
        for k in range(self.plan.repeats):
            self.flush()
            argv = serving_argv(self.a, self.plan, run, rate, k, self.url, self.out, self.call_id)
            log = self.out / report_name(run, self.a.arrival, rate, k).replace(".json", ".log")
            self.mark(run, f"begins {rate:g} {k}")
            with open(log, "w") as f, contextlib.redirect_stdout(f):
                report = asyncio.run(serving.run(serving.build_parser().parse_args(argv)))
            self.mark(run, f"ends {rate:g} {k}")
            scores.append(G.point_from_report(run, rate, report).attainment)
            print(f"{label(run, self.a.arrival)} rate {rate:g} repeat {k}: {scores[-1]:.1%} of "
                  f"{self.plan.n(rate)} met both SLOs", flush=True)
        return sum(scores) / len(scores)

    def stop(self, run: str) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(OSError):
            text = _http(self.url + "/metrics", timeout=10)[1]
            keep = [ln for ln in text.splitlines() if ln.startswith(("sglang_ext:kv_rot", "sglang_ext:rotary",
                                                                       "sglang_ext:num_preempt", "sglang_ext:offload"))]
            with open(self.out / f"gp_metrics_{label(run, self.a.arrival)}.txt", "a") as f:  # one block per server
                f.write(f"# {time.strftime('%H:%M:%S')}\n" + "\n".join(keep) + "\n")
        self._kill()


# ---------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", default=["fcfs-recompute", "lvf-rotate"],
                   help="POLICY-MODE runs, or POLICY-MODE.VARIANT (that server plus the --variant's args)")
    p.add_argument("--grid", nargs="+", type=float, default=[4.0, 6.0, 8.0], help="coarse rates (req/s)")
    p.add_argument("--repeats", type=int, default=3, help="repeats per point, each at its own trace offset")
    p.add_argument("--seconds", type=float, default=30.0, help="n = max(MIN_REQ, rate x SECONDS) per repeat")
    p.add_argument("--min-req", type=int, default=MIN_REQ, help=f"requests per repeat at least ({MIN_REQ}; "
                   "lower only for tests: the report says so)")
    p.add_argument("--target", type=float, default=0.9, help="mean both-SLO attainment that passes")
    p.add_argument("--extend", type=int, default=1, help="grid steps tried above the top when it passes")
    p.add_argument("--budget-s", type=float, default=540.0, help="stop the search cleanly after this long")
    p.add_argument("--max-passes", type=int, default=3, help="turns per run (later ones only add others' points)")
    p.add_argument("--est-start-s", type=float, default=None, metavar="S",
                   help="the first guess of a server start's seconds (default: a resumed call's, else "
                        f"{Estimator.start_s:g}); a point starts only if its estimate fits what is left")
    p.add_argument("--est-overhead-s", type=float, default=None, metavar="S",
                   help="the first guess of a repeat's seconds beyond its arrivals (default: a resumed call's, "
                        f"else {Estimator.overhead_s:g}); the search raises it to the largest it sees")
    p.add_argument("--out", type=Path, default=Path("/tmp/out/knee"), help="folder for every report")
    p.add_argument("--resume", type=Path, default=None, metavar="PREV_DIR",
                   help="continue the search of an earlier call's --out folder (the same flags; its reports are "
                        "copied here, its points not rerun): one folder, the latest call's")
    p.add_argument("--first", default=None, metavar="RUN",
                   help="give RUN (one of --runs) this call's first turn, e.g. the point a short call should not "
                        "miss; the other runs of that pass follow in order. Not part of the plan: a resumed call "
                        "may set it")
    p.add_argument("--call-id", default=None, help="id of this call in every report (default: $SGLANG_EXT_CALL_ID, "
                   "else a fresh knee-<time>-<hex>)")
    g = p.add_argument_group("server (bench/goodput_sweep.sh's flags)")
    g.add_argument("--model", default="preset:llama-3-8b", help="'' = the embedded model (CPU tests)")
    g.add_argument("--device", default="cuda")
    g.add_argument("--dtype", default="bfloat16")
    g.add_argument("--share", type=float, default=0.25, help="--mem-fraction-static (0: not passed)")
    g.add_argument("--host-gb", type=float, default=32.0, help="--kv-host-size-gb of rotate runs")
    g.add_argument("--port", type=int, default=31000)
    g.add_argument("--server-arg", action="append", default=[], help="one more launcher argument (repeatable; "
                   "--server-arg=--max-total-tokens --server-arg=16384)")
    g.add_argument("--variant", action="append", default=[], metavar='NAME="ARGS"',
                   help="launcher args of the runs POLICY-MODE.NAME, on top of every --server-arg (repeatable; "
                        "--variant fixed=\"--offload-executor local --offload-ratio 0.5 --executor-mem-gb 7\")")
    g.add_argument("--start-timeout-s", type=float, default=300.0)
    g.add_argument("--no-server-warmup", dest="server_warmup", action="store_false",
                   help="skip the unmeasured prompts (1 to --max-in tokens) each server gets before its first point")
    g.add_argument("--step-log-s", type=float, default=2.0,
                   help="the servers' step profile every this many seconds, into gp_server_RUN.log between the "
                        "points' markers (bench/step_profile.py reads it; 0: off)")
    w = p.add_argument_group("workload (serving.py)")
    w.add_argument("--trace", choices=TRACE_CHOICES, default="mooncake")
    w.add_argument("--traces-dir", type=Path, default=default_traces_dir())
    w.add_argument("--arrival", choices=("poisson", "burst"), default="poisson")
    w.add_argument("--ttft", type=float, default=5.0, help="TTFT SLO (s)")
    w.add_argument("--tpot", type=float, default=0.1, help="mean TPOT SLO per request (s)")
    w.add_argument("--max-in", type=int, default=7680)
    w.add_argument("--max-out", type=int, default=256)
    w.add_argument("--vocab-size", type=int, default=32000)
    return p


def _check_rows(a: argparse.Namespace, plan: Plan) -> None:
    if a.trace == "synthetic":
        return
    from bench.traces import TRACE_FILES

    path = a.traces_dir / TRACE_FILES[a.trace]
    with open(path, "rb") as f:
        rows = sum(1 for _ in f) - (0 if a.trace == "mooncake" else 1)
    need = plan.offset(plan.repeats - 1) + plan.stride
    if need > rows:
        raise ValueError(f"{plan.repeats} repeats of {plan.stride} rows need {need} rows; {path.name} has {rows}")


def _resume(a: argparse.Namespace, plan: Plan, head: dict[str, Any], call_id: str) -> R.Previous:
    """Check the previous folder against this call's plan and flags (ResumeError naming the field), then copy."""
    R.check_out(a.resume, a.out)

    def config(run: str, rate: float, k: int) -> dict[str, Any]:
        argv = serving_argv(a, plan, run, rate, k, "http://127.0.0.1:1", a.out, call_id)
        return vars(serving.build_parser().parse_args(argv))

    prev = R.load(a.resume, R.measurement(head["setting"], head["plan"]), plan.repeats,
                  lambda run, rate, k: report_name(run, a.arrival, rate, k), config)
    if call_id in {c.get("call_id") for c in prev.calls}:
        raise R.ResumeError(f"--call-id {call_id} is an earlier call's too: give each call its own id")
    head["warnings"] += R.check_gpu(prev.calls, head["gpu"], str(a.resume))
    R.carry_over(prev, a.out)
    return prev


def baseline(runs: Sequence[str]) -> str | None:
    """The run goodput ratios divide by: the first fcfs run without a variant (the "off" of an offload
    comparison), else the first run without one; None leaves goodput.py's default."""
    plain = [r for r in runs if parse_run(r).variant is None]
    return next((r for r in plain if r.startswith("fcfs")), plain[0] if plain else None)


def runs_text(a: argparse.Namespace) -> str:
    """goodput.txt's lines on each run's launcher flags beyond POLICY-MODE's (its variant's name and args)."""
    variants = parse_variants(a.variant)
    lines = ["runs (bench/goodput_knee.py; every run the same rows, plan and repeats), launcher flags beyond "
             "POLICY-MODE's:"]
    for run in a.runs:
        v = parse_run(run).variant
        own = f"variant {v}: {shlex.join(variants[v])}" if v is not None else "no variant"
        lines.append(f"  {run}: {own}")
    if a.server_arg:
        lines.append(f"  every run: {shlex.join(a.server_arg)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, *, executor: Executor | None = None,
         clock: Callable[[], float] = time.monotonic) -> int:
    """`executor`, `clock`: tests drive the search without a server."""
    a = build_parser().parse_args(argv)
    try:
        plan = Plan(tuple(a.grid), a.repeats, a.seconds, a.min_req, a.target, TOLERANCE, a.extend)
        variants = parse_variants(a.variant)
        check_runs(a.runs, variants)
        if min(a.est_start_s or 0.0, a.est_overhead_s or 0.0) < 0:
            raise ValueError("--est-start-s and --est-overhead-s must be >= 0")
        if a.first is not None and a.first not in a.runs:
            raise ValueError(f"--first {a.first}: not one of --runs ({' '.join(a.runs)})")
        _check_rows(a, plan)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    call_id = a.call_id or os.environ.get(serving.CALL_ENV) or serving.new_call_id("knee")
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    head = {"call_id": call_id, "date": date,
            **{k: v for k, v in serving.provenance(call_id).items() if k != "call_id"}, "gpu": R.gpu_name(a.device),
            "gpu_uuid": R.gpu_uuid(a.device),
            "plan": {**asdict(plan), "rates": plan.rates, "extension": plan.extension(), "stride": plan.stride,
                     "offsets": [plan.offset(k) for k in range(plan.repeats)],
                     "n_per_rate": {f"{r:g}": plan.n(r) for r in (*plan.rates, *plan.extension())}},
            "setting": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
            "variants": variants, "servers": {run: server_argv(a, run) for run in a.runs},
            "rule": "union: a rate any run measured is run for every run below that run's first failing rate",
            "warnings": [f"--min-req {a.min_req} < {MIN_REQ}: below the method's minimum"] if a.min_req < MIN_REQ
            else []}
    if (w := routing_warning(a.model, head["servers"])) is not None:
        head["warnings"].append(w)
        print(f"!!! {w}", file=sys.stderr)
    prev: R.Previous | None = None
    if a.resume is not None:
        try:
            prev = _resume(a, plan, head, call_id)
        except R.ResumeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    a.out.mkdir(parents=True, exist_ok=True)
    os.environ[serving.CALL_ENV] = call_id
    knee_json = a.out / "knee.json"
    executor = executor or ServerExecutor(a, plan, a.out, call_id)
    search = Search(plan, list(a.runs), executor, a.budget_s - 15, clock=clock, max_passes=a.max_passes,
                    call_id=call_id, first=a.first)
    if prev is not None:
        search.state = {run: RunState(dict(prev.curves.get(run, {})), list(prev.orders.get(run, [])))
                        for run in a.runs}
        search.start_at = Cursor(**prev.resume_at)
        search.estimator = Estimator(plan, **prev.estimator)
        head["resumed_from"] = str(a.resume)
    # A caller who knows this setting (e.g. a server that starts in seconds) may let a last point start
    # closer to the deadline than the defaults would; the flags win over a resumed call's figures.
    est = search.estimator = search.estimator or Estimator(plan)
    if a.est_start_s is not None:
        est.start_s = a.est_start_s
    if a.est_overhead_s is not None:
        est.overhead_s = a.est_overhead_s

    def calls(search: Search) -> dict[str, Any]:
        mine = {k: head[k] for k in ("call_id", "git_commit", "git_dirty", "commit_source", "date", "gpu", "gpu_uuid")}
        mine.update(stopped=search.stopped, elapsed_s=round(search.elapsed_s, 1), budget_s=search.budget_s,
                    points={run: [e["rate"] for e in s.order if e.get("call") == call_id]
                            for run, s in search.state.items()})
        return R.merged([*(prev.calls if prev else []), mine])

    def save(search: Search) -> None:
        merge = calls(search)
        doc = {**head, **search.summary(), "flush_refused": getattr(executor, "flush_refused", 0),
               "calls": merge["calls"]}
        if prev is not None:  # a search over several calls: say so where a reader looks first
            doc.update(warnings=[*head["warnings"], *merge["warnings"]], merged_calls=merge["merged_calls"],
                       commits_differ=merge["commits_differ"], one_card_one_commit=merge["one_card_one_commit"])
        knee_json.write_text(json.dumps(doc, indent=2) + "\n")

    search.on_point = save
    print(f"knee search {call_id}: runs {' '.join(a.runs)}, grid {' '.join(f'{r:g}' for r in plan.rates)}, "
          f"{plan.repeats} repeats at offsets {head['plan']['offsets']}, budget {a.budget_s:g} s", flush=True)
    if prev is not None:
        print(f"resumed from {a.resume} ({len(prev.calls)} earlier call(s), {len(prev.points())} points measured), "
              f"at pass {search.start_at.pass_no} turn {search.start_at.index}", flush=True)
    search.run()
    for run, r in search.summary()["runs"].items():
        print(f"{run}: {r['status']}; goodput {r['goodput_text']} (last passing {r['last_passing']}, first failing "
              f"{r['first_failing']}, next {r['next_rate']})")
    print(f"stopped: {search.stopped} after {search.elapsed_s:.0f} s")
    buf = a.out / "goodput.txt"
    base = baseline(a.runs)
    with open(buf, "w") as f, contextlib.redirect_stdout(f):
        rc = G.main([str(a.out), "--target", f"{a.target:g}", "--out", str(a.out / "goodput.json"),
                     "--plot", str(a.out / "goodput.png"), *(["--baseline", base] if base else [])])
    if rc == 0:  # which launcher flags each run added: a variant's name and args, beside the table
        with open(buf, "a") as f:
            f.write(runs_text(a) + "\n")
        gj = a.out / "goodput.json"
        gj.write_text(json.dumps({**json.loads(gj.read_text()), "variants": variants,
                                  "servers": head["servers"]}, indent=2) + "\n")
    if prev is not None and rc == 0:  # the panel merges calls: say which, and flag commits that differ
        merge = calls(search)
        with open(buf, "a") as f:
            f.write(R.calls_text(merge) + "\n")
        gj = a.out / "goodput.json"
        gj.write_text(json.dumps({**json.loads(gj.read_text()), "knee_calls": merge}, indent=2) + "\n")
    print(buf.read_text(), end="")
    return 0 if rc == 0 and not any(s.error for s in search.state.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
