"""Two MoE numerics figures behind tests/test_gpu_moe.py's logits bar, on CPU (or a GPU where there is one):

  python bench/moe_numerics.py [--out FILE.json]

1. Router ties: the bf16 router logits of the test's tiny models (its geometries, weights sharpened x2,
   teacher-forced prefill of its six prompts + 10 greedy decode steps, torch reference path) that tie
   exactly between the k-th and the (k+1)-th expert, and those within one bf16 step (2^-7 relative).
   A tie is a choice torch.topk and the routing kernel may make differently.
2. Kernel error: the Triton fused MoE on bf16 inputs against the torch reference on the same inputs,
   both measured against float32 math (relative Frobenius error). Without CUDA the kernel runs under
   Triton's interpreter with tests/_triton_interp's fixes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the test helpers build the tiny models and patch the interpreter

import _triton_interp  # noqa: E402

DEVICE = _triton_interp.device()  # before any kernel is imported

import torch  # noqa: E402
from _batch_util import PagedSeqs  # noqa: E402
from _tiny import prompts, tiny_config  # noqa: E402

from sglang_ext.engine.model_runner import ModelRunner  # noqa: E402
from sglang_ext.forward_batch import ForwardMode  # noqa: E402
from sglang_ext.ops.moe import fused_moe_ref, kernels, moe_route_ref  # noqa: E402
from sglang_ext.server_args import ServerArgs  # noqa: E402

GEOMETRIES = {  # tests/test_gpu_moe.py's
    "mixtral": (2, dict(architectures=["MixtralForCausalLM"], num_local_experts=8, num_experts_per_tok=2,
                        intermediate_size=512)),
    "qwen3-moe": (8, dict(architectures=["Qwen3MoeForCausalLM"], num_experts=32, num_experts_per_tok=8,
                          moe_intermediate_size=256, norm_topk_prob=True, head_dim=128)),
}


def router_ties(geom: str) -> dict[str, Any]:
    k, over = GEOMETRIES[geom]
    cfg = tiny_config(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, **over)
    args = ServerArgs(device="cpu", dtype="bfloat16", load_format="dummy", page_size=16, attention_backend="torch",
                      max_total_tokens=4096)
    r = ModelRunner(args, None, cfg)  # type: ignore[arg-type]
    with torch.no_grad():
        for p in r.model.parameters():
            if p.dim() >= 2:
                p.mul_(2.0)
    n = {"decisions": 0, "exact_ties": 0, "within_one_bf16_step": 0}

    def hook(_m: Any, _inp: Any, out: torch.Tensor) -> None:
        s = out.float().sort(-1, descending=True).values
        n["decisions"] += s.shape[0]
        n["exact_ties"] += int((s[:, k - 1] == s[:, k]).sum())
        n["within_one_bf16_step"] += int(((s[:, k - 1] - s[:, k]).abs() <= s[:, k - 1].abs() * 2**-7).sum())

    for name, m in r.model.named_modules():
        if name.endswith("gate") and isinstance(m, torch.nn.Linear):
            m.register_forward_hook(hook)
    ps = prompts([5, 17, 33, 9, 40, 3], seed=3)
    paged = PagedSeqs(r.pool, seed=1)
    seqs = [paged.new_seq() for _ in ps]
    with torch.no_grad():
        nxt = r.forward(paged.batch(ForwardMode.EXTEND, seqs, ps)).argmax(-1)
        for _ in range(10):
            nxt = r.forward(paged.batch(ForwardMode.DECODE, seqs, [[t] for t in nxt.tolist()])).argmax(-1)
    return {"geometry": geom, "top_k": k, **n}


def kernel_error(e: int, k: int, h: int, i: int, t: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5 * 2
    w2 = torch.randn(e, h, i, generator=g) / i**0.5 * 2
    x = torch.randn(t, h, generator=g) * 2
    wts, ids = moe_route_ref(torch.randn(t, e, generator=g), k, True)
    xb, w13b, w2b = (v.bfloat16().to(DEVICE) for v in (x, w13, w2))
    wts, ids = wts.to(DEVICE), ids.to(DEVICE)
    exact = fused_moe_ref(xb.float(), w13b.float(), w2b.float(), wts, ids)  # the same bf16 inputs, float32 math
    ref = fused_moe_ref(xb, w13b, w2b, wts, ids).float()
    fused = kernels.fused_moe(xb, w13b, w2b, wts, ids, 0).float()

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    return {"E": e, "k": k, "H": h, "I": i, "T": t, "reference_vs_fp32": rel(ref, exact),
            "fused_vs_fp32": rel(fused, exact), "fused_vs_reference": rel(fused, ref)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    res: dict[str, Any] = {"device": DEVICE, "torch": torch.__version__, "ties": [], "kernel": []}
    for geom in GEOMETRIES:
        row = router_ties(geom)
        res["ties"].append(row)
        print(f"{geom}: {row['exact_ties']} of {row['decisions']} routing decisions tie exactly at the k-th place, "
              f"{row['within_one_bf16_step']} within one bf16 step")
    for shape in ((8, 2, 1024, 512, 6), (32, 8, 1024, 256, 6), (8, 2, 1024, 512, 64)):
        row = kernel_error(*shape)
        res["kernel"].append(row)
        print(f"E={row['E']} k={row['k']} T={row['T']}: bf16 reference vs fp32 {row['reference_vs_fp32']:.2e}, "
              f"fused vs fp32 {row['fused_vs_fp32']:.2e}, fused vs reference {row['fused_vs_reference']:.2e} "
              f"({DEVICE})")
    if a.out:
        a.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
