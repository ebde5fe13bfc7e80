"""Fused small ops for the GPU path, with the plain-torch reference everywhere else.

Each function takes the same tensors as the reference code in `models/layers.py` and the KV pool.
On a CUDA tensor (and when Triton imports) it runs one Triton kernel instead of the reference's
chain of small kernels; anywhere else the caller keeps its own reference path, so CPU behaviour
never changes. Callers ask `use_fused` at call time (bench/offline.py patches it to time the reference).
The MoE pair (`moe_route`, `fused_moe`) dispatches itself: kernels on CUDA, the torch references of
`ops/moe/reference.py` elsewhere (also exported, as `moe_route_ref` / `fused_moe_ref`).
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

import torch

from sglang_ext.ops.moe.reference import fused_moe_ref, moe_route_ref

if TYPE_CHECKING:
    from sglang_ext.kvcache.pool import KVPool

__all__ = ["fused_moe", "fused_moe_ref", "moe_route", "moe_route_ref", "rms_norm", "rope", "silu_and_mul",
           "store_kv", "use_fused", "warm_moe"]

_kernels: ModuleType | None = None
_import_failed = False
_moe: tuple[ModuleType, ModuleType] | None = None


def _load() -> ModuleType | None:
    global _kernels, _import_failed
    if _kernels is None and not _import_failed:
        try:
            from sglang_ext.ops import triton_kernels

            _kernels = triton_kernels
        except ImportError:  # no Triton on this machine: the reference path stays
            _import_failed = True
    return _kernels


def use_fused(x: torch.Tensor) -> bool:
    return x.is_cuda and _load() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    k = _load()
    assert k is not None
    return k.rms_norm(x, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    k = _load()
    assert k is not None
    return k.silu_and_mul(x)


def rope(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    kern = _load()
    assert kern is not None
    return kern.rope(positions, q, k, cos, sin)


def store_kv(pool: KVPool, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write k, v ([T, Hkv, D]) at slots `loc` of `layer`; the pool's own `write` elsewhere."""
    if use_fused(k):
        kern = _load()
        assert kern is not None
        kern.store_kv(pool.data, layer, loc, k, v)
    else:
        pool.write(layer, loc, k, v)


def _load_moe() -> tuple[ModuleType, ModuleType]:
    global _moe
    if _moe is None:
        from sglang_ext.ops.moe import kernels, route

        _moe = (route, kernels)
    return _moe


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
              row_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] (any float dtype) -> (topk_weights [T, k] float32, topk_ids [T, k] int32).

    Softmax over all E experts in float32, the k largest, divided by their sum when `renormalize`
    (Mixtral and Qwen3-MoE renormalize; Qwen2-MoE with norm_topk_prob false does not). One Triton
    kernel on CUDA. Rows where `row_mask` ([T] bool) is False get expert -1 (held by no rank) and weight 0,
    so the experts skip them: a CUDA graph's padding rows.
    """
    if use_fused(router_logits):
        return _load_moe()[0].route(router_logits, top_k, renormalize, row_mask)
    return moe_route_ref(router_logits, top_k, renormalize, row_mask)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int = 0,
) -> torch.Tensor:
    """sum_j w_j * down_e(silu(gate_e(x)) * up_e(x)) over each token's k routed experts.

    x [T, H]; w13 [E_local, 2*I, H] (rows 0:I the gate projection, I:2I the up projection, as HF
    transformers v5's `experts.gate_up_proj`); w2 [E_local, H, I]. topk ids are global: expert e uses
    w13[e - first_expert], and ids outside [first_expert, first_expert + E_local) contribute nothing.
    Returns [T, H] in x's dtype. On CUDA: block alignment and two grouped GEMMs (`ops/moe/kernels.py`),
    no host sync, so it can be captured in a CUDA graph.
    """
    if use_fused(x):
        return _load_moe()[1].fused_moe(x, w13, w2, topk_weights, topk_ids, first_expert)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, first_expert)


def warm_moe(w13: torch.Tensor, w2: torch.Tensor, top_k: int, max_tokens: int, first_expert: int = 0) -> list[int]:
    """Build every variant of the MoE kernels a forward of up to `max_tokens` tokens can use (one
    forward at the fewest tokens of each block-size config); returns those token counts, [] where the
    torch reference runs (nothing to build)."""
    if not use_fused(w13):
        return []
    return _load_moe()[1].compile_all(w13, w2, top_k, max_tokens, first_expert)
