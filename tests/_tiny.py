"""A tiny random model + in-process scheduler for engine tests (no sockets, no files)."""

from __future__ import annotations

from typing import Any

import torch

from sglang_ext.engine.model_runner import ModelRunner
from sglang_ext.models.config import ModelConfig
from sglang_ext.offload.setup import local_sender
from sglang_ext.sampling.params import SamplingParams
from sglang_ext.scheduler.request import Req
from sglang_ext.scheduler.scheduler import Scheduler
from sglang_ext.server_args import ServerArgs

VOCAB = 512
EOS = 2


def tiny_config(**over: Any) -> ModelConfig:
    return _config(over)


def _config(over: dict[str, Any]) -> ModelConfig:
    cfg: dict[str, Any] = dict(
        architectures=["LlamaForCausalLM"], vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        eos_token_id=EOS,
    )
    cfg.update(over)
    return ModelConfig.from_dict(cfg)


def tiny_moe_config(**over: Any) -> ModelConfig:
    """The tiny model as a Mixtral: 4 experts, top-2, in both layers (same attention geometry)."""
    return _config({"architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2,
                    **over})


def make_scheduler(device: str = "cpu", page_size: int = 4, dtype: str = "float32", **args: Any) -> Scheduler:
    if device.startswith("cuda") and "mem_fraction_static" not in args:
        args.setdefault("max_total_tokens", 65536)  # several runners share one GPU in a test process
    sa = ServerArgs(device=device, dtype=dtype, load_format="dummy", page_size=page_size, **args)
    runner = ModelRunner(sa, None, tiny_config())  # type: ignore[arg-type]
    with torch.no_grad():  # sharper logits than the default 0.02 init: no near-ties in argmax
        for p in runner.model.parameters():
            if p.dim() >= 2:  # stacked experts are 3-D
                p.mul_(6.0)
    # --offload-ratio / --offload-executor: an in-process executor, as a worker would build it
    sender = local_sender(sa, runner, "tiny")
    return Scheduler(sa, runner, page_size, frozenset([EOS]), vocab_size=VOCAB, remote_sender=sender)


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def greedy(max_new: int = 10, **kw: Any) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True, **kw)


def run_all(s: Scheduler, reqs: list[Req], check: bool = True, max_steps: int = 10_000) -> dict[str, list[int]]:
    """Drive the scheduler until idle; verify page ownership after every step."""
    for r in reqs:
        s.add_request(r)
    out: dict[str, list[int]] = {r.rid: [] for r in reqs}
    for _ in range(max_steps):
        if not s.has_work():
            break
        for o in s.step():
            out[o.rid].extend(o.new_token_ids)
        if check:
            s.check()
            if s.remote_sender is not None:
                s.remote_sender.remote.executor.check()  # type: ignore[attr-defined]
    assert not s.has_work(), "scheduler did not finish"
    return out
