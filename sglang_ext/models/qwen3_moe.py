"""Qwen3-MoE: Qwen3's attention (q/k RMSNorm) with 128 experts, top-8 renormalized (norm_topk_prob)."""

from __future__ import annotations

from sglang_ext.models.decoder import DecoderForCausalLM


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    """`ModelConfig.moe` holds the sparse layers' geometry (models/config.py)."""
