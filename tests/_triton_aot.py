"""Compile the MoE Triton kernels ahead of time for an H100/H200 (sm_90) on a machine without a GPU.

Run as a script by tests/test_triton_aot.py, in a process of its own: the other kernel tests switch on
Triton's interpreter (TRITON_INTERPRET=1) at import, and an interpreted kernel cannot be compiled. The
interpreter checks what a kernel computes; this checks that the GPU compiler accepts it (types, layouts,
masks: a bool pointer loaded as the mask, say), which the interpreter does not. Prints one line a kernel.
"""

from __future__ import annotations

import os
import sys

assert not os.environ.get("TRITON_INTERPRET"), "run without the interpreter"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from sglang_ext.ops.moe import align, kernels, route  # noqa: E402
from sglang_ext.ops.moe.configs import default_config, split  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)  # H100 and H200


def build(name: str, fn: triton.JITFunction, types: dict[str, str], consts: dict[str, object],
          **options: object) -> None:
    """`types` by argument name ("*bf16", "i32", ...); every name in `consts` is a constexpr."""
    sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=TARGET,
                              options=options or None)
    print(f"{name}: {len(compiled.asm['cubin'])} bytes of sm_90 cubin")


def main() -> int:
    # Qwen3-30B-A3B's expert count and top-k, bf16; the tiles of a decode batch (16) and a prefill (4,096)
    e, k = 128, 8
    ptr = {"logits_ptr": "*bf16", "w_ptr": "*fp32", "ids_ptr": "*i32"}
    for masked in (False, True):
        build(f"route masked={masked}", route._route_kernel, {**ptr, "mask_ptr": "*i1" if masked else "*i32"},
              {"TOP_K": k, "RENORM": True, "MASKED": masked, "ROWS": 16, "BLOCK_E": 128, "BLOCK_K": 8})
    ids = {"ids_ptr": "*i32", "counts_ptr": "*i32", "sorted_ptr": "*i32", "expert_ids_ptr": "*i32",
           "num_padded_ptr": "*i32"}
    build("align count", align._count_kernel, ids, {"BLOCK": align.SCAN}, num_warps=4)
    gemm = {"x_ptr": "*bf16", "h_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "topk_w_ptr": "*fp32",
            "sorted_ptr": "*i32", "expert_ids_ptr": "*i32", "num_padded_ptr": "*i32"}
    for t in (16, 4096):
        up_cfg, down_cfg = split(default_config(t, k, e))
        build(f"align place (BLOCK_M {up_cfg['BLOCK_M']})", align._place_kernel, ids,
              {"BLOCK_M": up_cfg["BLOCK_M"], "BLOCK": align.SCAN, "BLOCK_E": 128}, num_warps=4)
        for name, fn, cfg, out in (("gate_up", kernels._gate_up_kernel, up_cfg, "*bf16"),
                                   ("down", kernels._down_kernel, down_cfg, "*fp32")):
            tiles = {c: cfg[c] for c in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")}
            build(f"{name} {tiles}", fn, {**gemm, "out_ptr": out}, {**tiles, "IEEE": False},
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    build("slot sum", kernels._sum_kernel, {"contrib_ptr": "*fp32", "ids_ptr": "*i32", "out_ptr": "*bf16"},
          {"BLOCK": 1024}, num_warps=4)
    return 0


if __name__ == "__main__":
    sys.exit(main())
