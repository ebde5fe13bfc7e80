"""Building blocks shared by every decoder family."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from sglang_ext import ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if ops.use_fused(x):  # one Triton kernel on GPU, same numerics
            return ops.rms_norm(x, self.weight, self.eps)
        # Normalise in float32 as the reference implementations do, then cast back.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency-dependent rescaling of RoPE (long wavelengths slowed by `factor`)."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE with a precomputed cos/sin table indexed by position."""

    cos: torch.Tensor  # [max_pos, D/2], a non-persistent buffer
    sin: torch.Tensor

    def __init__(
        self, head_dim: int, max_pos: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
        if kind in (None, "default"):
            pass
        elif kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling or {})
        elif kind == "linear":
            inv_freq = inv_freq / float((scaling or {})["factor"])
        else:
            raise ValueError(f"rope scaling type {kind!r} is not supported (default, linear, llama3)")
        t = torch.arange(max_pos, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D]."""
        if ops.use_fused(q):
            return ops.rope(positions, q, k, self.cos, self.sin)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    c = torch.cat([cos, cos], dim=-1)
    s = torch.cat([sin, sin], dim=-1)
    out = x32 * c + torch.cat([-x2, x1], dim=-1) * s
    return out.to(x.dtype)


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if ops.use_fused(x):
            return ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return nn.functional.silu(gate) * up
