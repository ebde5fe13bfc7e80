"""Triton kernels behind `sglang_ext.ops` (imported only on first CUDA use).

Numerics follow the torch reference in `models/layers.py`: reductions and rotations in float32,
with the same intermediate roundings to the activation dtype, so greedy outputs stay put.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# ---- RMSNorm --------------------------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, x_stride, out_stride, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / n_cols
    y = (x * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)  # reference: x32.to(dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * y.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    block = triton.next_power_of_2(d)
    warps = 8 if block >= 2048 else (4 if block >= 512 else 1)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, x2.stride(0), out.stride(0), d, eps,
                                         BLOCK=block, num_warps=warps)
    return out.view(x.shape)


# ---- SiLU(gate) * up ------------------------------------------------------------------------------
@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * x_stride + n + cols, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)  # reference: silu output in dtype
    tl.store(out_ptr + row * out_stride + cols, (s.to(tl.float32) * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    block = 1024
    if x2.shape[0]:
        _silu_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](x2, out, x2.stride(0), out.stride(0), n,
                                                               BLOCK=block, num_warps=4)
    return out.view(*x.shape[:-1], n)


# ---- RoPE (neox, rotate-half) on q and k in one launch -------------------------------------------------
@triton.jit
def _rope_heads(src, dst, t, s_stride_t, s_stride_h, d_stride_t, n_heads, c, s, half,
                BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < n_heads) & (d < half)
    base = src + t * s_stride_t + h * s_stride_h + d
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    out = dst + t * d_stride_t + h * (2 * half) + d
    tl.store(out, o1.to(dst.dtype.element_ty), mask=mask)
    tl.store(out + half, o2.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(pos_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, qo_ptr, ko_ptr,
                 q_stride_t, q_stride_h, k_stride_t, k_stride_h, qo_stride_t, ko_stride_t, tab_stride,
                 n_q, n_k, half, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + t)
    d = tl.arange(0, BLOCK_D)[None, :]
    c = tl.load(cos_ptr + p * tab_stride + d, mask=d < half, other=0.0)
    s = tl.load(sin_ptr + p * tab_stride + d, mask=d < half, other=0.0)
    _rope_heads(q_ptr, qo_ptr, t, q_stride_t, q_stride_h, qo_stride_t, n_q, c, s, half, BLOCK_HQ, BLOCK_D)
    _rope_heads(k_ptr, ko_ptr, t, k_stride_t, k_stride_h, ko_stride_t, n_k, c, s, half, BLOCK_HK, BLOCK_D)


def rope(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hk, D] (any row/head strides, unit stride on D); cos/sin [P, D/2] float32."""
    t, hq, d = q.shape
    hk = k.shape[1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    qo = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    ko = torch.empty((t, hk, d), dtype=k.dtype, device=k.device)
    if t:
        _rope_kernel[(t,)](positions, cos, sin, q, k, qo, ko,
                           q.stride(0), q.stride(1), k.stride(0), k.stride(1), qo.stride(0), ko.stride(0),
                           cos.stride(0), hq, hk, d // 2,
                           BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HK=triton.next_power_of_2(hk),
                           BLOCK_D=triton.next_power_of_2(d // 2), num_warps=4)
    return qo, ko


# ---- KV-cache store into the block-first pool ---------------------------------------------------------
@triton.jit
def _store_kv_kernel(loc_ptr, k_ptr, v_ptr, data_ptr, k_stride_t, v_stride_t,
                     page_stride, layer_off, kv_stride, off_stride, page_size, n, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    loc = tl.load(loc_ptr + t).to(tl.int64)
    page = loc // page_size
    dst = data_ptr + page * page_stride + layer_off + (loc - page * page_size) * off_stride
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    kx = tl.load(k_ptr + t * k_stride_t + cols, mask=mask)
    vx = tl.load(v_ptr + t * v_stride_t + cols, mask=mask)
    tl.store(dst + cols, kx.to(data_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + kv_stride + cols, vx.to(data_ptr.dtype.element_ty), mask=mask)


def store_kv(data: torch.Tensor, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """data [pages, layers, 2, P, Hkv, D] (contiguous); k, v [T, Hkv, D] with (Hkv, D) dense per row."""
    t, h, d = k.shape
    if k.stride(2) != 1 or k.stride(1) != d:
        k = k.contiguous()
    if v.stride(2) != 1 or v.stride(1) != d:
        v = v.contiguous()
    if t:
        _store_kv_kernel[(t,)](loc, k, v, data, k.stride(0), v.stride(0),
                               data.stride(0), layer * data.stride(1), data.stride(2), data.stride(3),
                               data.shape[3], h * d, BLOCK=triton.next_power_of_2(h * d), num_warps=4)
