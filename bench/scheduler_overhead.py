"""The scheduler's host time per iteration, without a model (CPU): what each preemption mode and policy
costs the loop itself.

    PYTHONPATH=$PWD python3 bench/scheduler_overhead.py [--steps 300] [--running 32] [--queue 32]

A stub runner answers every forward at once with fixed logits, over a KV pool with the Llama-3-8B
geometry (32 layers, 8 kv heads, page 16, 32768 tokens) but a head_dim of 1, so pages are counted as
on the GPU while copies are cheap. The rotation engine is a stub too: no data moves, and each transfer
lands after one poll, as a GPU copy issued in one iteration is seen done in the next (so holds, parked
pages and deferred unlocks are exercised). B_xfer and the host pool are scaled to the real page size
(`--budget-mb` of 2 MiB pages, 32 GiB of host pool).

Workload (closed loop): prompts of ~`--context` tokens (2/3x to 4/3x) and outputs of ~`--output` tokens
(1/4x to 7/4x); `--queue` requests are kept waiting, so the pool stays full (~32 requests of ~1000 tokens
running); the clock advances 10 ms per iteration (an H200 decode step). After `--warmup` iterations, each
configuration runs `--steps` more; per iteration, the wall time of `Scheduler.step()` (the forward is free,
so this is scheduling, batch building and sampling on the host). Printed: mean and median microseconds per
iteration, what happened in the window (rotations, recompute preemptions, requests admitted from the
queue, requests running at the end), and the iterations that forwarded prompt tokens with their mean time
(a step the overlap loop runs plain: on a GPU its host time adds to the forward's).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from sglang_ext.forward_batch import ForwardBatch
from sglang_ext.kvcache.pool import KVGeometry, KVPool
from sglang_ext.kvcache.rotation import RotationEngine, Transfer
from sglang_ext.sampling.params import SamplingParams
from sglang_ext.scheduler.request import Req
from sglang_ext.scheduler.scheduler import Scheduler
from sglang_ext.server_args import ServerArgs

VOCAB = 512
REAL_PAGE_BYTES = 2 << 20  # Llama-3-8B, bf16, page 16
GEOMETRY = KVGeometry(num_layers=32, num_kv_heads=8, head_dim=1, page_size=16, dtype=torch.float16)
STEP_S = 0.010


class StubRunner:
    def __init__(self, tokens: int) -> None:
        self.device = torch.device("cpu")
        self.num_pages = tokens // GEOMETRY.page_size + 1
        self.context_len = 1 << 20
        self.pool = KVPool(GEOMETRY, self.num_pages, self.device)
        self._logits = torch.zeros(4096, VOCAB)
        self._logits[:, 7] = 1.0  # greedy picks token 7, never EOS

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self._logits[: batch.logits_indices.shape[0]]


class StubEngine(RotationEngine):
    """Moves no data; a transfer lands at its first `done` query after the iteration that issued it."""

    def _t(self, direction: str, n: int) -> Transfer:
        t = Transfer(direction, n, n * self.page_bytes, event=None)
        self._fresh.add(id(t))
        return t

    _fresh: set[int]

    def swap_out(self, dev_pages: list[int], host_pages: list[int]) -> Transfer:
        self.bytes_out += len(dev_pages) * self.page_bytes
        return self._t("out", len(dev_pages))

    def swap_in(self, host_pages: list[int], dev_pages: list[int]) -> Transfer:
        self.bytes_in += len(dev_pages) * self.page_bytes
        return self._t("in", len(dev_pages))

    def done(self, t: Transfer) -> bool:
        return id(t) not in self._fresh

    def new_iteration(self) -> None:
        self._fresh.clear()

    def fence(self, t: Transfer) -> None:
        self._fresh.discard(id(t))


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def build(mode: str, policy: str, eager: bool, tokens: int, budget_mb: float) -> tuple[Scheduler, Clock]:
    scale = GEOMETRY.page_bytes / REAL_PAGE_BYTES
    kw: dict[str, Any] = {}
    if mode == "rotate":
        kw = dict(kv_host_size_gb=32 * scale, rotation_budget_mb=budget_mb * scale, disable_eager_rotation=not eager,
                  ttft_slo_ms=2000, tpot_slo_ms=100)
    args = ServerArgs(device="cpu", page_size=GEOMETRY.page_size, preemption_mode=mode,  # type: ignore[arg-type]
                      schedule_policy=policy, chunked_prefill_size=8192, **kw)  # the GPU's chunk  # type: ignore[arg-type]
    s = Scheduler(args, StubRunner(tokens), GEOMETRY.page_size, frozenset([2]), vocab_size=VOCAB)  # type: ignore[arg-type]
    if s.rot is not None:
        engine = StubEngine(s.runner.pool, s.rot.host)
        engine._fresh = set()
        s.rot.engine = engine
    clock = Clock()
    s.clock = clock
    return s, clock


def run(mode: str, policy: str, eager: bool, a: argparse.Namespace) -> dict[str, float]:
    s, clock = build(mode, policy, eager, a.tokens, a.budget_mb)
    g = torch.Generator().manual_seed(0)
    made = 0

    def top_up() -> None:
        """Keep `--queue` requests waiting: a closed loop, so the pool stays full."""
        nonlocal made
        while len(s.waiting) < a.queue:
            n = int(torch.randint(a.context * 2 // 3, a.context * 4 // 3, (), generator=g))
            out = int(torch.randint(a.output // 4, a.output * 7 // 4, (), generator=g))
            ids = torch.randint(3, VOCAB, (n,), generator=g).tolist()
            s.add_request(Req(f"r{made}", ids, SamplingParams(max_new_tokens=out, temperature=0.0, ignore_eos=True),
                              arrival_time=clock.t))
            made += 1

    def step() -> float:
        clock.t += STEP_S
        top_up()
        if isinstance(s.rot.engine if s.rot else None, StubEngine):
            s.rot.engine.new_iteration()  # type: ignore[union-attr]
        t0 = time.perf_counter()
        s.step()
        return time.perf_counter() - t0

    for _ in range(a.warmup):
        step()
    rot0 = s.rot.rotations_out if s.rot else 0
    pre0, made0 = s.num_preemptions, made
    times, prefill = [], []  # each iteration's time, and whether it forwarded prompt tokens
    for _ in range(a.steps):
        before = s.prefill_tokens
        times.append(step())
        prefill.append(s.prefill_tokens > before)
    # the loop runs a step with a prefill chunk plain: its host time is not hidden behind a forward
    with_prefill = [t for t, p in zip(times, prefill, strict=True) if p]
    return {
        "mean_us": statistics.fmean(times) * 1e6,
        "median_us": statistics.median(times) * 1e6,
        "prefill_steps": len(with_prefill),
        "prefill_step_us": statistics.fmean(with_prefill) * 1e6 if with_prefill else float("nan"),
        "rotations": (s.rot.rotations_out if s.rot else 0) - rot0,
        "recomputes": s.num_preemptions - pre0,
        "admitted": made - made0,
        "running": statistics.fmean([len(s.running)]),
    }


CONFIGS = [("recompute", "fcfs", False), ("rotate", "fcfs", False), ("rotate", "fcfs", True),
           ("rotate", "sf", False), ("rotate", "sf", True), ("rotate", "lvf", False), ("rotate", "lvf", True)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--queue", type=int, default=32)
    p.add_argument("--context", type=int, default=900)
    p.add_argument("--output", type=int, default=200)
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--budget-mb", type=float, default=256.0)
    a = p.parse_args()
    torch.set_num_threads(1)  # tiny ops: intra-op threads only add spin-up and contention noise
    print(f"{'mode':<10}{'policy':<7}{'eager':<7}{'mean us':>9}{'median us':>11}{'rotations':>11}{'recomputes':>12}"
          f"{'admitted':>10}{'running':>9}{'prefill steps':>15}{'their us':>10}")
    for mode, policy, eager in CONFIGS:
        r = run(mode, policy, eager, a)
        print(f"{mode:<10}{policy:<7}{'on' if eager else 'off':<7}{r['mean_us']:>9.0f}{r['median_us']:>11.0f}"
              f"{r['rotations']:>11.0f}{r['recomputes']:>12.0f}{r['admitted']:>10.0f}{r['running']:>9.0f}"
              f"{r['prefill_steps']:>15}{r['prefill_step_us']:>10.0f}")


if __name__ == "__main__":
    main()
