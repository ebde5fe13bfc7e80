"""A pre-norm decoder-only transformer covering the Llama family and its MoE relatives.

Llama, Mistral, Qwen2 and Qwen3 differ only by switches in `ModelConfig` (QKV bias, per-head
q/k RMSNorm, tied embeddings, RoPE scaling); Mixtral, Qwen2-MoE and Qwen3-MoE add `ModelConfig.moe`,
which puts a `SparseMoeBlock` where a layer's MLP was (models/moe.py). Each family file names its
switches. Q, K, V and gate/up projections are fused into one matmul each, experts are stacked;
`load_weights` maps the HF names onto them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from sglang_ext.forward_batch import ForwardBatch
from sglang_ext.models.config import ModelConfig
from sglang_ext.models.layers import RMSNorm, RotaryEmbedding, SiluAndMul
from sglang_ext.models.moe import (
    Experts,
    ExpertSlice,
    SparseMoeBlock,
    checkpoint_name,
    expected_expert_keys,
    expert_slice,
)


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
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.act = SiluAndMul()
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        sparse = cfg.moe is not None and cfg.moe.sparse_layers[layer_id]
        self.mlp: nn.Module = (SparseMoeBlock(cfg, cfg.moe, MLP) if cfg.moe is not None and sparse
                               else MLP(cfg.hidden_size, cfg.intermediate_size))
        self.sparse = isinstance(self.mlp, SparseMoeBlock)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        h = h + self.self_attn(positions, self.input_layernorm(h), batch)
        x = self.post_attention_layernorm(h)
        # a dense MLP costs the same for padding rows as for real ones; only the experts can skip them
        return h + (self.mlp(x, batch.row_mask) if self.sparse else self.mlp(x))


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
        # HF projection -> (fused parameter, part); a part's rows come from the parameter it lands in,
        # since a shared expert's gate_up is narrower than the dense MLP's.
        shards = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                  "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        split = {"qkv_proj": (c.q_size, c.kv_size, c.kv_size)}
        experts = {n: m for n, m in self.named_modules() if isinstance(m, Experts)}
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            name = checkpoint_name(name.removeprefix("model."))
            hit = expert_slice(name, experts)
            if hit is not None:
                self._load_expert(params, name, tensor, *hit, loaded)
                continue
            parts = name.split(".")
            target, rows = name, None
            part = None
            if len(parts) >= 2 and parts[-2] in shards:
                fused, part = shards[parts[-2]]
                target = ".".join([*parts[:-2], fused, parts[-1]])
            if target == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            if target not in params:
                raise KeyError(f"unexpected weight {name!r} for {c.architecture}")
            p = params[target]
            if part is not None:
                sizes = split.get(fused) or (p.shape[0] // 2,) * 2
                rows = (sum(sizes[:part]), sizes[part])
            with torch.no_grad():
                if rows is None:
                    if p.shape != tensor.shape:
                        raise ValueError(f"{name}: shape {tuple(tensor.shape)} != expected {tuple(p.shape)}")
                    p.copy_(tensor)
                else:
                    p[rows[0] : rows[0] + rows[1]].copy_(tensor)
            prefix = target.rsplit(".", 1)[0]
            if prefix in experts:  # stacked experts (transformers v5 names): every expert at once
                module = experts[prefix]
                loaded |= {k for k in expected_expert_keys(prefix, module) if k.startswith(target + ":")}
            else:
                loaded.add(target if part is None else f"{target}:{part}")
        expected = self._expected_keys(shards, experts)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weight(s), e.g. {missing[:3]}")

    @staticmethod
    def _load_expert(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor, where: ExpertSlice,
                     expert: int, loaded: set[str]) -> None:
        if where.local is None:
            return  # another GPU's expert
        p = params[where.param][where.local]
        if where.param.endswith("gate_up_proj"):
            p = p[where.part * (p.shape[0] // 2) : (where.part + 1) * (p.shape[0] // 2)]
        if p.shape != tensor.shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} != expected {tuple(p.shape)}")
        with torch.no_grad():
            p.copy_(tensor)
        loaded.add(where.key(expert))

    def _expected_keys(self, shards: dict[str, tuple[str, int]], experts: dict[str, Experts]) -> set[str]:
        keys: set[str] = set()
        fused = {f for f, _ in shards.values()}
        for prefix, module in experts.items():
            keys |= expected_expert_keys(prefix, module)
        for name, _ in self.named_parameters():
            if name.rsplit(".", 1)[0] in experts:
                continue
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in fused:
                for f, part in shards.values():
                    if f == parts[-2] and (parts[-1] == "weight" or f == "qkv_proj"):
                        keys.add(f"{name}:{part}")
            else:
                keys.add(name)
        return keys
