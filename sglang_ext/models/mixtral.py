"""Mixtral: Mistral's attention (GQA, no bias) with 8 experts, top-2 renormalized, in every layer."""

from __future__ import annotations

from sglang_ext.models.decoder import DecoderForCausalLM


class MixtralForCausalLM(DecoderForCausalLM):
    """`ModelConfig.moe` holds the sparse layers' geometry (models/config.py)."""
