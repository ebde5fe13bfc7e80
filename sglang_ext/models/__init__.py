"""Model families, picked by the `architectures` field of config.json."""

from __future__ import annotations

import importlib
from typing import Final

from sglang_ext.models.config import ModelConfig
from sglang_ext.models.decoder import DecoderForCausalLM

_FAMILIES: Final = {
    "LlamaForCausalLM": "sglang_ext.models.llama",
    "MistralForCausalLM": "sglang_ext.models.mistral",
    "Qwen2ForCausalLM": "sglang_ext.models.qwen2",
    "Qwen3ForCausalLM": "sglang_ext.models.qwen3",
    "MixtralForCausalLM": "sglang_ext.models.mixtral",
    "Qwen2MoeForCausalLM": "sglang_ext.models.qwen2_moe",
    "Qwen3MoeForCausalLM": "sglang_ext.models.qwen3_moe",
}


def model_class(cfg: ModelConfig) -> type[DecoderForCausalLM]:
    module = importlib.import_module(_FAMILIES[cfg.architecture])
    return getattr(module, cfg.architecture)


__all__ = ["DecoderForCausalLM", "ModelConfig", "model_class"]
