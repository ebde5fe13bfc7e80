"""Plain-torch Mixture-of-Experts routing and expert sum: the CPU path and the kernels' yardstick.

Numerics follow HF transformers: each expert's MLP runs in the activation dtype (gate/up projection,
SiLU(gate) * up, down projection, each rounded to that dtype as torch rounds them), and the routed
contributions are summed in float32 and cast once at the end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_route_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                  row_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (weights [T, k] float32, ids [T, k] int32), largest first.

    Softmax over all E experts in float32, then the k largest; `renormalize` divides them by their
    sum (Mixtral, Qwen3-MoE), otherwise they stay softmax probabilities (Qwen2-MoE's norm_topk_prob false).
    Rows where `row_mask` ([T] bool) is False (a CUDA graph's padding) get expert -1 and weight 0: no expert.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    ids = ids.to(torch.int32)
    if row_mask is not None:
        real = row_mask.to(torch.bool)[:, None]
        weights = torch.where(real, weights, 0.0)
        ids = torch.where(real, ids, -1)
    return weights, ids


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int = 0,
) -> torch.Tensor:
    """sum_j w_j * down_e(silu(gate_e(x)) * up_e(x)) over each token's routed experts.

    x [T, H]; w13 [E_local, 2I, H] (gate rows then up rows); w2 [E_local, H, I]; ids are global and
    only those in [first_expert, first_expert + E_local) count. Loops over the experts actually hit.
    """
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    local = topk_ids.long() - first_expert
    hit = (local >= 0) & (local < w13.shape[0])
    for e in torch.unique(local[hit]).tolist():
        tok, slot = torch.nonzero(local == e, as_tuple=True)
        gate, up = F.linear(x[tok], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e])
        out.index_add_(0, tok, y.float() * topk_weights[tok, slot, None].float())
    return out.to(x.dtype)
