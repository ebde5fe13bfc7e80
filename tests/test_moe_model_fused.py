"""The MoE kernels inside the model: the tiny Mixtral served greedily by the real scheduler with its
routing and expert FFNs on the Triton kernels (`ops/moe`: route, align, grouped GEMMs, slot sum) gives
the tokens the torch references give. Without CUDA the kernels run under Triton's interpreter
(`_triton_interp`'s fixes); skipped where Triton is not installed. Float32, so the two paths agree to
rounding and greedy tokens must be identical."""

from __future__ import annotations

import importlib.util
from typing import Any

import _tiny
import _triton_interp
import pytest
import torch
from _tiny import greedy, make_scheduler, prompts, run_all, tiny_moe_config

from sglang_ext import ops
from sglang_ext.scheduler.request import Req

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton (pip install triton; runs under its interpreter without a GPU)",
                allow_module_level=True)
_triton_interp.device()  # before the kernels are imported below
from sglang_ext.ops.moe import kernels, route  # noqa: E402


def _reqs() -> list[Req]:
    return [Req(f"r{i}", p, greedy(6)) for i, p in enumerate(prompts([7, 3, 12]))]


def test_the_model_on_the_moe_kernels_serves_the_reference_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_tiny, "tiny_config", tiny_moe_config)
    want = run_all(make_scheduler(), _reqs())
    calls = {"route": 0, "experts": 0}

    def kernel_route(logits: torch.Tensor, k: int, renorm: bool, row_mask: torch.Tensor | None = None) -> Any:
        calls["route"] += 1
        return route.route(logits, k, renorm, row_mask)

    def kernel_experts(*args: Any) -> torch.Tensor:
        calls["experts"] += 1
        return kernels.fused_moe(*args)

    monkeypatch.setattr(ops, "moe_route", kernel_route)  # the kernels, whatever the device
    monkeypatch.setattr(ops, "fused_moe", kernel_experts)
    assert run_all(make_scheduler(), _reqs()) == want
    assert calls["route"] == calls["experts"] > 0
