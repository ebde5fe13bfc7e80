"""Qwen3 (dense): per-head RMSNorm on q and k before RoPE, explicit head_dim, no QKV bias."""

from __future__ import annotations

from sglang_ext.models.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    """`ModelConfig.qk_norm` is True for this architecture."""
