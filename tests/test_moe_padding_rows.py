"""A CUDA graph's padding rows reach no routed expert.

A decode batch of 12 rows replays the graph captured for 16; the 4 padding rows used to be routed like
tokens, so their top-k pulled in experts no real row needed (Qwen3-30B-A3B's step at 12 rows measured
within 2-5 % of 16 rows', and the simulator, which prices 12 rows' experts, read 9-10 % under:
bench/results/2026-12-07-h100-s12/). The graphs now pass `ForwardBatch.row_mask` (False on padding rows)
to the MoE blocks, whose router gives those rows expert -1 and weight 0. Checked on the CPU path here
(the kernels' side runs under Triton's interpreter in test_moe_kernels.py; the graphs themselves only
on a GPU, in test_gpu_moe.py, where greedy output with graphs must equal the eager loop's): the masked
rows get no expert, the real rows' outputs do not change, and a whole decode forward keeps its real rows'
logits.
"""

from __future__ import annotations

import pytest
import torch
from _batch_util import PagedSeqs, make_pool_and_backend, run_logits
from _tiny import tiny_moe_config

from sglang_ext.engine.cuda_graph import CudaGraphRunner
from sglang_ext.forward_batch import ForwardMode
from sglang_ext.models.config import ModelConfig
from sglang_ext.models.decoder import DecoderForCausalLM
from sglang_ext.models.moe import SparseMoeBlock

MASK = torch.tensor([True, False, True, True, False, True])


def _model(cfg: ModelConfig) -> DecoderForCausalLM:
    torch.manual_seed(0)
    model = DecoderForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def _qwen2_moe() -> ModelConfig:
    """With a shared expert (Qwen2-MoE): a padding row still runs it, as every row runs a dense MLP."""
    return tiny_moe_config(architectures=["Qwen2MoeForCausalLM"], num_experts=8, num_experts_per_tok=2,
                           moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=False)


def _routed_ids(block: SparseMoeBlock, x: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    seen: list[torch.Tensor] = []
    hook = block.experts.register_forward_pre_hook(lambda _m, args: seen.append(args[2].clone()))
    try:
        with torch.no_grad():
            out = block(x, mask)
    finally:
        hook.remove()
    return out, seen[0]


@pytest.mark.parametrize("cfg", [tiny_moe_config(num_local_experts=8, num_experts_per_tok=2), _qwen2_moe()],
                         ids=["mixtral", "qwen2-moe-shared"])
@pytest.mark.parametrize("uniform", [False, True], ids=["router", "uniform"])
def test_masked_rows_get_no_expert_and_real_rows_keep_theirs(cfg: ModelConfig, uniform: bool) -> None:
    block = next(m for m in _model(cfg).modules() if isinstance(m, SparseMoeBlock))
    block.uniform_routing = uniform
    x = torch.randn(len(MASK), cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    out, ids = _routed_ids(block, x, MASK)
    assert (ids[~MASK] == -1).all() and (ids[MASK] >= 0).all()
    shared = torch.zeros_like(x)
    if block.shared_expert is not None and block.shared_expert_gate is not None:
        with torch.no_grad():
            shared = torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
        assert shared.abs().sum() > 0
    torch.testing.assert_close(out[~MASK], shared[~MASK])  # nothing routed: the shared expert's part alone
    if not uniform:  # the router's own choice is deterministic: the real rows as without the padding rows
        alone, alone_ids = _routed_ids(block, x[MASK], None)
        assert torch.equal(ids[MASK], alone_ids)
        torch.testing.assert_close(out[MASK], alone)
        full, _ = _routed_ids(block, x, None)
        torch.testing.assert_close(out[MASK], full[MASK])


def test_a_decode_forward_keeps_its_real_rows() -> None:
    """A whole decode batch with some rows marked padding: the real rows' logits are those of the same
    forward without the mask (attention is per row; only the experts' choice changed)."""
    cfg = tiny_moe_config(num_local_experts=8, num_experts_per_tok=2)
    model = _model(cfg)
    logits = []
    for mask in (None, MASK):
        pool, backend = make_pool_and_backend(cfg)
        seqs = PagedSeqs(pool)
        batch_seqs = [seqs.new_seq() for _ in MASK]
        prompts = [[5 + i, 9, 17 + 3 * i] for i in range(len(MASK))]
        run_logits(model, backend, seqs.batch(ForwardMode.EXTEND, batch_seqs, prompts))
        batch = seqs.batch(ForwardMode.DECODE, batch_seqs, [[40 + i] for i in range(len(MASK))])
        batch.row_mask = mask
        logits.append(run_logits(model, backend, batch))
    torch.testing.assert_close(logits[1][MASK], logits[0][MASK])
    assert not torch.allclose(logits[1][~MASK], logits[0][~MASK])  # the padding rows did change


def test_the_graph_runner_marks_real_rows() -> None:
    """`mark_real` on a runner's buffers (no GPU needed for the buffers): the plain graphs' one span and the
    split graphs' two (local rows, then remote rows, each followed by its padding)."""
    r = object.__new__(CudaGraphRunner)
    r.rows = torch.arange(16)
    r.row_mask = torch.ones(16, dtype=torch.bool)
    r.mark_real(((0, 3),), 8)
    assert r.row_mask[:8].tolist() == [True] * 3 + [False] * 5
    r.mark_real(((0, 8),), 8)
    assert r.row_mask[:8].all()
    r.mark_real(((0, 3), (4, 6)), 8)
    assert r.row_mask[:8].tolist() == [True, True, True, False, True, True, False, False]
    r.row_mask = None  # a dense model's runner: nothing to mark
    r.mark_real(((0, 3),), 8)
