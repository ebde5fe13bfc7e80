"""--expert-distribution-recorder-mode stat: how many tokens the router sends to each expert of each MoE layer.

One int64 buffer on the model's device, [sparse layers, experts], allocated once at load (before the decode
CUDA graphs are captured); each `SparseMoeBlock` holds a view of its row and adds its routed ids to it on
every forward (`moe.count_routed`). Inside a graph the add is captured like any other kernel, so the counts
run on for as long as the mode is on: a record is a difference of two snapshots (worker/expert_distribution.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sglang_ext.models.moe import SparseMoeBlock

if TYPE_CHECKING:
    from sglang_ext.models.decoder import DecoderForCausalLM


@dataclass(frozen=True)
class ExpertCounts:
    """The model's routed-token counts. Row i is model layer `layers[i]`; every real token adds `top_k` to
    each row, so a row's sum / top_k is the tokens that went through the layer."""

    counts: torch.Tensor  # [len(layers), num_experts] int64, on the model's device
    layers: tuple[int, ...]
    num_experts: int
    top_k: int

    def snapshot(self) -> torch.Tensor:
        """A CPU copy of the counts now: waits for the forwards queued before it on the current stream."""
        return self.counts.to("cpu", copy=True)


def attach_expert_counts(model: DecoderForCausalLM) -> ExpertCounts | None:
    """Give every sparse block of `model` its row of a new zeroed buffer; None for a model without one."""
    blocks = [(i, layer.mlp) for i, layer in enumerate(model.layers) if isinstance(layer.mlp, SparseMoeBlock)]
    if not blocks:
        return None
    moe = blocks[0][1].moe
    device = blocks[0][1].gate.weight.device
    counts = torch.zeros(len(blocks), moe.num_experts, dtype=torch.int64, device=device)
    for row, (_, block) in enumerate(blocks):
        block.expert_counts = counts[row]
    return ExpertCounts(counts, tuple(i for i, _ in blocks), moe.num_experts, moe.top_k)
