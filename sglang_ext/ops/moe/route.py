"""MoE routing in one Triton kernel: softmax over the experts, top-k, optional renormalisation.

Each program takes ROWS tokens as a [ROWS, E] tile in registers: float32 softmax, then k rounds of
"take the row maximum (lowest index on ties), mask it out", the picks collected into a [ROWS, k]
tile that is divided by its sum when renormalising and stored once.

`row_mask` ([T] bool, optional) marks the rows that are real tokens. A CUDA graph pads a decode batch to
its captured size, and a padding row's top-k would otherwise send it through up to k experts no real row
needs (Qwen3 at 12 rows padded to 16: a third more pairs, 82 experts read a layer instead of 69, ~19 %
more expert weights; the 2026-12-07 bs-12 step). A masked row gets the expert id -1, which no rank holds,
so the alignment and the expert GEMMs skip it, and weight 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Sizes that change with the batch are left unspecialized: Triton would otherwise compile another variant of
# the kernel for each divisibility of these ints (by 16, or == 1) the first time a batch brings one, in the
# middle of serving (a fresh machine's first server ran prefill forwards 2-5x slow for its first seconds:
# bench/results/2026-12-06-h200-s9/README.md); a hint lost on a loop bound costs nothing measurable.
SIZES = ("n_rows",)


@triton.jit(do_not_specialize=SIZES)
def _route_kernel(logits_ptr, w_ptr, ids_ptr, mask_ptr, n_rows, n_experts, stride_row,
                  TOP_K: tl.constexpr, RENORM: tl.constexpr, MASKED: tl.constexpr, ROWS: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    src = tl.minimum(rows, n_rows - 1).to(tl.int64)  # rows past the end read the last row, store nothing
    cols = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + src[:, None] * stride_row + cols[None, :], mask=cols[None, :] < n_experts,
                other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=1)[:, None])
    p = e / tl.sum(e, axis=1)[:, None]
    kcols = tl.arange(0, BLOCK_K)
    w = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([ROWS, BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=1)
        idx = tl.min(tl.where(p == best[:, None], cols[None, :], BLOCK_E), axis=1)
        w = tl.where(kcols[None, :] == j, best[:, None], w)
        ids = tl.where(kcols[None, :] == j, idx[:, None], ids)
        p = tl.where(cols[None, :] == idx[:, None], -1.0, p)  # probabilities are >= 0: never picked again
    if RENORM:
        w = w / tl.sum(w, axis=1)[:, None]
    if MASKED:  # padding rows: no expert (-1 is outside every rank's range), weight 0
        real = tl.load(mask_ptr + src) != 0
        ids = tl.where(real[:, None], ids, -1)
        w = tl.where(real[:, None], w, 0.0)
    out = rows[:, None].to(tl.int64) * TOP_K + kcols[None, :]
    mask = row_ok[:, None] & (kcols[None, :] < TOP_K)
    tl.store(w_ptr + out, w, mask=mask)
    tl.store(ids_ptr + out, ids, mask=mask)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          row_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `reference.moe_route_ref`: (weights [T, k] float32, ids [T, k] int32)."""
    t, n_experts = router_logits.shape
    assert 0 < top_k <= n_experts, f"top_k {top_k} must be in 1..{n_experts}"
    assert row_mask is None or row_mask.shape == (t,), (row_mask.shape, t)
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    weights = torch.empty((t, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=router_logits.device)
    if t:
        block_e = triton.next_power_of_2(n_experts)
        rows = max(1, min(16, 4096 // block_e))
        mask = ids if row_mask is None else row_mask.contiguous()  # any pointer when MASKED is off
        _route_kernel[(triton.cdiv(t, rows),)](
            router_logits, weights, ids, mask, t, n_experts, router_logits.stride(0),
            TOP_K=top_k, RENORM=renormalize, MASKED=row_mask is not None, ROWS=rows, BLOCK_E=block_e,
            BLOCK_K=triton.next_power_of_2(top_k), num_warps=4)
    return weights, ids
