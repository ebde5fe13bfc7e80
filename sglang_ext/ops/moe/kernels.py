"""The MoE expert sum as two grouped GEMMs over expert-aligned blocks, plus a deterministic reduce.

    route ─> align ─> gate_up GEMM + SiLU·mul ─> down GEMM × routed weight ─> sum over the k slots
    [T,k]    blocks   inter [T*k, I] (x dtype)   contrib [T*k, H] float32    out [T, H] (x dtype)

Both GEMMs launch one program per (BLOCK_M block, BLOCK_N column tile) of the largest possible
aligned length, ordered in GROUP_M bands so programs running together share weight tiles in L2;
programs past the device-side padded length return at once, so nothing is read back to the host.
A block's rows are gathered through `sorted_ids` and its weights are its expert's.

gate_up keeps two accumulators, the gate tile (rows n of w13[e]) and the up tile (rows I + n), and
applies SiLU(gate) * up in its epilogue, so the [T*k, 2I] projection is never written. down
multiplies the routed weight in its epilogue and writes each pair's contribution in float32; a
third kernel sums each token's k rows in slot order. That reduce (rather than float32 atomic adds
into [T, H]) keeps the result bit-identical from run to run, needs no zero-filled buffer, and skips
the slots of experts that are not local; it costs T*k*H*4 bytes of scratch.

Roundings follow `reference.fused_moe_ref`: gate, up, SiLU(gate) and the product are rounded to the
activation dtype, the down projection too before it is weighted, then float32 to the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_ext.ops.moe.align import Aligned, align_block_size
from sglang_ext.ops.moe.configs import Config, device_name, distinct_configs, get_config, split

# Sizes that change with the batch are left unspecialized: Triton would otherwise compile another variant of
# the kernel for each divisibility of these ints (by 16, or == 1) the first time a batch brings one, in the
# middle of serving (a fresh machine's first server ran prefill forwards 2-5x slow for its first seconds:
# bench/results/2026-12-06-h200-s9/README.md); a hint lost on a loop bound costs nothing measurable.
SIZES = ("n_pairs", "num_blocks_m")


@triton.jit
def _block_of(pid, num_blocks_m, n_cols, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(block, column tile) of program `pid`: GROUP_M blocks share each column tile in turn."""
    tiles_n = tl.cdiv(n_cols, BLOCK_N)
    band = GROUP_M * tiles_n
    first_m = (pid // band) * GROUP_M
    rows = tl.minimum(num_blocks_m - first_m, GROUP_M)
    return first_m + (pid % band) % rows, (pid % band) // rows


@triton.jit
def _rows_of(pid_m, pid_n, sorted_ptr, expert_ids_ptr, n_pairs, n_cols,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Block pid_m's pairs (padding slots hold n_pairs or more), their expert, and column tile pid_n."""
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return pair, pair < n_pairs, e, cols, cols < n_cols


@triton.jit(do_not_specialize=SIZES)
def _gate_up_kernel(x_ptr, w_ptr, out_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr,
                    n_pairs, top_k, n_inter, n_hidden, num_blocks_m,
                    stride_xt, stride_we, stride_wn, stride_wk, stride_ot,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, IEEE: tl.constexpr):
    pid_m, pid_n = _block_of(tl.program_id(0), num_blocks_m, n_inter, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pair, row_ok, e, cols, col_ok = _rows_of(pid_m, pid_n, sorted_ptr, expert_ids_ptr, n_pairs, n_inter,
                                             BLOCK_M, BLOCK_N)
    tok = (pair // top_k).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * stride_xt + ks[None, :]
    g_ptrs = w_ptr + e * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk
    u_ptrs = g_ptrs + n_inter * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, n_hidden, BLOCK_K):
        k_ok = ks < n_hidden - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        bg = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        bu = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if IEEE:
            acc_g = tl.dot(a, bg, acc_g, input_precision="ieee")
            acc_u = tl.dot(a, bu, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, bg, acc_g)
            acc_u = tl.dot(a, bu, acc_u)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    dt = out_ptr.dtype.element_ty
    g = acc_g.to(dt).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    h = (s * acc_u.to(dt).to(tl.float32)).to(dt)
    o_ptrs = out_ptr + pair[:, None].to(tl.int64) * stride_ot + cols[None, :]
    tl.store(o_ptrs, h, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=SIZES)
def _down_kernel(h_ptr, w_ptr, out_ptr, topk_w_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr,
                 n_pairs, n_hidden, n_inter, num_blocks_m,
                 stride_ht, stride_we, stride_wn, stride_wk, stride_ot,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, IEEE: tl.constexpr):
    pid_m, pid_n = _block_of(tl.program_id(0), num_blocks_m, n_hidden, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pair, row_ok, e, cols, col_ok = _rows_of(pid_m, pid_n, sorted_ptr, expert_ids_ptr, n_pairs, n_hidden,
                                             BLOCK_M, BLOCK_N)
    rows = pair.to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + rows[:, None] * stride_ht + ks[None, :]
    b_ptrs = w_ptr + e * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, n_inter, BLOCK_K):
        k_ok = ks < n_inter - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_wk
    weight = tl.load(topk_w_ptr + rows, mask=row_ok, other=0.0)
    y = acc.to(h_ptr.dtype.element_ty).to(tl.float32) * weight[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + cols[None, :], y, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_kernel(contrib_ptr, ids_ptr, out_ptr, n_hidden, top_k, first_expert, num_local,
                stride_ct, stride_ot, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < n_hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(top_k):
        e = tl.load(ids_ptr + t * top_k + j)
        local = (e >= first_expert) & (e < first_expert + num_local)
        acc += tl.load(contrib_ptr + (t * top_k + j) * stride_ct + cols, mask=col_ok & local, other=0.0)
    tl.store(out_ptr + t * stride_ot + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def _ieee(dtype: torch.dtype) -> bool:
    # float32 weights: full-precision products (not TF32), as torch's own matmul gives the reference
    return dtype == torch.float32


def gate_up(x: torch.Tensor, w13: torch.Tensor, al: Aligned, top_k: int, cfg: Config) -> torch.Tensor:
    """[T*k, I] in x's dtype: SiLU(gate) * up of each routed pair (rows of non-local pairs unwritten)."""
    n_pairs, inter, hidden = x.shape[0] * top_k, w13.shape[1] // 2, x.shape[1]
    out = torch.empty((n_pairs, inter), dtype=x.dtype, device=x.device)
    blocks_m = al.expert_ids.numel()
    grid = (blocks_m * triton.cdiv(inter, cfg["BLOCK_N"]),)
    _gate_up_kernel[grid](x, w13, out, al.sorted_ids, al.expert_ids, al.num_padded,
                          n_pairs, top_k, inter, hidden, blocks_m,
                          x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), out.stride(0),
                          BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                          GROUP_M=cfg["GROUP_M"], IEEE=_ieee(x.dtype),
                          num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def down(h: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, al: Aligned, cfg: Config) -> torch.Tensor:
    """[T*k, H] float32: each routed pair's down projection times its weight (non-local rows unwritten)."""
    n_pairs, hidden, inter = h.shape[0], w2.shape[1], w2.shape[2]
    out = torch.empty((n_pairs, hidden), dtype=torch.float32, device=h.device)
    blocks_m = al.expert_ids.numel()
    grid = (blocks_m * triton.cdiv(hidden, cfg["BLOCK_N"]),)
    _down_kernel[grid](h, w2, out, topk_weights, al.sorted_ids, al.expert_ids, al.num_padded,
                       n_pairs, hidden, inter, blocks_m,
                       h.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), out.stride(0),
                       BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                       GROUP_M=cfg["GROUP_M"], IEEE=_ieee(h.dtype),
                       num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def sum_slots(contrib: torch.Tensor, topk_ids: torch.Tensor, first_expert: int, num_local: int,
              dtype: torch.dtype) -> torch.Tensor:
    """[T, H] in `dtype`: each token's local contributions summed in float32, in slot order."""
    t, top_k = topk_ids.shape
    hidden = contrib.shape[1]
    out = torch.empty((t, hidden), dtype=dtype, device=contrib.device)
    block = min(1024, triton.next_power_of_2(hidden))
    _sum_kernel[(t, triton.cdiv(hidden, block))](contrib, topk_ids, out, hidden, top_k, first_expert, num_local,
                                                 contrib.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, first_expert: int = 0, config: dict[str, object] | None = None) -> torch.Tensor:
    """Same contract as `reference.fused_moe_ref`; `config` overrides the file/default lookup."""
    t, hidden = x.shape
    num_local, two_i, _ = w13.shape
    top_k = topk_ids.shape[1]
    assert w13.shape[2] == hidden and w2.shape == (num_local, hidden, two_i // 2), (x.shape, w13.shape, w2.shape)
    assert topk_weights.shape == topk_ids.shape == (t, top_k), (topk_weights.shape, topk_ids.shape)
    if t == 0:
        return torch.empty_like(x)
    if x.stride(-1) != 1:
        x = x.contiguous()
    w13 = w13 if w13.stride(-1) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(-1) == 1 else w2.contiguous()
    topk_ids = topk_ids.contiguous()
    topk_weights = topk_weights.to(torch.float32).contiguous()
    if config is None:
        config = get_config(t, top_k, num_local, two_i // 2, hidden, x.dtype, device_name(x.device))
    up_cfg, down_cfg = split(config)
    al = align_block_size(topk_ids, up_cfg["BLOCK_M"], num_local, first_expert)
    h = gate_up(x, w13, al, top_k, up_cfg)
    contrib = down(h, w2, topk_weights, al, down_cfg)
    return sum_slots(contrib, topk_ids, first_expert, num_local, x.dtype)


def compile_all(w13: torch.Tensor, w2: torch.Tensor, top_k: int, max_tokens: int, first_expert: int = 0) -> list[int]:
    """Run `fused_moe` once at the fewest tokens of each config it can pick up to `max_tokens`, so every
    variant is built (or read from Triton's disk cache) before serving; returns those token counts."""
    num_local, two_i, hidden = w13.shape
    counts = sorted(distinct_configs(max_tokens, top_k, num_local, two_i // 2, hidden, w13.dtype,
                                     device_name(w13.device)))
    g = torch.Generator(device=w13.device).manual_seed(0)
    for t in counts:
        x = torch.randn(t, hidden, generator=g, device=w13.device).to(w13.dtype)
        # k distinct experts a token, weights summing to 1: the shapes and ranges of a real routing
        ids = torch.rand(t, num_local, generator=g, device=w13.device).topk(top_k, dim=1).indices
        fused_moe(x, w13, w2, torch.full((t, top_k), 1.0 / top_k, device=w13.device),
                  (ids + first_expert).to(torch.int32), first_expert)
    return counts

