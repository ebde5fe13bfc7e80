"""Fused small ops for the GPU path, with the plain-torch reference everywhere else.

Each function takes the same tensors as the reference code in `models/layers.py` and the KV pool.
On a CUDA tensor (and when Triton imports) it runs one Triton kernel instead of the reference's
chain of small kernels; anywhere else the caller keeps its own reference path, so CPU behaviour
never changes. Callers ask `use_fused` at call time (bench/offline.py patches it to time the reference).
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglang_ext.kvcache.pool import KVPool

_kernels: ModuleType | None = None
_import_failed = False


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
