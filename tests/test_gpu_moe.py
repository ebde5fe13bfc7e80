"""MoE on the GPU fast path (bf16): the Triton MoE kernels (routing, per-expert alignment, grouped GEMMs)
with FlashInfer, CUDA graphs and the overlap loop, against the same model run through the torch
references (`ops.use_fused` off: torch routing and the expert loop, torch attention, eager). Two
geometries: Mixtral-like (8 experts, top-2) and Qwen3-MoE-like (32 experts, top-8, renormalized, q/k
norm). Skipped where CUDA, Triton or FlashInfer is absent."""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from _batch_util import PagedSeqs
from _moe_ckpt import write_mixtral
from _tiny import EOS, prompts, tiny_config

from sglang_ext import Engine
from sglang_ext.engine.model_runner import ModelRunner
from sglang_ext.forward_batch import ForwardBatch, ForwardMode
from sglang_ext.models.default_model import ensure_default_model
from sglang_ext.ops.moe import fused_moe_ref
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
GEOMETRIES = {
    "mixtral": dict(architectures=["MixtralForCausalLM"], num_local_experts=8, num_experts_per_tok=2,
                    intermediate_size=512),
    "qwen3-moe": dict(architectures=["Qwen3MoeForCausalLM"], num_experts=32, num_experts_per_tok=8,
                      moe_intermediate_size=256, norm_topk_prob=True, head_dim=128),
}


def _runner(geom: str, fast: bool, graphs: bool | None = None, experts: str | None = None) -> ModelRunner:
    cfg = tiny_config(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, **GEOMETRIES[geom])
    args = ServerArgs(device="cuda", dtype="bfloat16", load_format="dummy", page_size=16,
                      attention_backend="flashinfer" if fast else "torch",
                      disable_cuda_graph=not (fast if graphs is None else graphs),
                      cuda_graph_max_bs=16, max_total_tokens=4096, expert_distribution_recorder_mode=experts)
    r = ModelRunner(args, None, cfg)  # type: ignore[arg-type]
    with torch.no_grad():  # in place: captured graphs see the sharpened weights
        for p in r.model.parameters():
            if p.dim() >= 2:
                p.mul_(2.0)
    return r


def _forward(runner: ModelRunner, batch: ForwardBatch, fused: bool, moe_fused: bool = True) -> torch.Tensor:
    for name in ("input_ids", "positions", "out_cache_loc", "kv_indices", "logits_indices"):
        setattr(batch, name, getattr(batch, name).to("cuda"))
    with contextlib.ExitStack() as st:
        st.enter_context(mock.patch("sglang_ext.ops.use_fused", return_value=fused))  # off: every torch path
        if not moe_fused:  # the fast path with only the expert GEMMs on their torch reference
            st.enter_context(mock.patch("sglang_ext.ops.fused_moe", fused_moe_ref))
        return runner.forward(batch)


@pytest.mark.parametrize("geom", list(GEOMETRIES))
def test_moe_logits_match_the_torch_reference(geom: str) -> None:
    """Teacher-forced prefill + 10 decode steps, 66 logit rows. The bar is measured, not guessed: bf16
    logits of this sharpened tiny model drift from the torch reference whatever the MoE does (FlashInfer
    and the fused norms sum in another order), so the fast path with the expert GEMMs on their torch
    reference (`mid`) sets the noise. Rows, not whole steps, are compared, at their 75th percentile:
    bf16 router logits tie or nearly tie at the k-th place in about 1 % of routing decisions (4 of 334
    exact ties for the Mixtral geometry: bench/moe_numerics.py), so any drift swaps an expert somewhere
    and one swapped expert moves that token's logits by half (on the H200 a single such row put `mid`
    0.21 off the reference over a whole step, 2026-12-03). A swap touches a row or two; a wrong expert,
    weight or layout in the Triton MoE touches nearly every row and lands far above twice the noise.
    `mid` keeps the Triton router (the kernel takes the lowest index on ties, torch.topk's order is
    unspecified); the router is held to the reference on its own in tests/test_moe_kernels.py."""
    ref, fast = _runner(geom, False), _runner(geom, True)
    mid = _runner(geom, True, graphs=False)  # the torch MoE reference syncs the host: no graph capture
    fast.model.load_state_dict(ref.model.state_dict())  # in place, under the captured graphs
    mid.model.load_state_dict(ref.model.state_dict())
    ps = prompts(LENGTHS, seed=3)
    seqs: dict[str, Any] = {}
    for name, r in (("ref", ref), ("fast", fast), ("mid", mid)):
        paged = PagedSeqs(r.pool, seed=1)
        seqs[name] = (paged, [paged.new_seq() for _ in ps])
    fused_rows: list[torch.Tensor] = []
    noise_rows: list[torch.Tensor] = []

    def step(mode: ForwardMode, toks: list[list[int]]) -> torch.Tensor:
        def run(name: str, r: ModelRunner, fused: bool, moe_fused: bool = True) -> torch.Tensor:
            paged, ss = seqs[name]
            return _forward(r, paged.batch(mode, ss, toks), fused, moe_fused).float()

        a, b, c = run("ref", ref, False), run("fast", fast, True), run("mid", mid, True, moe_fused=False)
        scale = a.norm(dim=-1)
        fused_rows.append((a - b).norm(dim=-1) / scale)
        noise_rows.append((a - c).norm(dim=-1) / scale)
        return a.argmax(-1)

    nxt = step(ForwardMode.EXTEND, ps)
    for _ in range(10):  # decode: CUDA graphs padded from 6 rows to 8
        nxt = step(ForwardMode.DECODE, [[t] for t in nxt.tolist()])
    fused_all, noise_all = torch.cat(fused_rows), torch.cat(noise_rows)
    fused_err, noise = float(fused_all.quantile(0.75)), float(noise_all.quantile(0.75))
    q = torch.tensor([0.5, 0.75, 0.9, 1.0], device=fused_all.device)
    print(f"{geom}: logits rel err per row over {fused_all.numel()} rows at quantiles 50/75/90/100 %: "
          f"Triton MoE {[f'{v:.1e}' for v in fused_all.quantile(q).tolist()]}, "
          f"torch MoE on the fast path {[f'{v:.1e}' for v in noise_all.quantile(q).tolist()]}")
    assert noise < 0.05, f"{geom}: the fast path without the Triton MoE is already off by {noise:.2e} (p75 row)"
    assert fused_err <= 2 * noise + 2e-3, f"{geom}: Triton MoE {fused_err:.2e} vs noise {noise:.2e} (p75 row)"


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


def test_moe_graphs_mark_their_padding_rows() -> None:
    """A decode batch of 3 rows replays the graph of 4: the MoE blocks read `row_mask` False on the padding
    row (routed to no expert), from the one static buffer every captured graph shares. (That the real rows
    keep their tokens is the serving test above: graphs under the overlap loop against the eager loop.)"""
    runner = _runner("qwen3-moe", True)
    g = runner.graphs
    assert g is not None and g.row_mask is not None
    assert all(b.row_mask is not None and b.row_mask.data_ptr() == g.row_mask.data_ptr() for b in g.batches.values())
    paged = PagedSeqs(runner.pool, seed=2)
    ss = [paged.new_seq() for _ in range(3)]
    _forward(runner, paged.batch(ForwardMode.EXTEND, ss, prompts([6, 11, 4], seed=7)), True)
    logits = _forward(runner, paged.batch(ForwardMode.DECODE, ss, [[7], [8], [9]]), True)
    assert logits.shape[0] == 3 and torch.isfinite(logits).all()
    assert g.row_mask[:4].tolist() == [True, True, True, False]


def test_expert_counts_run_inside_the_decode_graphs() -> None:
    """--expert-distribution-recorder-mode stat: the counting adds are captured in the decode graphs. Decode
    batches of 3 rows replay the graph of 4: every replay adds 3 * top_k to each layer's row (the padding row
    adds nothing), and the greedy tokens are those of the runner without the mode (the same weights, the
    same graphs but for the adds). The add itself never syncs the host."""
    from sglang_ext.models.moe import count_routed

    on, off = _runner("qwen3-moe", True, experts="stat"), _runner("qwen3-moe", True)
    off.model.load_state_dict(on.model.state_dict())  # in place, under the captured graphs
    c, g = on.expert_counts, on.graphs
    assert c is not None and g is not None and off.expert_counts is None
    k = c.top_k
    base = c.snapshot()  # the graphs' warm-up forwards counted too: a record is a difference
    prefill = torch.zeros_like(base)
    tokens: dict[str, list[list[int]]] = {}
    for name, r in (("on", on), ("off", off)):
        paged = PagedSeqs(r.pool, seed=2)
        ss = [paged.new_seq() for _ in range(3)]
        out = [_forward(r, paged.batch(ForwardMode.EXTEND, ss, prompts([6, 11, 4], seed=7)), True).argmax(-1).tolist()]
        if name == "on":
            prefill = c.snapshot() - base
            assert prefill.sum(dim=1).tolist() == [21 * k] * len(c.layers)
        for _ in range(5):
            batch = paged.batch(ForwardMode.DECODE, ss, [[t] for t in out[-1]])
            assert r.graphs is not None and r.graphs.can_run(batch)
            out.append(_forward(r, batch, True).argmax(-1).tolist())
        tokens[name] = out
    decode = c.snapshot() - base - prefill
    assert decode.sum(dim=1).tolist() == [5 * 3 * k] * len(c.layers)
    assert g.row_mask is not None and g.row_mask[:4].tolist() == [True, True, True, False]
    assert tokens["on"] == tokens["off"]
    ids = torch.tensor([[3, 1], [-1, -1], [3, 0]], dtype=torch.int32, device="cuda")
    counts = torch.zeros(4, dtype=torch.int64, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        count_routed(counts, ids)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert counts.tolist() == [1, 1, 0, 2]


def test_moe_checkpoint_served_on_one_gpu_with_remote_attention(tmp_path: Path) -> None:
    """A Mixtral HF checkpoint served by the Engine on one GPU (the Triton MoE kernels in float32),
    half of its decoding requests' attention and KV moved to an in-process executor on the same GPU
    (`--offload-executor local`): greedy outputs equal the plain engine's. float32 and the torch
    attention backend, as the CPU tests: exactness is the claim here, speed is bench/offline.py's.
    PD needs a second process and device pair: tests/test_moe_served.py covers it on CPU workers."""
    write_mixtral(tmp_path / "mixtral")
    common = dict(model_path=str(tmp_path / "mixtral"), tokenizer_path=str(ensure_default_model()), device="cuda",
                  dtype="float32", attention_backend="torch", disable_cuda_graph=True, max_total_tokens=8192)
    prompts_ = ["The weather today is", "Once upon a time,", "A list of fruits: apples, pears, plums", "Hi",
                "Numbers: 1, 2, 3,", "Dear team,"]
    greedy = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    with Engine(**common) as plain:
        want = [o["output_ids"] for o in plain.generate(prompt=prompts_, sampling_params=greedy)]
    with Engine(**common, offload_executor="local", offload_ratio=0.5, executor_mem_gb=0.05) as remote:
        got = remote.generate(prompt=prompts_, sampling_params=greedy)
    assert len({tuple(w) for w in want}) > 1  # a real model: prompts give different continuations
    assert [o["output_ids"] for o in got] == want
    assert any(o["meta_info"].get("attention_executor") for o in got)  # the share really moved


@pytest.mark.parametrize("geom", list(GEOMETRIES))
def test_the_runner_builds_every_moe_variant_before_serving(geom: str) -> None:
    """After start-up no forward size up to the bound compiles another variant of the MoE GEMMs (Triton's
    per-device kernel caches stay the same size): the mid-run compile the "moe kernels" stage prevents."""
    from sglang_ext import ops
    from sglang_ext.models.moe import SparseMoeBlock
    from sglang_ext.ops.moe import kernels

    cfg = tiny_config(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, **GEOMETRIES[geom])
    args = ServerArgs(device="cuda", dtype="bfloat16", load_format="dummy", page_size=16, cuda_graph_max_bs=16,
                      max_total_tokens=4096, chunked_prefill_size=2048, max_running_requests=16)
    r = ModelRunner(args, None, cfg)  # type: ignore[arg-type]
    fns = (kernels._gate_up_kernel, kernels._down_kernel)
    if not all(hasattr(f, "device_caches") for f in fns):
        pytest.skip("this Triton keeps no per-device kernel caches to count")

    def built() -> int:
        return sum(len(c[0]) for f in fns for c in f.device_caches.values())

    before = built()
    assert before > 0
    e = next(m for m in r.model.modules() if isinstance(m, SparseMoeBlock)).experts
    k = int(str(GEOMETRIES[geom]["num_experts_per_tok"]))
    g = torch.Generator(device="cuda").manual_seed(1)
    for t in (1, 3, 17, 100, 513, 1500, 2049, args.max_forward_tokens):
        ids = torch.rand(t, e.num_local, generator=g, device="cuda").topk(k, dim=1).indices.to(torch.int32)
        ops.fused_moe(torch.randn(t, 1024, device="cuda", dtype=torch.bfloat16), e.gate_up_proj, e.down_proj,
                      torch.full((t, k), 1.0 / k, device="cuda"), ids)
    assert built() == before
