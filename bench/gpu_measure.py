"""Measurement helpers for bench/offline.py: GPU timing, hardware ceilings (HBM read, bf16 GEMM),
synthetic paged batches and dummy weights drawn on the GPU."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from sglang_ext.forward_batch import BatchRow, ForwardBatch, ForwardMode
from sglang_ext.sampling.params import SamplingParams
from sglang_ext.scheduler.batch_builder import Entry, build_batch
from sglang_ext.scheduler.request import Req

PAGE = 16


# ---- measurement helpers ---------------------------------------------------------------------------
def time_gpu(fn: Callable[[], Any], iters: int, warmup: int = 3) -> float:
    """Milliseconds per call, calls issued back to back, timed with events."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def hbm_read_bw() -> dict[str, float]:
    """Bytes/s of streaming reads (a sum over a large tensor), median of 10 each; the best is the
    ceiling the roofline uses (a higher ceiling makes the roofline harder to reach)."""
    out = {}
    for name, gib, dtype in (("sum_fp32_2GiB", 2, torch.float32), ("sum_fp32_4GiB", 4, torch.float32),
                             ("sum_bf16_4GiB", 4, torch.bfloat16)):
        x = torch.randn(gib * 2**30 // torch.empty((), dtype=dtype).element_size(), device="cuda", dtype=dtype)
        ts = [time_gpu(lambda x=x: x.sum(), 1, warmup=1) for _ in range(10)]
        out[name] = gib * 2**30 / (statistics.median(ts) / 1e3)
        del x
        torch.cuda.empty_cache()
    return out


def gemm_peak(n: int = 8192) -> float:
    """FLOP/s of an n^3 bf16 matmul on random data."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = time_gpu(lambda: a @ b, 10)
    return 2 * n**3 / (ms / 1e3)


# ---- synthetic batches -----------------------------------------------------------------------------
class Layout:
    """Scattered pages of the pool handed to synthetic requests (page 0 stays reserved)."""

    def __init__(self, num_pages: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()

    def pages(self, bs: int, ctx: int) -> list[list[int]]:
        return self.pages_each([ctx] * bs)

    def pages_each(self, contexts: list[int]) -> list[list[int]]:
        """Pages for requests of these contexts, disjoint, in order."""
        counts = [-(-c // PAGE) for c in contexts]
        assert sum(counts) <= len(self.perm), "pool too small for this batch"
        out, at = [], 0
        for n in counts:
            out.append(self.perm[at : at + n])
            at += n
        return out


def decode_batch(pages: list[list[int]], ctx: int, vocab: int, device: str = "cuda") -> ForwardBatch:
    """Each request holds ctx - 1 tokens of KV and decodes token ctx - 1."""
    ids = torch.randint(0, vocab, (len(pages),)).tolist()
    rows = [BatchRow(ctx - 1, [t], p, [0]) for p, t in zip(pages, ids, strict=True)]
    return ForwardBatch.build(rows, ForwardMode.DECODE, PAGE, device)


def prefill_batch(pages: list[list[int]], length: int, vocab: int, prefix: int = 0,
                  decode: Sequence[tuple[list[int], int]] = (), device: str = "cuda") -> ForwardBatch:
    """Chunks of `length` new tokens, one per entry of `pages`, each after `prefix` tokens already in the
    pool (a chunk after a cached prefix or an earlier chunk: its attention reads them), with `decode` rows
    (pages, context) riding along as in serving's mixed forwards."""
    rows = [BatchRow(prefix, torch.randint(0, vocab, (length,)).tolist(), p, [length - 1]) for p in pages]
    rows += [BatchRow(ctx - 1, [int(torch.randint(0, vocab, ()).item())], p, [0]) for p, ctx in decode]
    return ForwardBatch.build(rows, ForwardMode.EXTEND, PAGE, device)


def build_ms(pages: list[list[int]], ctx: int) -> float:
    """CPU cost of the scheduler's `build_batch` for this decode batch (median of 5)."""
    entries = []
    for i, p in enumerate(pages):
        r = Req(f"b{i}", list(range(ctx - 1)), SamplingParams(), output_ids=[0], pages=p, kv_len=ctx - 1)
        entries.append(Entry(r, 1, [], True))
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        build_batch(entries, ForwardMode.DECODE, PAGE, torch.device("cuda"))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


# ---- sections --------------------------------------------------------------------------------------
def kernel_category(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("batchprefill", "batchdecode", "flashinfer", "mergestate", "attention")):
        return "attention"
    # the MoE kernels of sglang_ext/ops/moe (their Triton function names): routing (softmax + top-k, the
    # per-expert alignment's count and place), then the expert GEMMs and the slot sum
    if any(s in n for s in ("_route_kernel", "_count_kernel", "_place_kernel")):
        return "moe_routing"
    if any(s in n for s in ("_gate_up_kernel", "_down_kernel", "_sum_kernel")):
        return "moe_experts"
    if any(s in n for s in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "gemv", "splitk")):
        return "gemm"
    if any(s in n for s in ("_rms_norm", "_rope", "_silu_mul", "_store_kv")):
        return "fused_ops"
    if "memcpy" in n or "memset" in n:
        return "copies"
    return "other"




class SplitStep:
    """A sender decode step with `n_local` rows on the sender's scattered pages and `n_remote` rows
    whose random KV (ctx - 1 tokens each) is loaded into an executor's partition for guest `guest`;
    `run()` decodes the same position again every call (re-planning the executor's rows first)."""

    def __init__(self, runner: Any, remote: Any, executor: Any, guest: str, local_pages: list[list[int]],
                 n_remote: int, ctx: int) -> None:
        self.runner, self.remote, self.executor, self.guest = runner, remote, executor, guest
        self.handles = list(range(1, n_remote + 1))
        self.pos = ctx - 1
        kv = torch.randn((-(-ctx // PAGE), *runner.pool.data.shape[1:]), dtype=runner.pool.data.dtype,
                         device=executor.device)
        for h in self.handles:
            executor.load(guest, h, kv, self.pos)
        rows = [BatchRow(self.pos, [7], pg, [0]) for pg in local_pages]
        rows += [BatchRow(self.pos, [7], (), [0], remote=h) for h in self.handles]
        self.batch = ForwardBatch.build(rows, ForwardMode.DECODE, PAGE, runner.device)

    def run(self) -> None:
        if self.handles:
            seqs = self.executor.guests[self.guest].seqs
            for h in self.handles:
                seqs[h].length = self.pos
            self.remote.begin_step(self.handles, [self.pos] * len(self.handles))
        with torch.cuda.device(self.runner.device):
            self.runner.forward(self.batch)

    def release(self) -> None:
        self.executor.release_all(self.guest)
