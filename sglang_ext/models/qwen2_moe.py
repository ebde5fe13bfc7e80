"""Qwen2-MoE: Qwen2's attention (QKV bias) with routed experts (top-k kept as routed unless
`norm_topk_prob`) and a shared expert under a sigmoid gate; `mlp_only_layers` and
`decoder_sparse_step` leave some layers dense."""

from __future__ import annotations

from sglang_ext.models.decoder import DecoderForCausalLM


class Qwen2MoeForCausalLM(DecoderForCausalLM):
    """`ModelConfig.moe` holds the sparse layers' geometry (models/config.py)."""
