"""Every MoE kernel variant a forward can use is built when the worker starts (`ModelRunner`'s "moe kernels"
stage), not by the first batch that needs it: a variant is a block-size config, and on an H100 the first
server of a fresh machine ran a few forwards 2-3x slow (2026-12-07, bench/results/2026-12-07-h100-s10) when
its first full prefill chunk plus the decoding rows (8,192 + rows tokens) took the defaults of a table
trusted to 8,192 tokens, a config no warm-up prompt had reached. Checked here: the configs enumerated are
every one `get_config` picks, at their fewest tokens; `compile_all` runs the kernels once at each (under
Triton's interpreter on CPU); the runner asks for the most tokens a forward can carry."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import _triton_interp
import pytest
import torch
from _tiny import tiny_moe_config

from sglang_ext import ops
from sglang_ext.engine.model_runner import ModelRunner
from sglang_ext.models.moe import SparseMoeBlock
from sglang_ext.ops.moe import configs
from sglang_ext.server_args import ServerArgs

QWEN3 = (8, 128, 768, 2048, torch.bfloat16, "NVIDIA_H200")  # top_k, E, I, H, dtype, the table's GPU


def test_the_configs_are_every_pick_at_its_fewest_tokens() -> None:
    top = 8192 + 256
    got = configs.distinct_configs(top, *QWEN3)
    picks = [configs.get_config(t, *QWEN3) for t in range(1, top + 1)]
    assert sorted(got) == sorted({next(t for t in range(1, top + 1) if picks[t - 1] == c) for c in picks})
    assert all(configs.get_config(t, *QWEN3) == cfg for t, cfg in got.items())
    # the shipped Qwen3-30B-A3B table is trusted to 8,192 tokens: a full chunk plus one decoding row takes the
    # defaults, the variant no power-of-two warm-up prompt (at most 8,192 tokens) builds
    assert 8193 in got and got[8193] == configs.default_config(8193, 8, 128)
    assert max(got) == 8193 and len(got) == len({json.dumps(c, sort_keys=True) for c in got.values()})


def test_no_table_gives_the_defaults_tiers(tmp_path: Path) -> None:
    got = configs.distinct_configs(40, 2, 4, 32, 32, torch.float32, "cpu", config_dir=tmp_path)
    # 2 slots over 4 experts: at most 16 pairs an expert up to 32 tokens, then the next tier
    assert sorted(got) == [1, 33]


def test_max_forward_tokens_is_a_chunk_plus_every_running_row() -> None:
    assert ServerArgs(device="cuda").max_forward_tokens == 8192 + 256
    assert ServerArgs(device="cpu").max_forward_tokens == 512 + 256
    assert ServerArgs(device="cpu", chunked_prefill_size=1024, max_running_requests=8).max_forward_tokens == 1032
    assert ServerArgs(device="cpu", chunked_prefill_size=-1, max_prefill_tokens=4096).max_forward_tokens == 4096 + 256


def test_the_runner_builds_for_the_largest_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stage runs on CUDA only; its body, called here, hands the first MoE layer's experts and the
    forward bound to `ops.warm_moe`."""
    sa = ServerArgs(device="cpu", dtype="float32", load_format="dummy", max_running_requests=16)
    runner = ModelRunner(sa, None, tiny_moe_config(num_local_experts=8, num_experts_per_tok=2))  # type: ignore[arg-type]
    block = next(m for m in runner.model.modules() if isinstance(m, SparseMoeBlock))
    seen: list[tuple[object, ...]] = []

    def warm(*a: object) -> list[int]:
        seen.append(a)
        return [1, 9]

    monkeypatch.setattr(ops, "warm_moe", warm)
    note = runner._warm_moe(block)
    assert seen == [(block.experts.gate_up_proj, block.experts.down_proj, 2, 512 + 16, 0)]
    assert note == "2 block-size configs for 1-528 tokens, built at [1, 9]"
    assert ops.warm_moe(block.experts.gate_up_proj, block.experts.down_proj, 2, 8) == [1, 9]  # the patched one
    monkeypatch.undo()
    assert ops.warm_moe(block.experts.gate_up_proj, block.experts.down_proj, 2, 8) == []  # CPU: the reference runs


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (its interpreter on CPU)")
def test_compile_all_runs_the_kernels_once_per_config(monkeypatch: pytest.MonkeyPatch) -> None:
    device = _triton_interp.device()
    from sglang_ext.ops.moe import kernels

    ran: list[int] = []
    real = kernels.fused_moe

    def spy(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w: torch.Tensor, ids: torch.Tensor,
            first: int = 0) -> torch.Tensor:
        ran.append(x.shape[0])
        assert ids.dtype == torch.int32 and w.shape == ids.shape == (x.shape[0], 2)
        assert all(len(set(row)) == 2 and all(first <= e < first + 4 for e in row) for row in ids.tolist())
        out = real(x, w13, w2, w, ids, first)
        assert torch.isfinite(out).all()
        return out

    monkeypatch.setattr(kernels, "fused_moe", spy)
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(4, 64, 32, generator=g) / 32**0.5).to(device)
    w2 = (torch.randn(4, 32, 32, generator=g) / 32**0.5).to(device)
    want = sorted(configs.distinct_configs(40, 2, 4, 32, 32, torch.float32, configs.device_name(w13.device)))
    assert kernels.compile_all(w13, w2, 2, 40, first_expert=4) == want == ran
