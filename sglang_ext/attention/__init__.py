"""Attention backends, picked by name; imports are lazy so CPU machines never load GPU code."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from sglang_ext.attention.base import AttentionBackend

_REGISTRY: Final = {
    "torch": "sglang_ext.attention.torch_backend:TorchAttentionBackend",
    "flashinfer": "sglang_ext.attention.flashinfer_backend:FlashInferAttentionBackend",
}


def get_backend_class(name: str) -> type[AttentionBackend]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(_REGISTRY)}")
    module, _, cls = _REGISTRY[name].partition(":")
    return getattr(importlib.import_module(module), cls)
