"""MoE on the GPU fast path (bf16): the Triton MoE kernels (routing, per-expert alignment, grouped GEMMs)
with FlashInfer, CUDA graphs and the overlap loop, against the same model run through the torch
references (`ops.use_fused` off: torch routing and the expert loop, torch attention, eager). Two
geometries: Mixtral-like (8 experts, top-2) and Qwen3-MoE-like (32 experts, top-8, renormalized, q/k
norm). Skipped where CUDA, Triton or FlashInfer is absent."""

from __future__ import annotations

import importlib.util
from typing import Any
from unittest import mock

import pytest
import torch
from _batch_util import PagedSeqs
from _tiny import EOS, prompts, tiny_config

from sglang_ext.engine.model_runner import ModelRunner
from sglang_ext.forward_batch import ForwardBatch, ForwardMode
from sglang_ext.sampling.params import SamplingParams
from sglang_ext.scheduler.request import Req
from sglang_ext.scheduler.scheduler import Scheduler
from sglang_ext.server_args import ServerArgs

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
for mod in ("flashinfer", "triton"):
    if importlib.util.find_spec(mod) is None:
        pytest.skip(f"needs {mod}", allow_module_level=True)

pytestmark = pytest.mark.gpu
VOCAB = 512
LENGTHS = [5, 17, 33, 9, 40, 3]
REL_TOL = 3e-2  # bf16 logits, ||a - b|| / ||a||: the expert sums are ordered differently
GEOMETRIES = {
    "mixtral": dict(architectures=["MixtralForCausalLM"], num_local_experts=8, num_experts_per_tok=2,
                    intermediate_size=512),
    "qwen3-moe": dict(architectures=["Qwen3MoeForCausalLM"], num_experts=32, num_experts_per_tok=8,
                      moe_intermediate_size=256, norm_topk_prob=True, head_dim=128),
}


def _runner(geom: str, fast: bool) -> ModelRunner:
    cfg = tiny_config(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, **GEOMETRIES[geom])
    args = ServerArgs(device="cuda", dtype="bfloat16", load_format="dummy", page_size=16,
                      attention_backend="flashinfer" if fast else "torch", disable_cuda_graph=not fast,
                      cuda_graph_max_bs=16, max_total_tokens=4096)
    r = ModelRunner(args, None, cfg)  # type: ignore[arg-type]
    with torch.no_grad():  # in place: captured graphs see the sharpened weights
        for p in r.model.parameters():
            if p.dim() >= 2:
                p.mul_(2.0)
    return r


def _forward(runner: ModelRunner, batch: ForwardBatch, fast: bool) -> torch.Tensor:
    for name in ("input_ids", "positions", "out_cache_loc", "kv_indices", "logits_indices"):
        setattr(batch, name, getattr(batch, name).to("cuda"))
    with mock.patch("sglang_ext.ops.use_fused", return_value=fast):  # off: every torch reference path
        return runner.forward(batch)


@pytest.mark.parametrize("geom", list(GEOMETRIES))
def test_moe_logits_match_the_torch_reference(geom: str) -> None:
    ref, fast = _runner(geom, False), _runner(geom, True)
    fast.model.load_state_dict(ref.model.state_dict())  # in place, under the captured graphs
    ps = prompts(LENGTHS, seed=3)
    seqs: dict[str, Any] = {}
    for name, r in (("ref", ref), ("fast", fast)):
        paged = PagedSeqs(r.pool, seed=1)
        seqs[name] = (paged, [paged.new_seq() for _ in ps])
    worst = 0.0

    def step(mode: ForwardMode, toks: list[list[int]]) -> torch.Tensor:
        nonlocal worst
        (pa, sa), (pb, sb) = seqs["ref"], seqs["fast"]
        a = _forward(ref, pa.batch(mode, sa, toks), False)
        b = _forward(fast, pb.batch(mode, sb, toks), True)
        err = float((a - b).norm() / a.norm())
        worst = max(worst, err)
        assert err < REL_TOL, f"{geom} {mode.name}: logits rel err {err:.2e}"
        return a.argmax(-1)

    nxt = step(ForwardMode.EXTEND, ps)
    for _ in range(10):  # decode: CUDA graphs padded from 6 rows to 8
        nxt = step(ForwardMode.DECODE, [[t] for t in nxt.tolist()])
    print(f"{geom}: worst logits rel err {worst:.2e}")


@pytest.mark.parametrize("geom", list(GEOMETRIES))
def test_moe_graphs_and_overlap_serve_like_the_eager_loop(geom: str) -> None:
    """The fused path eagerly in the plain loop vs captured in graphs under the overlap loop: same tokens."""
    graphs = _runner(geom, True)
    eager = _runner(geom, True)
    eager.model.load_state_dict(graphs.model.state_dict())
    eager.graphs = None
    params = [SamplingParams(max_new_tokens=16 + i, temperature=0.0, ignore_eos=True) for i in range(len(LENGTHS))]

    def serve(s: Scheduler) -> dict[str, list[int]]:
        reqs = [Req(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts(LENGTHS, seed=5), params, strict=True))]
        for r in reqs:
            s.add_request(r)
        out: dict[str, list[int]] = {r.rid: [] for r in reqs}
        for _ in range(1000):
            if not s.has_work():
                break
            for o in s.step():
                out[o.rid].extend(o.new_token_ids)
        assert not s.has_work()
        return out

    want = serve(Scheduler(eager.args, eager, 16, frozenset([EOS]), vocab_size=VOCAB))
    ov = Scheduler(graphs.args, graphs, 16, frozenset([EOS]), vocab_size=VOCAB, overlap=True)
    assert serve(ov) == want and ov.overlapped_steps > 0
