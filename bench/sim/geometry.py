"""Model geometry as the cost model sees it: bytes a step reads, FLOPs a token costs, KV bytes a token holds.

The fitted rates (bench/sim/calibration/*.json) belong to a GPU; this file is what makes them carry to
another model: a decode step reads `weight_read_bytes(rows)` at the weights' bandwidth, `rows x flops_per_row`
at the GEMM rate, and the KV at the KV bandwidth. For an MoE, a step reads the dense weights plus only the
experts its tokens hit: with E experts, top-k routing and r rows routed uniformly, E * (1 - (1 - k/E)^r)
distinct experts per sparse layer are expected (bench/offline.py counts the real `experts_hit`). A trained
router is skewed: with `expert_pick` (each sparse layer's chance that a token picks each expert, from a
server's expert distribution record: bench/sim/expert_load.py) the experts hit are sum_e 1 - (1 - q_e)^r,
fewer than uniform routing's for the same r.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang_ext.configs import preset_config_file
from sglang_ext.models.config import ModelConfig

DTYPE_BYTES = 2  # bf16 weights and KV, as every measured run


def expected_experts_hit(num_experts: int, top_k: int, rows: float) -> float:
    """Distinct experts a sparse layer reads for `rows` tokens, each picking `top_k` of `num_experts`
    uniformly: every expert is missed by one token with probability 1 - k/E."""
    if num_experts <= 0 or rows <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** rows)


def skewed_experts_hit(pick: tuple[float, ...], rows: float) -> float:
    """Distinct experts one sparse layer reads for `rows` tokens when each token picks expert e with
    probability pick[e] (its marginal: a token's k picks are distinct, which this does not need) and the
    tokens pick independently: expert e is missed by all with probability (1 - pick[e])^rows. Uniform
    picks give expected_experts_hit. Real tokens of one batch are not independent (a request's tokens
    and similar prompts route alike), so a measured count can sit below this."""
    if rows <= 0:
        return 0.0
    return sum(1.0 - (1.0 - min(q, 1.0)) ** rows for q in pick)


@dataclass(frozen=True)
class Geometry:
    """What one model costs per step, independent of the GPU (bf16 weights and KV)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dense_weight_bytes: int  # read by every decode step: attention, dense MLPs, router, shared expert, LM head
    layer_params: int  # parameters one token multiplies by in the layers (k experts of a sparse layer)
    expert_bytes: int = 0  # one routed expert (gate, up, down)
    num_experts: int = 0
    top_k: int = 0
    sparse_layers: int = 0  # layers with routed experts
    # Per sparse layer, each expert's chance of being picked by one token (sums to top_k); () = uniform
    expert_pick: tuple[tuple[float, ...], ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and self.sparse_layers > 0

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * DTYPE_BYTES

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def flops_per_row(self) -> float:
        """GEMM FLOPs of one decode row (layers + LM head); attention is in the KV term."""
        return 2.0 * (self.layer_params + self.lm_head_params)

    def experts_hit(self, rows: float) -> float:
        """Distinct experts per sparse layer (the mean over layers) that `rows` tokens read."""
        if not self.is_moe:
            return 0.0
        if self.expert_pick:
            return sum(skewed_experts_hit(q, rows) for q in self.expert_pick) / len(self.expert_pick)
        return expected_experts_hit(self.num_experts, self.top_k, rows)

    def weight_read_bytes(self, rows: float, experts_hit: float | None = None) -> float:
        """Weight bytes one step over `rows` tokens reads: dense weights plus the experts hit per sparse
        layer (`experts_hit` measured, else the uniform-routing expectation)."""
        if not self.is_moe:
            return float(self.dense_weight_bytes)
        hit = self.experts_hit(rows) if experts_hit is None else experts_hit
        return self.dense_weight_bytes + self.sparse_layers * hit * self.expert_bytes

    def expert_flops(self, tokens: float) -> float:
        """GEMM FLOPs of the routed experts for `tokens` tokens (top-k experts each, every sparse layer)."""
        return self.expert_bytes / DTYPE_BYTES * 2.0 * self.top_k * tokens * self.sparse_layers

    def attention_flops(self, new: int, end: int) -> float:
        """Causal attention FLOPs (QK^T and PV) of `new` tokens ending at position `end`."""
        before = end - new
        pairs = new * before + new * (new + 1) / 2
        return 4.0 * self.layers * self.heads * self.head_dim * pairs

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, name: str = "") -> Geometry:
        """From the engine's ModelConfig; its `moe` (MoEConfig), where the engine has one, gives the
        sparse layers (read by attribute, so dense-only engines work too)."""
        h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
        attn = h * (q + 2 * kv) + q * h
        if cfg.attention_bias:
            attn += q + 2 * kv
        if cfg.qk_norm:
            attn += 2 * cfg.head_dim
        moe: Any = getattr(cfg, "moe", None)
        sparse = [bool(s) for s in moe.sparse_layers] if moe is not None else [False] * cfg.num_layers
        n_sparse = sum(sparse)
        dense_ffn = 3 * h * i
        expert = 3 * h * moe.intermediate_size if moe is not None else 0
        if moe is not None:
            shared = 3 * h * moe.shared_intermediate_size + (h if moe.shared_intermediate_size else 0)
            router_shared = h * moe.num_experts + shared
        else:
            router_shared = 0
        norms = 2 * h
        always = cfg.num_layers * (attn + norms) + (cfg.num_layers - n_sparse) * dense_ffn + n_sparse * router_shared
        lm_head = cfg.vocab_size * h
        layer_params = always + (n_sparse * moe.top_k * expert if moe is not None else 0)
        return cls(
            name=name or cfg.architecture,
            layers=cfg.num_layers, hidden=h, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim, vocab=cfg.vocab_size,
            dense_weight_bytes=DTYPE_BYTES * (always + lm_head + h),  # + the final norm
            layer_params=layer_params,
            expert_bytes=DTYPE_BYTES * expert,
            num_experts=moe.num_experts if moe is not None else 0,
            top_k=moe.top_k if moe is not None else 0,
            sparse_layers=n_sparse,
        )

    @classmethod
    def preset(cls, name: str) -> Geometry:
        """A geometry preset of sglang_ext/configs (`llama-3-8b`, `qwen2.5-32b`, ...); `preset:` accepted."""
        name = name.removeprefix("preset:")
        return cls.from_model_config(ModelConfig.from_path(preset_config_file(name)), name)
