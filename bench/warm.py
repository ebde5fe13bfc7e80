"""Compile and cache a fresh GPU machine's JIT kernels before a timed step (gpu_session.sh's `warm`).

    python bench/warm.py --model preset:qwen3-30b-a3b --mem-fraction 0.9

Decode shapes are compiled by every server's CUDA-graph capture, but the MoE Triton kernels take
their block sizes per token count, and a prefill of M tokens compiles the config of M's bucket on
its first use. Before this script the warm step sent 8 short prompts, so the first server of a knee
search (always the first run, fcfs) compiled the prefill buckets inside its first timed point: on an
H100 with Qwen3-30B-A3B (2026-12-06) fcfs's first point had a 1.2 s inter-token gap and TTFT p99
2.6 s, its own repeat on the next call 0.3 s and lvf's 0.5 s. Here one prompt per doubling of the
length up to the chunk size, then a batch of short prompts, reach every bucket a serving run does;
Triton's disk cache keeps them for the servers that follow. `--server-arg` gives the engine the runs'
own launcher flags: a kernel specialised on a flag (`--moe-routing-simulation uniform` feeds the Triton
router float32 logits, another compile) is otherwise compiled inside the first timed point -- on
2026-12-06 (session 6) lvf's first repeat at 3 req/s, the call's first point, ran its first ~14 s of
prefills 2-5x slow and collapsed to 42.7 % while the next two repeats passed.
"""

from __future__ import annotations

import argparse
import random
import time


def prompt_lengths(chunk: int) -> list[int]:
    """1, 2, 4, ... up to `chunk` and `chunk` itself minus a margin for the first decode token."""
    out, n = [], 1
    while n < chunk:
        out.append(n)
        n *= 2
    out.append(chunk - 8)
    return out


def server_kwargs(flags: list[str]) -> dict[str, object]:
    """Engine keywords of launcher flags: only those the flags set (to something other than the default)."""
    from sglang_ext.server_args import ServerArgs

    return ServerArgs.flags_to_kwargs(flags)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="preset:llama-3-8b", help="\"\": the embedded default model")
    p.add_argument("--mem-fraction", type=float, default=0.25)
    p.add_argument("--chunk", type=int, default=8192, help="the servers' chunked prefill size (GPU default 8192)")
    p.add_argument("--batch", type=int, default=64, help="short prompts sent together (mixed prefill batches)")
    p.add_argument("--device", default="cuda", help="cpu: a check of the script itself (nothing to compile)")
    p.add_argument("--server-arg", action="append", default=[],
                   help="one launcher flag of the runs that follow (repeatable: --server-arg=--moe-routing-simulation "
                        "--server-arg=uniform, or --server-arg=--moe-routing-simulation=uniform)")
    a = p.parse_args(argv)
    import sglang_ext  # lazy: --help on a machine without torch

    extra = server_kwargs(a.server_arg)

    t0 = time.perf_counter()
    e = sglang_ext.Engine(model_path=a.model or None, load_format="dummy", device=a.device,
                          dtype="bfloat16" if a.device.startswith("cuda") else "float32",
                          mem_fraction_static=a.mem_fraction, **extra)
    print(f"warm: engine up in {time.perf_counter() - t0:.1f} s", flush=True)
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(100, 2000) for _ in range(n)]  # noqa: E731 -- ids every tokenizer decodes
    sp = {"max_new_tokens": 4, "ignore_eos": True}
    for n in prompt_lengths(a.chunk):
        t = time.perf_counter()
        e.generate(input_ids=ids(n), sampling_params=sp)
        print(f"warm: prefill {n:>5} tokens {time.perf_counter() - t:6.2f} s", flush=True)
    t = time.perf_counter()
    out = e.generate(input_ids=[ids(rng.randrange(8, 256)) for _ in range(a.batch)], sampling_params=sp)
    assert isinstance(out, list)  # a batch of prompts gives a list of outputs
    print(f"warm: batch of {a.batch} short prompts {time.perf_counter() - t:6.2f} s; "
          f"{out[0]['meta_info']}", flush=True)
    e.shutdown()
    print(f"warm: done in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
