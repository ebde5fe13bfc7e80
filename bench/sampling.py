"""The batched sampler alone: time per step of `Sampler.sample` on float32 logits of a
Llama-3 vocabulary (128,256 tokens), for the parameter mixes of docs/benchmarks.md.

    python bench/sampling.py --out sampling.json      # on a GPU (FlashInfer for unseeded rows)

Each cell: GPU time per call (CUDA events around --iters calls queued behind a long sleep kernel,
so the host is ahead and the events time the device work alone), the host time of building the
batch description + launching (what the overlap loop hides under the forward), the device
operations (kernels and copies) one call queues, and two checks of the host never waiting:

* `syncs`: one call (batch + sample) under torch's sync debug mode "error", which raises on any
  synchronising call (item, a blocking copy, a stream or device sync); the exception's text if
  one did, else null;
* `host_blocked`: each of a few calls alone behind a ~40 ms sleep kernel; the call returning while
  the device still sleeps shows it waited for nothing (a hidden wait the debug mode cannot see, a
  copy from pageable memory say, would make it last the sleep).

The 2026-11-29 table flagged the frequency-penalty and seeded mixes as blocked: then the flag was
"some call of 50 queued behind one sleep took half the sleep", which also trips when those 50 calls
fill the device's queue of pending launches (about 1,000): those mixes ran 21-24 aten ops a call
(the seeded mix's topk several kernels on a GPU), enough to do that without any sync. Each call
now faces an empty queue. Two logit distributions: `randn` (standard normal: flat, the nucleus
holds most of the vocabulary) and `peaked` (normal x 4: closer to a trained model's next-token
distribution).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sglang_ext.sampling.batch import SampleRow
from sglang_ext.sampling.params import SamplingParams
from sglang_ext.sampling.sampler import Sampler

VOCAB = 128256
SLEEP_S = 0.2
SLEEP_CYCLES = int(SLEEP_S * 1.5e9)  # 0.2 s at 1.5 GHz, 0.15 s at the H200's 1.98 GHz
ALONE_CYCLES = int(0.05 * 1.5e9)  # the sleep each isolated call waits behind: 38 ms at 1.98 GHz
ALONE_BLOCKED_S = 0.015  # an isolated call this long waited for the device (its host time is ~1 ms)
ALONE_CALLS = 5
MIXES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "T1.0": {"temperature": 1.0},
    "T0.8_p0.9": {"temperature": 0.8, "top_p": 0.9},
    "T0.8_p0.9_k50": {"temperature": 0.8, "top_p": 0.9, "top_k": 50},
    "T0.8_p0.9_k50_freq": {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "frequency_penalty": 0.5},
    "T0.8_p0.9_k50_seeded": {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": 1},
    "T0.8_k50_seeded": {"temperature": 0.8, "top_k": 50, "seed": 1},
}


def measure(sampler: Sampler, logits: torch.Tensor, params: SamplingParams, iters: int) -> dict[str, Any]:
    bs = logits.shape[0]
    slots = [-1] * bs
    if params.has_penalties:
        slots = [sampler.penalties.acquire([1, 2, 3], [4, 5], params.frequency_penalty, params.presence_penalty)
                 for _ in range(bs)]

    def once(step: int) -> torch.Tensor:
        rows = [SampleRow(params, step, (), slots[i]) for i in range(bs)]
        return sampler.sample(logits, sampler.batch(rows))

    for i in range(3):
        once(i)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host = []
    torch.cuda._sleep(SLEEP_CYCLES)  # the host runs ahead of the device from here
    e0.record()
    for i in range(iters):
        t0 = time.perf_counter()
        once(i)
        host.append(time.perf_counter() - t0)
    e1.record()
    torch.cuda.synchronize()
    gpu_ms = e0.elapsed_time(e1) / iters
    alone = []
    for i in range(ALONE_CALLS):  # one call's launches alone in the queue, behind a sleep
        torch.cuda.synchronize()
        torch.cuda._sleep(ALONE_CYCLES)
        t0 = time.perf_counter()
        once(i)
        alone.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    out = {"gpu_ms": gpu_ms, "host_ms": statistics.median(host) * 1e3,
           "host_blocked": max(alone) > ALONE_BLOCKED_S,
           "syncs": sync_check(once), "device_ops": device_ops(once)}
    for s in slots:
        if s >= 0:
            sampler.penalties.release(s)
    return out


def sync_check(once: Any) -> str | None:
    """None if one call made no synchronising CUDA call, else the debug mode's complaint."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        once(0)
        return None
    except RuntimeError as e:
        return str(e).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()


def device_ops(once: Any) -> int | None:
    """Kernels and copies one call queues on the device (torch.profiler's CUDA events)."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            once(0)
            torch.cuda.synchronize()
        return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())
    except Exception:  # the profiler is a diagnostic here: its absence must not stop the timings
        return None


def kernel_table(sampler: Sampler, logits: torch.Tensor, params: SamplingParams, calls: int = 20) -> str:
    """The kernels and copies of `calls` calls, by total device time."""
    from torch.profiler import ProfilerActivity, profile

    rows = [SampleRow(params, 0) for _ in range(logits.shape[0])]
    sampler.sample(logits, sampler.batch(rows))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            sampler.sample(logits, sampler.batch(rows))
        torch.cuda.synchronize()
    return str(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-sizes", default="64,256")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default="sampling.json")
    p.add_argument("--top-k-window", type=int, default=0,
                   help="also time the top-k window draw (Sampler(top_k_window=N)) on the mixes it takes: "
                        "+window with its last step one Triton kernel where Triton imports, +window_torch in torch")
    p.add_argument("--profile", action="store_true",
                   help="print each window row's kernels by device time (torch.profiler, 20 calls)")
    a = p.parse_args()
    res: dict[str, Any] = {"env": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                   "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}, "rows": []}
    try:
        import flashinfer

        res["env"]["flashinfer"] = flashinfer.__version__
    except ImportError:
        res["env"]["flashinfer"] = None
    res["env"]["top_k_window"] = a.top_k_window
    samplers = {"": Sampler(VOCAB, "cuda")}
    if a.top_k_window > 0:
        samplers["+window"] = Sampler(VOCAB, "cuda", top_k_window=a.top_k_window)
        if samplers["+window"].fi_pick is not None:
            samplers["+window_torch"] = Sampler(VOCAB, "cuda", top_k_window=a.top_k_window)
            samplers["+window_torch"].fi_pick = None  # the same draw, its last step as torch ops
    g = torch.Generator(device="cuda").manual_seed(0)
    for dist, scale in (("randn", 1.0), ("peaked", 4.0)):
        for bs in (int(x) for x in a.batch_sizes.split(",")):
            logits = torch.randn(bs, VOCAB, device="cuda", generator=g) * scale
            for name, kw in MIXES.items():
                params = SamplingParams(**kw)
                for suffix, sampler in samplers.items():
                    if suffix and not sampler.batch([SampleRow(params, 0)]).fast_in_window:
                        continue  # a mix the window does not take: the same draw as above
                    m = measure(sampler, logits, params, a.iters)
                    row = {"dist": dist, "bs": bs, "mix": name + suffix, **m}
                    res["rows"].append(row)
                    print(f"{dist:7s} bs={bs:4d} {name + suffix:29s} gpu {m['gpu_ms']:7.3f} ms  host "
                          f"{m['host_ms']:6.3f} ms  {m['device_ops']} device ops"
                          f"{'  HOST BLOCKED' if m['host_blocked'] else ''}"
                          f"{'  SYNC: ' + m['syncs'] if m['syncs'] else ''}", flush=True)
                    Path(a.out).write_text(json.dumps(res, indent=1))
                    if a.profile and suffix:
                        print(kernel_table(sampler, logits, params), flush=True)


if __name__ == "__main__":
    main()
