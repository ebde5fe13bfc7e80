"""Llama 2 / 3 / 3.1+ (llama3 RoPE scaling is handled by `RotaryEmbedding`)."""

from __future__ import annotations

from sglang_ext.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """Plain pre-norm decoder: no QKV bias, no q/k norm, embeddings usually untied."""
