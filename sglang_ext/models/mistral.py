"""Mistral 7B: Llama geometry with GQA; v0.1's 4K sliding window is read into the config."""

from __future__ import annotations

from sglang_ext.models.decoder import DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    """Same blocks as Llama. Sliding-window attention is not applied: the scheduler caps the
    context at `sliding_window` tokens for models that set one, so results stay exact."""
