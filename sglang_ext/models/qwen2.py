"""Qwen2 / Qwen2.5: QKV projections carry a bias; small sizes tie embeddings."""

from __future__ import annotations

from sglang_ext.models.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    """`ModelConfig.attention_bias` defaults to True for this architecture."""
