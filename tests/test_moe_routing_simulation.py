"""--moe-routing-simulation uniform: MoE benchmarks on dummy weights route each token to k distinct experts
drawn at random, as a trained router's load balancing would, instead of the dummy router's choice (which
can send every row of a decode batch to the same few experts and make decode look cheap). Checked here:
the argument's validation, that identical rows spread over the experts uniformly (the router's own choice
gives them all the same k), that a model served with it runs to the end, and that a dense model refuses it."""

from __future__ import annotations

import argparse
from typing import Any

import _tiny
import pytest
import torch
from _tiny import greedy, make_scheduler, prompts, run_all, tiny_config, tiny_moe_config

from sglang_ext.engine.model_runner import ModelRunner
from sglang_ext.models.moe import SparseMoeBlock
from sglang_ext.scheduler.request import Req
from sglang_ext.server_args import ServerArgs

EXPERTS, TOP_K = 16, 2


def test_it_needs_dummy_weights_and_a_known_mode() -> None:
    with pytest.raises(ValueError, match="needs --load-format dummy"):
        ServerArgs(moe_routing_simulation="uniform")
    with pytest.raises(ValueError, match="must be one of"):
        ServerArgs(load_format="dummy", moe_routing_simulation="zipf")  # type: ignore[arg-type]
    assert ServerArgs(load_format="dummy", moe_routing_simulation="uniform").moe_routing_simulation == "uniform"


def test_the_flag_is_on_the_command_line() -> None:
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    assert p.parse_args(["--moe-routing-simulation", "uniform"]).moe_routing_simulation == "uniform"
    with pytest.raises(SystemExit):
        p.parse_args(["--moe-routing-simulation", "zipf"])


def _block(uniform: bool) -> SparseMoeBlock:
    sa = ServerArgs(device="cpu", dtype="float32", load_format="dummy",
                    moe_routing_simulation="uniform" if uniform else "off")
    runner = ModelRunner(sa, None, tiny_moe_config(num_local_experts=EXPERTS, num_experts_per_tok=TOP_K))  # type: ignore[arg-type]
    return next(m for m in runner.model.modules() if isinstance(m, SparseMoeBlock))


def _routed(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    seen: list[torch.Tensor] = []
    hook = block.experts.register_forward_pre_hook(lambda _m, args: seen.append(args[2].clone()))
    try:
        with torch.no_grad():
            block(x)
    finally:
        hook.remove()
    return seen[0]


def test_identical_rows_spread_over_the_experts_uniformly() -> None:
    torch.manual_seed(0)
    row = torch.randn(1, 64)
    rows = row.expand(4096, 64).contiguous()
    own = _routed(_block(uniform=False), rows)
    assert torch.unique(own).numel() == TOP_K  # the router's choice: every identical row gets the same k
    ids = _routed(_block(uniform=True), rows)
    assert ids.shape == (4096, TOP_K)
    assert all(torch.unique(r).numel() == TOP_K for r in ids)  # k distinct experts per token
    counts = torch.bincount(ids.flatten().long(), minlength=EXPERTS).float()
    mean = 4096 * TOP_K / EXPERTS  # 512 picks per expert
    assert counts.min() > 0.85 * mean and counts.max() < 1.15 * mean  # ~7 sigma of binomial noise is 0.15 x


def test_a_model_served_with_it_finishes_every_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_tiny, "tiny_config", tiny_moe_config)
    s = make_scheduler(moe_routing_simulation="uniform")
    blocks = [m for m in s.runner.model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and all(b.uniform_routing for b in blocks)
    reqs = [Req(f"r{i}", p, greedy(6)) for i, p in enumerate(prompts([7, 3, 12]))]
    out = run_all(s, reqs)
    assert all(len(t) == 6 for t in out.values())


def test_a_dense_model_refuses_it() -> None:
    sa: Any = ServerArgs(device="cpu", dtype="float32", load_format="dummy", moe_routing_simulation="uniform")
    with pytest.raises(ValueError, match="has no MoE layers"):
        ModelRunner(sa, None, tiny_config())  # type: ignore[arg-type]


def test_a_dense_worker_says_so_at_start() -> None:
    from sglang_ext.worker.tokenizer import StartupError
    from sglang_ext.worker.worker import Worker

    with pytest.raises(StartupError, match="has no MoE layers"):
        Worker(ServerArgs(load_format="dummy", device="cpu", moe_routing_simulation="uniform"))
