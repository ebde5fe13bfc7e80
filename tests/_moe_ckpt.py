"""A small Mixtral checkpoint written by transformers (4 experts, top-2, two layers, the default
model's vocabulary), for tests that load an MoE model from an HF directory."""

from __future__ import annotations

from pathlib import Path

import torch

from sglang_ext.models.default_model import VOCAB_SIZE


def write_mixtral(d: Path) -> None:
    import transformers

    cfg = transformers.MixtralConfig(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=4096,
        sliding_window=None, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # peaked logits: no near-ties for greedy decoding to break differently
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else 0.15 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(d, safe_serialization=True)
