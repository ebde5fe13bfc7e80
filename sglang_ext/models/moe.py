"""The sparse feed-forward of the MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE).

Experts are stored stacked, `[E_local, ...]`, the layout the fused kernels read: `gate_up_proj`
`[E, 2I, H]` (gate rows first, as the dense MLP's fused projection and transformers v5's
`experts.gate_up_proj`) and `down_proj` `[E, H, I]`. `first_expert` is the global id of local
expert 0: today every GPU holds all experts (0), and a later split by expert only changes which
slice a worker builds and loads, not the loader's names or the kernels' interface.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

import torch
from torch import nn

from sglang_ext import ops
from sglang_ext.models.config import ModelConfig, MoEConfig


class Experts(nn.Module):
    """The routed experts' weights, stacked; `forward` applies the experts chosen by the router."""

    def __init__(self, hidden: int, moe: MoEConfig, first_expert: int = 0, num_local: int | None = None) -> None:
        super().__init__()
        self.first_expert = first_expert
        self.num_local = moe.num_experts if num_local is None else num_local
        i = moe.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_local, 2 * i, hidden))
        self.down_proj = nn.Parameter(torch.empty(self.num_local, hidden, i))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        # Triton on GPU (tokens aligned per expert, grouped GEMMs, graph-safe); the torch reference elsewhere
        return ops.fused_moe(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids, self.first_expert)


class SparseMoeBlock(nn.Module):
    """Router (a linear layer to E logits, softmax, top-k, optional renormalisation), the routed
    experts, and Qwen2-MoE's shared expert scaled by a sigmoid gate."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig, dense_mlp: type[nn.Module]) -> None:
        super().__init__()
        self.moe = moe
        # --moe-routing-simulation uniform (benchmarks of dummy weights): k distinct experts at random per token
        self.uniform_routing = False
        # --expert-distribution-recorder-mode stat: this layer's row [E] (int64, on the device) of the model's
        # counts (models/expert_counts.py), to which every forward adds the experts its real rows were routed to
        self.expert_counts: torch.Tensor | None = None
        self.gate = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)
        self.experts = Experts(cfg.hidden_size, moe)
        self.shared_expert: nn.Module | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if moe.shared_intermediate_size:
            self.shared_expert = dense_mlp(cfg.hidden_size, moe.shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, row_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`row_mask` ([T] bool): rows that are real tokens; the others (a CUDA graph's padding) reach no
        routed expert, and their output is the shared expert's alone (0 without one)."""
        logits = self.gate(x)
        if self.uniform_routing:
            # the top k of uniform noise: k distinct experts, each set equally likely; the router's matmul
            # still runs so the step's cost is the real one. torch's RNG is safe inside CUDA graphs (every
            # replay draws anew).
            logits = torch.rand(logits.shape, device=logits.device, dtype=torch.float32)
        weights, ids = ops.moe_route(logits, self.moe.top_k, self.moe.renormalize, row_mask)
        if self.expert_counts is not None:
            count_routed(self.expert_counts, ids)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def simulate_uniform_routing(model: nn.Module) -> int:
    """Switch every sparse block of `model` to random uniform routing; returns how many there are."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    for b in blocks:
        b.uniform_routing = True
    return len(blocks)


def count_routed(counts: torch.Tensor, ids: torch.Tensor) -> None:
    """Add 1 to `counts[e]` ([E] int64) for each (token, expert e) pair of `ids` ([T, k]); the -1 of masked
    rows (a CUDA graph's padding) adds 0. In place, no host sync and no shape that depends on the ids,
    so a captured graph repeats it on every replay."""
    flat = ids.reshape(-1)
    counts.index_add_(0, flat.clamp(min=0), (flat >= 0).to(counts.dtype))


# ---- checkpoint names -------------------------------------------------------------------------
# One expert's tensors in HF checkpoints: Mixtral's w1 (gate) / w3 (up) / w2 (down) under
# `block_sparse_moe`, Qwen's gate_proj / up_proj / down_proj under `mlp` (after `checkpoint_name`).
_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_PART: Final = {"w1": ("gate_up_proj", 0), "gate_proj": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1),
                "up_proj": ("gate_up_proj", 1), "w2": ("down_proj", 0), "down_proj": ("down_proj", 0)}


def checkpoint_name(name: str) -> str:
    """Mixtral's `block_sparse_moe` is the `mlp` of the other families."""
    return name.replace(".block_sparse_moe.", ".mlp.")


@dataclass(frozen=True)
class ExpertSlice:
    """Where one expert's checkpoint tensor lands: `param[local]`, rows `part*I : (part+1)*I` of
    gate_up (gate 0, up 1), the whole of down."""

    param: str
    local: int | None  # None: the expert is not held here (another GPU's, once split by expert)
    part: int

    def key(self, expert: int) -> str:
        return f"{self.param}:{expert}:{self.part}"


def expert_slice(name: str, experts: dict[str, Experts]) -> tuple[ExpertSlice, int] | None:
    """(slice, global expert id) for a per-expert checkpoint tensor, None for any other name."""
    m = _EXPERT.match(name)
    if m is None or m.group(1) not in experts:
        return None
    prefix, e, which = m.group(1), int(m.group(2)), m.group(3)
    module = experts[prefix]
    attr, part = _PART[which]
    local = e - module.first_expert
    return ExpertSlice(f"{prefix}.{attr}", local if 0 <= local < module.num_local else None, part), e


def expected_expert_keys(prefix: str, module: Experts) -> set[str]:
    first = module.first_expert
    keys = {f"{prefix}.gate_up_proj:{e}:{p}" for e in range(first, first + module.num_local) for p in (0, 1)}
    return keys | {f"{prefix}.down_proj:{e}:0" for e in range(first, first + module.num_local)}
