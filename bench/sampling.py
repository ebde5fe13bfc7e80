"""The batched sampler alone: time per step of `Sampler.sample` on float32 logits of a
Llama-3 vocabulary (128,256 tokens), for the parameter mixes of docs/benchmarks.md.

    python bench/sampling.py --out sampling.json      # on a GPU (FlashInfer for unseeded rows)

Each cell: GPU time per call (CUDA events around --iters calls queued behind a long sleep kernel,
so the host is ahead and the events time the device work alone), the host time of building the
batch description + launching (what the overlap loop hides under the forward), and whether a call
blocked the host while the GPU was busy (a hidden sync would). Two
logit distributions: `randn` (standard normal: flat, the nucleus holds most of the vocabulary)
and `peaked` (normal x 4: closer to a trained model's next-token distribution).
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
MIXES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "T1.0": {"temperature": 1.0},
    "T0.8_p0.9": {"temperature": 0.8, "top_p": 0.9},
    "T0.8_p0.9_k50": {"temperature": 0.8, "top_p": 0.9, "top_k": 50},
    "T0.8_p0.9_k50_freq": {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "frequency_penalty": 0.5},
    "T0.8_p0.9_k50_seeded": {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": 1},
    "T0.8_k50_seeded": {"temperature": 0.8, "top_k": 50, "seed": 1},
}


def measure(sampler: Sampler, logits: torch.Tensor, params: SamplingParams, iters: int) -> dict[str, float]:
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
    blocked = max(host) > 0.5 * SLEEP_S  # a call waited for the sleeping device: a sync
    torch.cuda.synchronize()
    gpu_ms = e0.elapsed_time(e1) / iters
    for s in slots:
        if s >= 0:
            sampler.penalties.release(s)
    return {"gpu_ms": gpu_ms, "host_ms": statistics.median(host) * 1e3, "host_blocked": blocked}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-sizes", default="64,256")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default="sampling.json")
    a = p.parse_args()
    res: dict[str, Any] = {"env": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                   "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}, "rows": []}
    try:
        import flashinfer

        res["env"]["flashinfer"] = flashinfer.__version__
    except ImportError:
        res["env"]["flashinfer"] = None
    sampler = Sampler(VOCAB, "cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    for dist, scale in (("randn", 1.0), ("peaked", 4.0)):
        for bs in (int(x) for x in a.batch_sizes.split(",")):
            logits = torch.randn(bs, VOCAB, device="cuda", generator=g) * scale
            for name, kw in MIXES.items():
                m = measure(sampler, logits, SamplingParams(**kw), a.iters)
                row = {"dist": dist, "bs": bs, "mix": name, **m}
                res["rows"].append(row)
                print(f"{dist:7s} bs={bs:4d} {name:22s} gpu {m['gpu_ms']:7.3f} ms  host {m['host_ms']:6.3f} ms"
                      f"{'  HOST BLOCKED (sync)' if m['host_blocked'] else ''}", flush=True)
                Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
