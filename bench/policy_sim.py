"""Scheduling policies replayed on a synthetic clock, on CPU: the real scheduler, a real (tiny) model,
and a GPU's time.

    python bench/policy_sim.py --runs fcfs-recompute fcfs-rotate lvf-rotate --rates 4 6 8 \
        --pool-tokens 158656 --trace mooncake --seconds 40 --out sim.json

Every decision is the scheduler's own (admission, preemption, rotation, its copies landing late), on a
tiny Llama whose KV costs nothing; only time is modelled. Each forward advances the clock by what the
batch would take on the GPU, from bench/sim's cost model (`--calibration`, default the H200 file fitted
to bench/results by `python -m bench.sim.fit`; `--model` the geometry priced), and each rotation copy
lands after its real bytes at the measured host-link rate (the duplex rate while both directions copy).
It answers
"which policy wins at which rate, and why" in minutes without a GPU; the GPU sweep
(bench/goodput_sweep.sh) is the measurement. Reports read like bench/serving.py's, so bench/goodput.py
reads them: TTFT and mean TPOT per request, attainment of both SLOs per rate.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.sim.cost import DEFAULT_CALIBRATION, CostModel
from bench.traces import WorkloadConfig, build_requests
from sglang_ext.engine.model_runner import ModelRunner
from sglang_ext.forward_batch import ForwardBatch
from sglang_ext.kvcache.rotation import RotationEngine, Transfer
from sglang_ext.models.config import ModelConfig
from sglang_ext.sampling.params import InvalidRequest, SamplingParams
from sglang_ext.scheduler.request import Req
from sglang_ext.scheduler.scheduler import Scheduler
from sglang_ext.server_args import PreemptionMode, SchedulePolicy, ServerArgs

VOCAB = 512


def forward_seconds(cost: CostModel, batch: ForwardBatch, host: bool = False) -> float:
    """What the scheduler's batch would take on the calibrated GPU (rows extending by 1 are decode rows);
    `host`: plus the host time the engine's loop does not hide for a batch with a prefill chunk."""
    return cost.forward_s(batch.extend_lens, batch.seq_lens, host)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0
        self.stall = 0.0  # the next forward cannot start before this (it waits for a copy)

    def __call__(self) -> float:
        return self.t


class TimedEngine(RotationEngine):
    """Copies the data at once (the scheduler's page ownership keeps that safe) but lands each copy
    when the link would have finished it: copies of one direction queue on one engine."""

    def __init__(self, base: RotationEngine, clock: Clock, cost: CostModel, tokens_per_page: int) -> None:
        super().__init__(base.pool, base.host)
        self.clock, self.cost, self.tokens_per_page = clock, cost, tokens_per_page
        self.free_at = {"out": 0.0, "in": 0.0}
        self.lands: dict[int, float] = {}

    def _timed(self, t: Transfer) -> Transfer:
        start = max(self.clock.t, self.free_at[t.direction])
        other = self.free_at["in" if t.direction == "out" else "out"]
        nbytes = t.num_pages * self.tokens_per_page * self.cost.kv_bytes_per_token
        end = start + self.cost.copy_s(nbytes, t.direction, duplex=other > start)
        self.free_at[t.direction] = end
        self.lands[id(t)] = end
        return t

    def swap_out(self, dev_pages: list[int], host_pages: list[int]) -> Transfer:
        return self._timed(super().swap_out(dev_pages, host_pages))

    def swap_in(self, host_pages: list[int], dev_pages: list[int]) -> Transfer:
        return self._timed(super().swap_in(host_pages, dev_pages))

    def done(self, t: Transfer) -> bool:
        return self.clock.t >= self.lands.get(id(t), 0.0)

    def fence(self, t: Transfer) -> None:
        self.clock.stall = max(self.clock.stall, self.lands.get(id(t), 0.0))


def tiny_model(context: int) -> ModelConfig:
    return ModelConfig.from_dict(dict(
        architectures=["LlamaForCausalLM"], vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=context,
        eos_token_id=1))


def make_scheduler(policy: str, mode: str, pool_tokens: int, host_gb: float, ttft_s: float, tpot_s: float,
                   clock: Clock, cost: CostModel, page: int, context: int, skip_forward: bool = False,
                   host_time: bool = False, extra: dict[str, Any] | None = None) -> Scheduler:
    """The real Scheduler over a tiny model whose pool holds `pool_tokens` tokens (the modelled GPU's
    pool) and, with rotation, a host pool of `host_gb` GiB in the modelled model's bytes. Each forward
    advances `clock` by the cost model's time for the batch. `skip_forward`: do not run the tiny model at
    all (greedy logits of zeros): no decision reads the tokens it draws (outputs are `ignore_eos` and are
    never a prompt's prefix), and its float32 attention over 8K-token prompts is most of a replay's CPU.
    `host_time`: a step with a prefill chunk also pays the engine's unoverlapped host time per step
    (`CostModel.plain_host_s`, measured by bench/offline.py's plain loop). `extra`: more server arguments
    (`ServerArgs.flags_to_kwargs` of launcher flags), e.g. a policy option to try."""
    cfg = tiny_model(context)
    tiny_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # float32 K and V
    host_tokens = int(host_gb * 2**30 / cost.kv_bytes_per_token)
    rot: dict[str, Any] = {} if mode != "rotate" else dict(
        kv_host_size_gb=host_tokens * tiny_bytes / 2**30, rotation_budget_mb=256 * tiny_bytes / cost.kv_bytes_per_token)
    sa = ServerArgs(device="cpu", dtype="float32", load_format="dummy", page_size=page, max_total_tokens=pool_tokens,
                    schedule_policy=cast(SchedulePolicy, policy), preemption_mode=cast(PreemptionMode, mode),
                    chunked_prefill_size=8192,
                    ttft_slo_ms=ttft_s * 1e3, tpot_slo_ms=tpot_s * 1e3, **rot, **(extra or {}))
    runner = ModelRunner(sa, None, cfg)  # type: ignore[arg-type]
    s = Scheduler(sa, runner, page, frozenset(), vocab_size=VOCAB)
    s.clock = clock
    if s.rot is not None:
        s.rot.engine = TimedEngine(s.rot.engine, clock, cost, page)
    forward = runner.forward

    def timed(batch: ForwardBatch) -> torch.Tensor:
        clock.t = max(clock.t, clock.stall) + forward_seconds(cost, batch, host_time)
        return torch.zeros(len(batch.logits_indices), VOCAB) if skip_forward else forward(batch)

    runner.forward = timed  # type: ignore[method-assign]
    return s


def tiny_ids(ids: list[int]) -> list[int]:
    """bench/serving.py's prompt ids (< 32000) folded into the tiny model's vocabulary: equal tokens stay
    equal, so shared prefixes stay shared (two different 16-token pages collide with odds 510^-16)."""
    return [2 + t % (VOCAB - 2) for t in ids]


def serving_workload(cfg: WorkloadConfig) -> list[tuple[float, list[int], int]]:
    """(arrival, prompt, output length) per request, built by bench/serving.py's own function
    (bench.traces.build_requests): the same trace rows, clipping, arrival process and seed, and prompts
    whose Mooncake hash blocks are shared token blocks, so the prefix cache sees the trace's reuse."""
    specs, _ = build_requests(cfg)
    return [(s.arrival_s, tiny_ids(s.input_ids), s.output_len) for s in specs]


def workload(trace: str, rate: float, n: int, offset: int, max_in: int, max_out: int, seed: int,
             arrival: str = "poisson") -> list[tuple[float, list[int], int]]:
    """(arrival, prompt, output length) per request, as bench/serving.py builds them for these flags
    (`arrival` poisson or burst: 4x the quiet rate for 5 s of every 30 s)."""
    return serving_workload(WorkloadConfig(trace=trace, arrival=arrival, request_rate=rate, num_requests=n,
                                           trace_offset=offset, max_input_len=max_in, max_output_len=max_out,
                                           seed=seed))


def replay(s: Scheduler, clock: Clock, reqs: list[tuple[float, list[int], int]], horizon_s: float
           ) -> dict[str, Any]:
    """Send each request at its time; run until all finish or the clock passes `horizon_s`."""
    todo = [Req(f"q{i}", ids, SamplingParams(max_new_tokens=n_out, temperature=0.0, ignore_eos=True), arrival_time=t)
            for i, (t, ids, n_out) in enumerate(reqs)]
    times: dict[str, list[float]] = {r.rid: [] for r in todo}
    arrival = {r.rid: r.arrival_time for r in todo}
    while (todo or s.has_work()) and clock.t < horizon_s:
        while todo and todo[0].arrival_time <= clock.t:
            try:
                s.add_request(todo.pop(0))
            except InvalidRequest:  # the server answers 400 (a prompt longer than the pool): a miss
                continue
        if not s.has_work():
            clock.t = todo[0].arrival_time
            continue
        before = clock.t
        for o in s.step():
            times[o.rid].extend([clock.t] * len(o.new_token_ids))
        if clock.t == before:
            clock.t = max(clock.t + 1e-3, clock.stall)  # no forward (copies landing): time still passes
    done = [rid for rid, ts in times.items() if ts]
    return {"arrival": arrival, "times": {rid: times[rid] for rid in done},
            "rotations": s.rot.rotations_out if s.rot is not None else 0, "preemptions": s.num_preemptions}


def summarize(res: dict[str, Any], n: int, out_len: dict[str, int], ttft_s: float, tpot_s: float) -> dict[str, Any]:
    ttft, tpot, ok = [], [], 0
    for rid, ts in res["times"].items():
        if len(ts) < out_len[rid]:
            continue  # unfinished at the horizon: a miss
        first = ts[0] - res["arrival"][rid]
        mean = (ts[-1] - ts[0]) / (len(ts) - 1) if len(ts) > 1 else 0.0
        ttft.append(first)
        tpot.append(mean)
        ok += first <= ttft_s and mean <= tpot_s

    def pct(xs: list[float], q: float) -> float:
        return float(np.percentile(xs, q)) if xs else float("nan")

    return {"scheduled": n, "finished": len(ttft), "both_met": ok, "attainment": ok / n if n else 0.0,
            "ttft_mean_s": float(np.mean(ttft)) if ttft else float("nan"), "ttft_p99_s": pct(ttft, 99),
            "tpot_mean_ms": 1e3 * float(np.mean(tpot)) if tpot else float("nan"), "tpot_p99_ms": 1e3 * pct(tpot, 99),
            "rotations_out": res["rotations"], "preemptions": res["preemptions"]}


def run_point(run: str, rate: float, a: argparse.Namespace, cost: CostModel) -> dict[str, Any]:
    policy, mode = run.split("-", 1)
    n = max(8, round(rate * a.seconds))
    reqs = workload(a.trace, rate, n, a.trace_offset, a.max_in, a.max_out, a.seed, a.arrival)
    clock = Clock()
    s = make_scheduler(policy, mode, a.pool_tokens, a.host_gb, a.ttft, a.tpot, clock, cost, a.page_size,
                       a.max_in + a.max_out + 16, skip_forward=a.skip_forward, host_time=a.host_time)
    res = replay(s, clock, reqs, horizon_s=a.seconds * 3)
    out_len = {f"q{i}": r[2] for i, r in enumerate(reqs)}
    return {"run": run, "rate": rate, **summarize(res, n, out_len, a.ttft, a.tpot)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="+", default=["fcfs-recompute", "fcfs-rotate", "lvf-rotate"])
    p.add_argument("--rates", nargs="+", type=float, default=[4.0, 6.0, 8.0])
    p.add_argument("--seconds", type=float, default=30.0, help="requests per point = rate x seconds")
    p.add_argument("--pool-tokens", type=int, default=158_656, help="KV pool (default: a quarter H200, 8B)")
    p.add_argument("--host-gb", type=float, default=32.0, help="host KV pool, in the modelled model's bytes")
    p.add_argument("--trace", default="mooncake", choices=["mooncake", "azure-conv", "azure-code"])
    p.add_argument("--arrival", default="poisson", choices=["poisson", "burst"],
                   help="burst: 4x the quiet rate for 5 s of every 30 s, --rates on average (bench/serving.py's)")
    p.add_argument("--trace-offset", type=int, default=0)
    p.add_argument("--max-in", type=int, default=7680)
    p.add_argument("--max-out", type=int, default=256)
    p.add_argument("--ttft", type=float, default=5.0)
    p.add_argument("--tpot", type=float, default=0.1)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    p.add_argument("--calibration", type=Path, default=DEFAULT_CALIBRATION,
                   help="cost-model calibration (python -m bench.sim.fit writes it)")
    p.add_argument("--model", default="llama-3-8b", help="geometry preset whose steps are priced")
    p.add_argument("--host-time", action="store_true",
                   help="a step with a prefill chunk also pays the host time the engine's loop does not overlap")
    p.add_argument("--skip-forward", action="store_true",
                   help="do not run the tiny model (same decisions, several times faster)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    cost = CostModel.load(a.calibration, a.model)
    points = []
    for run in a.runs:
        for rate in a.rates:
            pt = run_point(run, rate, a, cost)
            points.append(pt)
            print(f"{run:16s} {rate:5.1f} req/s  both SLOs {100 * pt['attainment']:5.1f} %  "
                  f"TTFT mean/p99 {pt['ttft_mean_s']:.2f}/{pt['ttft_p99_s']:.2f} s  "
                  f"TPOT mean/p99 {pt['tpot_mean_ms']:.0f}/{pt['tpot_p99_ms']:.0f} ms  "
                  f"rot {pt['rotations_out']} preempt {pt['preemptions']}", flush=True)
    if a.out:
        model = {**cost.describe(), "calibration": str(a.calibration)}
        a.out.write_text(json.dumps({"cost_model": model, "args": {k: str(v) for k, v in vars(a).items()},
                                     "points": points}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
