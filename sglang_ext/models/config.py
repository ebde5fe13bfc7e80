"""Model geometry read from a Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


@dataclass(frozen=True)
class MoEConfig:
    """The sparse feed-forward of an MoE family (None on `ModelConfig` for dense models)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one routed expert
    renormalize: bool  # top-k weights divided by their sum (Mixtral; Qwen's `norm_topk_prob`)
    shared_intermediate_size: int  # Qwen2-MoE's always-on shared expert (0: none)
    sparse_layers: tuple[bool, ...]  # per layer: routed experts (True) or the dense MLP

    def active_expert_params(self, hidden: int) -> int:
        """Feed-forward parameters one token reads in a sparse layer: k experts, the router, the shared expert."""
        return self._ffn_params(hidden, self.top_k)

    def expert_params(self, hidden: int) -> int:
        """All feed-forward parameters of one sparse layer."""
        return self._ffn_params(hidden, self.num_experts)

    def _ffn_params(self, hidden: int, experts: int) -> int:
        shared = 3 * hidden * self.shared_intermediate_size + (hidden if self.shared_intermediate_size else 0)
        return experts * 3 * hidden * self.intermediate_size + hidden * self.num_experts + shared


def _moe(arch: str, cfg: dict[str, Any], layers: int) -> MoEConfig | None:
    if arch not in MOE_ARCHITECTURES:
        return None
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    if experts <= 0:
        raise ValueError(f"{arch}: config.json has no num_local_experts / num_experts")
    if arch == "MixtralForCausalLM":  # every layer sparse, Mixtral always renormalizes
        return MoEConfig(experts, int(cfg.get("num_experts_per_tok", 2)), int(cfg["intermediate_size"]), True, 0,
                         (True,) * layers)
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in cfg.get("mlp_only_layers") or ()}
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    return MoEConfig(
        num_experts=experts,
        top_k=int(cfg.get("num_experts_per_tok", 8 if arch == "Qwen3MoeForCausalLM" else 4)),
        intermediate_size=int(cfg["moe_intermediate_size"]),
        renormalize=bool(cfg.get("norm_topk_prob", False)),
        shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
        if arch == "Qwen2MoeForCausalLM" else 0,
        sparse_layers=sparse,
    )


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k (Qwen3)
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None
    raw: dict[str, Any]
    moe: MoEConfig | None = None  # the sparse feed-forward; None: a dense model

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        is_qwen2 = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        is_qwen3 = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
        # transformers v5 moves RoPE settings under `rope_parameters`; accept both spellings.
        rope = cfg.get("rope_parameters") or {}
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling")
        if scaling is None and rope.get("rope_type") not in (None, "default"):
            scaling = rope
        # Mistral v0.1 uses a 4K sliding window; v0.2+ sets null. Qwen2 carries one but disables it.
        window = cfg.get("sliding_window") if arch in ("MistralForCausalLM", "MixtralForCausalLM") else None
        if is_qwen2 or is_qwen3:
            window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            # a Qwen MoE without dense layers may omit it; then only the sparse block exists
            intermediate_size=int(cfg.get("intermediate_size") or 0),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", cfg.get("qkv_bias", is_qwen2))),
            qk_norm=is_qwen3,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            sliding_window=int(window) if window else None,
            raw=cfg,
            moe=_moe(arch, cfg, int(cfg["num_hidden_layers"])),
        )

    @classmethod
    def from_path(cls, path: str | Path) -> ModelConfig:
        p = Path(path)
        f = p / "config.json" if p.is_dir() else p
        if not f.exists():
            raise FileNotFoundError(f"no config.json at {p}")
        return cls.from_dict(json.loads(f.read_text()))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """All parameters (every expert): what the weights take in memory."""
        return self._params(active=False)

    def active_params(self) -> int:
        """Parameters one token reads: for an MoE, k routed experts (plus router and shared expert) per
        sparse layer instead of all of them; equal to `num_params` for a dense model."""
        return self._params(active=True)

    def _params(self, active: bool) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        total = v * h * (1 if self.tie_word_embeddings else 2) + h
        for layer in range(self.num_layers):
            m = self.moe
            if m is not None and m.sparse_layers[layer]:
                ffn = m.active_expert_params(h) if active else m.expert_params(h)
            else:
                ffn = 3 * h * i
            total += attn + ffn + 2 * h
        return total
