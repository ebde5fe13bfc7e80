"""A pre-norm decoder-only transformer covering the Llama family.

Llama, Mistral, Qwen2 and Qwen3 differ only by switches in `ModelConfig` (QKV bias, per-head
q/k RMSNorm, tied embeddings, RoPE scaling); each family file names its switches. Q, K, V and
gate/up projections are fused into one matmul each; `load_weights` maps the HF names onto them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from sglang_ext.forward_batch import ForwardBatch
from sglang_ext.models.config import ModelConfig
from sglang_ext.models.layers import RMSNorm, RotaryEmbedding, SiluAndMul


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.cfg = cfg
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.rotary = rotary
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        c = self.cfg
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.reshape(t, c.num_heads, c.head_dim)
        k = k.reshape(t, c.num_kv_heads, c.head_dim)
        v = v.reshape(t, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        assert batch.attn_backend is not None
        o = batch.attn_backend.forward(q, k, v, self.layer_id, batch)
        return self.o_proj(o.reshape(t, c.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.act = SiluAndMul()
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        h = h + self.self_attn(positions, self.input_layernorm(h), batch)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        rotary = RotaryEmbedding(
            cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states (final-normed) of the rows in `batch.logits_indices`."""
        h = self.embed_tokens(batch.input_ids)
        for layer in self.layers:
            h = layer(batch.positions, h, batch)
        return self.norm(h[batch.logits_indices])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.matmul(hidden, w.t()).float()

    # ---- weights ------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        c = self.cfg
        params = dict(self.named_parameters())
        shards = {  # HF projection -> (fused parameter, row offset, rows)
            "q_proj": ("qkv_proj", 0, c.q_size),
            "k_proj": ("qkv_proj", c.q_size, c.kv_size),
            "v_proj": ("qkv_proj", c.q_size + c.kv_size, c.kv_size),
            "gate_proj": ("gate_up_proj", 0, c.intermediate_size),
            "up_proj": ("gate_up_proj", c.intermediate_size, c.intermediate_size),
        }
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            name = name.removeprefix("model.")
            parts = name.split(".")
            target, rows = name, None
            if len(parts) >= 2 and parts[-2] in shards:
                fused, off, n = shards[parts[-2]]
                target = ".".join([*parts[:-2], fused, parts[-1]])
                rows = (off, n)
            if target == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            if target not in params:
                raise KeyError(f"unexpected weight {name!r} for {c.architecture}")
            p = params[target]
            with torch.no_grad():
                if rows is None:
                    if p.shape != tensor.shape:
                        raise ValueError(f"{name}: shape {tuple(tensor.shape)} != expected {tuple(p.shape)}")
                    p.copy_(tensor)
                else:
                    p[rows[0] : rows[0] + rows[1]].copy_(tensor)
            loaded.add(target if rows is None else f"{target}:{rows[0]}")
        expected = self._expected_keys(shards)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weight(s), e.g. {missing[:3]}")

    def _expected_keys(self, shards: dict[str, tuple[str, int, int]]) -> set[str]:
        keys: set[str] = set()
        fused = {f for f, _, _ in shards.values()}
        for name, _ in self.named_parameters():
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in fused:
                for f, off, _ in shards.values():
                    if f == parts[-2] and (parts[-1] == "weight" or f == "qkv_proj"):
                        keys.add(f"{name}:{off}")
            else:
                keys.add(name)
        return keys
