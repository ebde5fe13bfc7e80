"""Tune the fused-MoE kernels' block sizes on this GPU and write the config file the runtime reads.

    python bench/tune_moe.py --preset qwen3-30b-a3b                 # E=128 k=8 H=2048 I=768, bf16
    python bench/tune_moe.py --preset mixtral-8x7b --tp 2           # I split over 2 GPUs: 7168 each
    python bench/tune_moe.py --experts 64 --top-k 6 --hidden 2048 --inter 1408 --batch-sizes 1,8,64

For each batch size T (tokens per forward) and each BLOCK_M, the (T, k) routing of random logits is
aligned once, then the gate/up GEMM and the down GEMM are timed separately over their candidate
configs (`triton.testing.do_bench`, median; candidates that fail to compile on this GPU, or whose
shared memory or accumulators clearly do not fit, are skipped). The BLOCK_M whose alignment + best
gate/up + best down is fastest wins; the winner is checked against the torch reference before it is
written. Output: `sglang_ext/ops/moe/configs/E=..,N=..,H=..,dtype=..,device=...json` (E the experts
on one GPU, N the intermediate size on one GPU), merged into an existing file batch size by batch
size. Compiled kernels are shared across batch sizes (shapes are runtime arguments), so the first
T pays the compile time (minutes); `--quick` sweeps a smaller space.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

PRESETS: dict[str, dict[str, int]] = {
    "mixtral-8x7b": {"experts": 8, "top_k": 2, "hidden": 4096, "inter": 14336},
    "qwen3-30b-a3b": {"experts": 128, "top_k": 8, "hidden": 2048, "inter": 768},
}
BATCH_SIZES = "1,2,4,8,16,24,32,48,64,96,128,256,512,1024,2048,4096"
SMEM_BYTES = 220 * 1024  # H100/H200: 228 KiB per SM, less what the compiler reserves
MAX_ACC_REGS = 256  # float32 accumulator registers per thread beyond which a config spills


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), help="model geometry (the flags below override it)")
    p.add_argument("--experts", type=int, help="E, routed experts in the model")
    p.add_argument("--top-k", type=int, help="k, experts per token")
    p.add_argument("--hidden", type=int, help="H, the model's hidden size")
    p.add_argument("--inter", type=int, help="I, one expert's intermediate size")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size: each GPU holds I/tp of every expert")
    p.add_argument("--ep", type=int, default=1, help="expert parallel size: each GPU holds E/ep experts")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--batch-sizes", default=BATCH_SIZES, help=f"comma-separated T (default {BATCH_SIZES})")
    p.add_argument("--out-dir", type=Path, default=None, help="default: sglang_ext/ops/moe/configs")
    p.add_argument("--rep-ms", type=int, default=25, help="timing window per candidate (do_bench rep)")
    p.add_argument("--quick", action="store_true", help="a smaller candidate space (about 10x faster)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    geo = dict(PRESETS[a.preset]) if a.preset else {}
    for key in ("experts", "top_k", "hidden", "inter"):
        if getattr(a, key) is not None:
            geo[key] = getattr(a, key)
        if key not in geo:
            p.error(f"--{key.replace('_', '-')} (or --preset) is required")
    if geo["inter"] % a.tp or geo["experts"] % a.ep:
        p.error(f"--tp {a.tp} must divide I={geo['inter']} and --ep {a.ep} must divide E={geo['experts']}")
    a.geo = geo
    return a


def candidates(block_m: int, k_dim: int, n_dim: int, n_acc: int, quick: bool,
               many_blocks: bool) -> list[dict[str, int]]:
    """Configs for one GEMM at this BLOCK_M; n_acc = 2 for gate/up (gate and up tiles), 1 for down.

    `--quick` keeps BLOCK_N 32 where every pair fits one M block (decode sizes): there few experts are hit
    and a 64-wide tile leaves SMs idle (Mixtral T=1: the down GEMM ran 128 programs on 132 SMs at 3.4 TB/s,
    bench/sim/moe_occupancy.py)."""
    bns = ([64, 128] if many_blocks else [32, 64, 128]) if quick else [32, 64, 128, 256]
    bks = [64, 128] if quick else [32, 64, 128, 256]
    groups = ([1, 16] if quick else [1, 8, 16, 32]) if many_blocks else [1]
    warps = [4, 8]
    stages = [3, 4] if quick else [2, 3, 4, 5]
    out = []
    for bn, bk, gm, w, s in itertools.product(bns, bks, groups, warps, stages):
        if bn > max(32, 2 * n_dim) or bk > max(32, k_dim):
            continue
        if s * (block_m * bk + n_acc * bk * bn) * 2 > SMEM_BYTES:
            continue
        if n_acc * block_m * bn > MAX_ACC_REGS * w * 32:
            continue
        out.append({"BLOCK_M": block_m, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": gm, "num_warps": w, "num_stages": s})
    return out


def best_of(fn: Any, cands: list[dict[str, int]], rep_ms: int) -> tuple[float, dict[str, int] | None]:
    from triton.testing import do_bench

    best: tuple[float, dict[str, int] | None] = (float("inf"), None)
    for cfg in cands:
        try:
            ms = do_bench(lambda cfg=cfg: fn(cfg), warmup=5, rep=rep_ms)
        except Exception as e:  # out of resources on this GPU, or a compile error: not a candidate
            print(f"    skip {cfg}: {type(e).__name__}", file=sys.stderr)
            continue
        if ms < best[0]:
            best = (ms, cfg)
    return best


def block_m_choices(pairs_per_expert: float, quick: bool) -> list[int]:
    """The BLOCK_M values worth timing when each expert draws `pairs_per_expert` (token, slot) pairs.

    A tile much taller than an expert's rows only computes padding, so BLOCK_M stops at twice the
    next power of two. With `--quick` a tile much shorter than them is skipped too (more than 4 row
    blocks per expert): on the H200 such tiles lost every time they were timed (Mixtral T=128: BLOCK_M
    16 took 0.97 ms against 0.76 for 64; T=256: 1.41 against 0.81 for 128), and at prefill sizes they
    cost most of the tuning time (T=512 was cut by the time limit while timing them, 2026-12-03).
    """
    top = max(16, 2 * _next_pow2(int(pairs_per_expert) + 1))
    low = pairs_per_expert / 4 if quick else 0.0
    keep = [bm for bm in (16, 32, 64, 128) if low <= bm <= top]
    return keep or [128]


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def tune_batch(t: int, a: argparse.Namespace, tensors: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
    import torch
    import triton

    from sglang_ext.ops.moe import align, kernels, reference, route

    geo, e_local = a.geo, a.geo["experts"] // a.ep
    k, hidden, inter = geo["top_k"], geo["hidden"], geo["inter"] // a.tp
    w13, w2 = tensors["w13"], tensors["w2"]
    g = torch.Generator(device=w13.device).manual_seed(a.seed + t)
    x = torch.randn(t, hidden, device=w13.device, generator=g).to(tensors["dtype"])
    weights, ids = route.route(torch.randn(t, geo["experts"], device=w13.device, generator=g), k, True)
    pairs_per_expert = t * k / geo["experts"]
    block_ms = block_m_choices(pairs_per_expert, a.quick)
    best: tuple[float, dict[str, Any], dict[str, float]] = (float("inf"), {}, {})
    for bm in block_ms:
        al = align.align_block_size(ids, bm, e_local)
        align_ms = best_of(lambda cfg: align.align_block_size(ids, cfg["BLOCK_M"], e_local),
                           [{"BLOCK_M": bm}], a.rep_ms)[0]
        many = triton.cdiv(t * k, bm) > 1
        up_ms, up = best_of(lambda cfg, al=al: kernels.gate_up(x, w13, al, k, cfg),
                            candidates(bm, hidden, inter, 2, a.quick, many), a.rep_ms)
        if up is None:
            continue
        h = kernels.gate_up(x, w13, al, k, up)
        down_ms, down = best_of(lambda cfg, al=al, h=h: kernels.down(h, w2, weights, al, cfg),
                                candidates(bm, inter, hidden, 1, a.quick, many), a.rep_ms)
        if down is None:
            continue
        total = align_ms + up_ms + down_ms
        print(f"  T={t} BLOCK_M={bm}: align {align_ms:.4f} + gate_up {up_ms:.4f} + down {down_ms:.4f} ms")
        if total < best[0]:
            cfg = dict(up) | {"down": {key: val for key, val in down.items() if key != "BLOCK_M"}}
            best = (total, cfg, {"align_ms": align_ms, "gate_up_ms": up_ms, "down_ms": down_ms})
    if not best[1]:
        raise SystemExit(f"T={t}: no candidate ran on this GPU")
    out = kernels.fused_moe(x, w13, w2, weights, ids, config=best[1])
    ref = reference.fused_moe_ref(x, w13, w2, weights, ids)
    err = (out.float() - ref.float()).abs().max().item() / max(ref.float().abs().max().item(), 1e-6)
    if err > 2e-2:
        raise SystemExit(f"T={t}: config {best[1]} disagrees with the reference (relative error {err:.3g})")
    return best[1], best[2]


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import torch
    import triton

    from sglang_ext.ops.moe import configs

    if not torch.cuda.is_available():
        raise SystemExit("tune_moe.py needs a CUDA GPU (the configs are per device)")
    dtype = getattr(torch, a.dtype)
    geo, e_local, inter = a.geo, a.geo["experts"] // a.ep, a.geo["inter"] // a.tp
    g = torch.Generator(device="cuda").manual_seed(a.seed)
    hidden = geo["hidden"]
    tensors = {
        "dtype": dtype,
        "w13": (torch.randn(e_local, 2 * inter, hidden, device="cuda", generator=g) / hidden**0.5).to(dtype),
        "w2": (torch.randn(e_local, hidden, inter, device="cuda", generator=g) / inter**0.5).to(dtype),
    }
    device = configs.device_name(torch.device("cuda"))
    out_dir = a.out_dir or configs.CONFIG_DIR
    path = out_dir / configs.config_file_name(e_local, inter, hidden, dtype, device)
    table: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    timings: dict[str, Any] = {}
    print(f"tuning E={e_local} (of {geo['experts']}) k={geo['top_k']} H={hidden} I={inter} {a.dtype} on {device}")

    def write() -> None:  # after every batch size: a run cut short by its time limit keeps what it tuned
        table["_meta"] = {"written": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": device,
                          "top_k": geo["top_k"], "experts_total": geo["experts"], "triton": triton.__version__,
                          "torch": torch.__version__, "timings_ms": old_timings | timings}
        entries = sorted((k for k in table if not k.startswith("_")), key=int)
        out_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({k: table[k] for k in entries} | {"_meta": table["_meta"]}, indent=1) + "\n")

    old_timings = table.get("_meta", {}).get("timings_ms", {})
    for t in (int(s) for s in a.batch_sizes.split(",")):
        t0 = time.perf_counter()
        table[str(t)], timings[str(t)] = tune_batch(t, a, tensors)
        print(f"T={t}: {table[str(t)]} ({time.perf_counter() - t0:.0f} s)")
        write()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
