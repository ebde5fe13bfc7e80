"""The MoE kernels (`sglang_ext/ops/moe/`: routing, block alignment, the two grouped GEMMs and the slot
sum) against the torch references, and the alignment's invariants. Without CUDA the kernels run under
Triton's interpreter (TRITON_INTERPRET=1, numpy on the CPU, with `_triton_interp`'s fixes), called
directly since `sglang_ext.ops` sends CPU tensors to the references; skipped where Triton is not
installed. Shapes stay small: the interpreter runs each program in Python."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import _triton_interp
import pytest
import torch

from sglang_ext import ops
from sglang_ext.ops.moe import configs, fused_moe_ref, moe_route_ref

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton (pip install triton; runs under its interpreter without a GPU)",
                allow_module_level=True)
DEVICE = _triton_interp.device()  # before the kernels are imported below
from sglang_ext.ops.moe import align, kernels, route  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# small tiles so that the shapes below cover several blocks, column tiles and K steps, and their tails
SMALL = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2, "num_warps": 4, "num_stages": 2}


def _weights(e: int, h: int, i: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    return w13.to(DEVICE, dtype), w2.to(DEVICE, dtype)


def _x(t: int, h: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(t, h, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    tol = 1e-5 if ref.dtype == torch.float32 else 2e-2  # bf16: a unit in the last place or two of ~1
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


# ---- routing ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("e,k", [(4, 1), (8, 2), (60, 4)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_matches_softmax_topk(e: int, k: int, renormalize: bool, dtype: torch.dtype) -> None:
    logits = (torch.randn(17, e, generator=torch.Generator().manual_seed(e + k)) * 2).to(DEVICE, dtype)
    w, ids = route.route(logits, k, renormalize)
    w_ref, ids_ref = moe_route_ref(logits, k, renormalize)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and w.shape == ids.shape == (17, k)
    if dtype == torch.float32:
        assert torch.equal(ids.cpu(), ids_ref.cpu())
    else:  # bf16 logits tie often; the kernel takes the lower index, torch.topk either: same values
        probs = torch.softmax(logits.float(), dim=-1)
        torch.testing.assert_close(probs.gather(1, ids.long()), probs.gather(1, ids_ref.long()))
        assert all(len(set(row)) == k for row in ids.tolist())
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-5)
    if renormalize:
        torch.testing.assert_close(w.sum(-1), torch.ones(17, device=DEVICE))
    else:  # plain softmax probabilities, largest first
        assert (w.sum(-1) < 1 + 1e-6).all() and (w[:, :-1] >= w[:, 1:]).all()


def test_route_of_no_tokens() -> None:
    w, ids = route.route(torch.empty(0, 8, device=DEVICE), 2, True)
    assert w.shape == ids.shape == (0, 2)


# ---- alignment ----------------------------------------------------------------------------------------
def _check_aligned(ids: torch.Tensor, block_m: int, num_local: int, first: int) -> None:
    al = align.align_block_size(ids, block_m, num_local, first)
    flat = ids.reshape(-1).long().cpu()
    n = flat.numel()
    assert al.sorted_ids.numel() == align.max_padded(n, num_local, block_m)
    assert al.expert_ids.numel() == -(-al.sorted_ids.numel() // block_m)
    used = int(al.num_padded.item())
    local = flat - first
    counts = torch.bincount(local[(local >= 0) & (local < num_local)], minlength=num_local)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert used % block_m == 0 and used <= al.sorted_ids.numel()
    sorted_ids = al.sorted_ids[:used].long().cpu()
    real = sorted_ids[sorted_ids < n]
    assert ((sorted_ids < n) | (sorted_ids == n)).all()  # padding is marked with n
    want = torch.nonzero((local >= 0) & (local < num_local)).flatten()
    assert torch.equal(real.sort().values, want)  # every local (token, slot) pair once, no other
    blocks = al.expert_ids[: used // block_m].long().cpu()
    assert (blocks[1:] >= blocks[:-1]).all()  # runs in expert order
    for b, e in enumerate(blocks.tolist()):
        rows = sorted_ids[b * block_m:(b + 1) * block_m]
        rows = rows[rows < n]
        assert rows.numel() and (local[rows] == e).all()  # one expert per block, none empty
        assert (rows[1:] > rows[:-1]).all()  # token order within an expert
    assert set(blocks.tolist()) == set(torch.nonzero(counts).flatten().tolist())  # unhit experts: no block


@pytest.mark.parametrize("t,k,e,block_m", [(1, 1, 4, 16), (3, 2, 8, 16), (17, 2, 8, 4), (40, 8, 16, 16)])
def test_align_invariants(t: int, k: int, e: int, block_m: int) -> None:
    g = torch.Generator().manual_seed(t * k)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(DEVICE, torch.int32)
    _check_aligned(ids, block_m, e, 0)


def test_align_skips_experts_of_other_ranks_and_unhit_experts() -> None:
    """Global ids 0..11, this rank holds 4..7; expert 5 is hit by no token; int64 ids as torch.topk gives."""
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(12, generator=g)[:3] for _ in range(9)])
    ids[ids == 5] = 11
    _check_aligned(ids.to(DEVICE), 16, 4, 4)
    _check_aligned(torch.full((5, 2), 20, device=DEVICE), 16, 4, 4)  # nothing local: zero blocks


# ---- the expert sum -----------------------------------------------------------------------------------
@pytest.mark.parametrize("t,e,k,h,i", [(1, 4, 1, 32, 64), (3, 4, 2, 64, 32), (17, 8, 2, 32, 64),
                                       (17, 8, 1, 40, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_matches_reference(t: int, e: int, k: int, h: int, i: int, dtype: torch.dtype) -> None:
    x = _x(t, h, dtype, seed=t)
    w13, w2 = _weights(e, h, i, dtype, seed=e + h)
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    w, ids = route.route(logits, k, renormalize=k > 1)
    _close(kernels.fused_moe(x, w13, w2, w, ids, config=SMALL), fused_moe_ref(x, w13, w2, w, ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_counts_only_local_experts(dtype: torch.dtype) -> None:
    """8 global experts, this rank holds 2..5 (expert 3 unhit): other ids add nothing; a token with
    no local expert gets zeros."""
    t, k, h, i = 6, 2, 32, 32
    x = _x(t, h, dtype, seed=1)
    w13, w2 = _weights(4, h, i, dtype, seed=2)
    ids = torch.tensor([[2, 7], [4, 0], [5, 2], [1, 6], [4, 5], [0, 2]], dtype=torch.int32, device=DEVICE)
    w = torch.rand(t, k, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    out = kernels.fused_moe(x, w13, w2, w, ids, first_expert=2, config=SMALL)
    ref = fused_moe_ref(x, w13, w2, w, ids, first_expert=2)
    _close(out, ref)
    assert (out[3] == 0).all()
    assert torch.equal(kernels.fused_moe(x, w13, w2, w, ids.long(), first_expert=2, config=SMALL), out)  # int64 ids
    # the same as a full 8-expert layer whose other experts' weights are zero
    full13 = torch.zeros(8, 2 * i, h, dtype=dtype, device=DEVICE)
    full2 = torch.zeros(8, h, i, dtype=dtype, device=DEVICE)
    full13[2:6], full2[2:6] = w13, w2
    _close(out, fused_moe_ref(x, full13, full2, w, ids))


# ---- a CUDA graph's padding rows ----------------------------------------------------------------------
PAD_MASK = [True, False, True, True, False, False, True]  # rows 1, 4, 5: padding


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_sends_masked_rows_to_no_expert(renormalize: bool) -> None:
    """The kernel's masked rows: expert -1 and weight 0; the real rows as without a mask (and as the
    reference's); the mask read from any position of the tile (17 rows span two programs)."""
    t, e, k = 17, 8, 2
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    mask = torch.tensor((PAD_MASK * 3)[:t], device=DEVICE)
    w, ids = route.route(logits, k, renormalize, row_mask=mask)
    w_all, ids_all = route.route(logits, k, renormalize)
    w_ref, ids_ref = moe_route_ref(logits, k, renormalize, row_mask=mask)
    assert torch.equal(ids, ids_ref) and (ids[~mask] == -1).all() and (w[~mask] == 0).all()
    assert torch.equal(ids[mask], ids_all[mask]) and torch.equal(w[mask], w_all[mask])
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_rows_read_no_expert_and_leave_real_rows_unchanged(dtype: torch.dtype) -> None:
    """Padding rows routed to no expert: their output is zero, the real rows' is bit for bit the one they
    get without the padding rows' pairs, and the alignment holds only the real rows' pairs."""
    t, e, k, h, i = len(PAD_MASK), 8, 2, 32, 32
    x = _x(t, h, dtype, seed=12)
    w13, w2 = _weights(e, h, i, dtype, seed=13)
    mask = torch.tensor(PAD_MASK, device=DEVICE)
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(14)).to(DEVICE)
    w, ids = route.route(logits, k, True, row_mask=mask)
    out = kernels.fused_moe(x, w13, w2, w, ids, config=SMALL)
    assert (out[~mask] == 0).all()
    real = kernels.fused_moe(x[mask], w13, w2, w[mask], ids[mask], config=SMALL)
    assert torch.equal(out[mask], real)
    _close(out, fused_moe_ref(x, w13, w2, w, ids))
    padded = align.align_block_size(ids, 16, e).num_padded
    assert torch.equal(padded, align.align_block_size(ids[mask], 16, e).num_padded)
    _check_aligned(ids, 16, e, 0)


def test_fused_moe_with_the_default_configs_and_strided_weights() -> None:
    """No config given: the defaults' larger tiles (masked down to these sizes); w13 as a transposed view."""
    t, e, k, h, i = 3, 4, 2, 32, 32
    x = _x(t, h, torch.float32, seed=4)
    w13, w2 = _weights(e, h, i, torch.float32, seed=5)
    w13_t = w13.transpose(1, 2).contiguous().transpose(1, 2)  # same values, stride 1 along 2I
    w, ids = moe_route_ref(torch.randn(t, e).to(DEVICE), k, True)
    _close(kernels.fused_moe(x, w13_t, w2, w, ids), fused_moe_ref(x, w13, w2, w, ids))
    assert kernels.fused_moe(x[:0], w13, w2, w[:0], ids[:0]).shape == (0, h)


def test_cpu_tensors_take_the_reference_path() -> None:
    x = torch.randn(3, 32)
    w13, w2 = torch.randn(4, 64, 32), torch.randn(4, 32, 32)
    logits = torch.randn(3, 4)
    assert not ops.use_fused(x)
    w, ids = ops.moe_route(logits, 2, False)
    w_ref, ids_ref = ops.moe_route_ref(logits, 2, False)
    assert torch.equal(w, w_ref) and torch.equal(ids, ids_ref)
    assert torch.equal(ops.fused_moe(x, w13, w2, w, ids, 1), ops.fused_moe_ref(x, w13, w2, w, ids, 1))


def test_reference_is_the_per_token_expert_mlp() -> None:
    """fused_moe_ref against the definition, one token and slot at a time."""
    x, (w13, w2) = torch.randn(4, 16), _weights(3, 16, 8, torch.float32, seed=6)
    w13, w2 = w13.cpu(), w2.cpu()
    w, ids = moe_route_ref(torch.randn(4, 3), 2, True)
    want = torch.zeros(4, 16)
    for t in range(4):
        for j in range(2):
            gate, up = (w13[ids[t, j]] @ x[t]).chunk(2)
            want[t] += w[t, j] * (w2[ids[t, j]] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(fused_moe_ref(x, w13, w2, w, ids), want, atol=1e-5, rtol=1e-5)


# ---- configs ------------------------------------------------------------------------------------------
def test_config_file_nearest_batch_and_defaults(tmp_path: Path) -> None:
    name = configs.config_file_name(8, 14336, 4096, torch.bfloat16, "NVIDIA_H200")
    assert name == "E=8,N=14336,H=4096,dtype=bfloat16,device=NVIDIA_H200.json"
    small = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 3,
             "down": {"BLOCK_N": 128}}
    big = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 16, "num_warps": 8, "num_stages": 3}
    (tmp_path / name).write_text(json.dumps({"_comment": "x", "1": small, "256": big}))
    args = (2, 8, 14336, 4096, torch.bfloat16, "NVIDIA_H200")
    assert configs.get_config(3, *args, config_dir=tmp_path) == small
    assert configs.get_config(200, *args, config_dir=tmp_path) == big
    assert configs.get_config(512, *args, config_dir=tmp_path) == big
    # past twice the largest tuned T the table is not trusted: the defaults (large prefill tiles)
    assert configs.get_config(4096, *args, config_dir=tmp_path) == configs.default_config(4096, 2, 8)
    up, down = configs.split(small)
    assert up["BLOCK_N"] == 64 and down["BLOCK_N"] == 128 and down["BLOCK_K"] == 128 and down["BLOCK_M"] == 16
    # no file for this device: the defaults, small tiles for decode and large ones for prefill
    assert configs.get_config(1, 2, 8, 14336, 4096, torch.bfloat16, "other", config_dir=tmp_path)["BLOCK_M"] == 16
    assert configs.get_config(4096, 2, 8, 14336, 4096, torch.bfloat16, "other", config_dir=tmp_path)["BLOCK_M"] == 128
    for tokens in (1, 8, 64, 256, 1024, 4096):
        for cfg in configs.split(configs.default_config(tokens, 8, 128)):
            assert set(cfg) == set(configs.KEYS)


def test_a_gpu_without_a_table_uses_one_tuned_on_the_same_chip(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """An H100 (SXM) has no table of its own: it takes the H200's (Hopper, 132 SMs), and says so; an own
    table wins; a GPU of another chip keeps the defaults."""
    tuned = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "GROUP_M": 16, "num_warps": 4, "num_stages": 5}
    h200 = configs.config_file_name(8, 14336, 4096, torch.bfloat16, "NVIDIA_H200")
    (tmp_path / h200).write_text(json.dumps({"1": tuned}))
    args = (1, 2, 8, 14336, 4096, torch.bfloat16)
    with caplog.at_level("INFO", logger="sglang_ext.ops.moe.configs"):
        assert configs.get_config(*args, "NVIDIA_H100_80GB_HBM3", config_dir=tmp_path) == tuned
    assert "no table for NVIDIA_H100_80GB_HBM3, using NVIDIA_H200's (same chip)" in caplog.text
    assert configs.get_config(*args, "NVIDIA_A100-SXM4-80GB", config_dir=tmp_path) == configs.default_config(1, 2, 8)
    own = {**tuned, "BLOCK_N": 64}
    mine = tmp_path / "own"
    mine.mkdir()
    (mine / h200).write_text(json.dumps({"1": tuned}))
    (mine / configs.config_file_name(8, 14336, 4096, torch.bfloat16, "NVIDIA_H100_80GB_HBM3")).write_text(
        json.dumps({"1": own}))
    assert configs.get_config(*args, "NVIDIA_H100_80GB_HBM3", config_dir=mine) == own


def test_tune_script_help() -> None:
    out = subprocess.run([sys.executable, "bench/tune_moe.py", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "--preset" in out.stdout and "mixtral-8x7b" in out.stdout


def test_tune_batch_picks_and_checks_a_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tuner's search for one batch size on a toy geometry, each candidate run once for real (under
    the interpreter without a GPU) with a made-up timing that favours BLOCK_N 32 and 4 warps."""
    sys.path.insert(0, str(ROOT / "bench"))
    import triton.testing
    import tune_moe

    def fake_bench(fn: object, warmup: int, rep: int) -> float:
        fn()  # type: ignore[operator]
        return 1.0

    def timed(cfg: dict[str, int]) -> float:
        return cfg.get("BLOCK_N", 0) / 32 + cfg.get("num_warps", 0) / 4 + cfg.get("BLOCK_M", 0) / 16

    def candidates(*args: object) -> list[dict[str, int]]:
        return tune_moe_candidates(*args)[::4]  # type: ignore[arg-type]  # BLOCK_N 32 and 64, 4 and 8 warps

    tune_moe_candidates = tune_moe.candidates
    monkeypatch.setattr(tune_moe, "candidates", candidates)
    monkeypatch.setattr(triton.testing, "do_bench", fake_bench)
    real_best_of = tune_moe.best_of

    def best_of(fn: object, cands: list[dict[str, int]], rep_ms: int) -> tuple[float, dict[str, int] | None]:
        ms, cfg = real_best_of(fn, cands, rep_ms)
        return min(((timed(c), c) for c in cands), key=lambda p: p[0]) if cfg else (ms, cfg)

    monkeypatch.setattr(tune_moe, "best_of", best_of)
    a = tune_moe.parse_args(["--experts", "4", "--top-k", "2", "--hidden", "32", "--inter", "32"])
    w13, w2 = _weights(4, 32, 32, torch.float32, seed=8)
    cfg, timings = tune_moe.tune_batch(3, a, {"dtype": torch.float32, "w13": w13, "w2": w2})
    assert cfg["BLOCK_M"] == 16 and cfg["BLOCK_N"] == 32 and cfg["num_warps"] == 4
    assert set(cfg["down"]) == set(configs.KEYS) - {"BLOCK_M"} and set(timings) == {"align_ms", "gate_up_ms", "down_ms"}
    up, down = configs.split(cfg)
    assert up["BLOCK_M"] == down["BLOCK_M"] == 16


# ---- on a GPU only: the compiled kernels, CUDA graphs, no host sync -----------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("t,e,k,h,i", [(1, 8, 2, 512, 1024), (7, 128, 8, 256, 192), (300, 16, 4, 512, 384)])
def test_gpu_default_configs_match_the_reference(t: int, e: int, k: int, h: int, i: int) -> None:
    x = _x(t, h, torch.bfloat16, seed=t)
    w13, w2 = _weights(e, h, i, torch.bfloat16, seed=e)
    w, ids = ops.moe_route(torch.randn(t, e, device="cuda"), k, True)
    _close(ops.fused_moe(x, w13, w2, w, ids), fused_moe_ref(x, w13, w2, w, ids))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_route_and_experts_capture_in_a_cuda_graph_without_host_sync() -> None:
    t, e, k, h, i = 8, 8, 2, 256, 512
    x = _x(t, h, torch.bfloat16, seed=1)
    w13, w2 = _weights(e, h, i, torch.bfloat16, seed=2)
    logits = torch.randn(t, e, device="cuda")

    def step() -> torch.Tensor:
        w, ids = ops.moe_route(logits, k, True)
        return ops.fused_moe(x, w13, w2, w, ids, first_expert=0)

    step()  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # raises on any synchronising call
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (3, 4):  # new inputs in the captured buffers, new routing
        g = torch.Generator(device="cuda").manual_seed(seed)
        logits.copy_(torch.randn(t, e, device="cuda", generator=g))
        x.copy_(torch.randn(t, h, device="cuda", generator=g))
        graph.replay()
        _close(out, fused_moe_ref(x, w13, w2, *moe_route_ref(logits, k, True)))


def test_quick_tuning_keeps_narrow_tiles_at_decode_sizes() -> None:
    """--quick drops BLOCK_N 32 only where an expert spans several M blocks: at decode sizes (one block)
    the narrow tile is what fills the SMs when few experts are hit."""
    sys.path.insert(0, str(ROOT / "bench"))
    import tune_moe

    def widths(many: bool) -> set[int]:
        return {c["BLOCK_N"] for c in tune_moe.candidates(16, 14336, 4096, 1, True, many)}

    assert widths(False) == {32, 64, 128} and widths(True) == {64, 128}
    assert {c["BLOCK_N"] for c in tune_moe.candidates(16, 14336, 4096, 1, False, True)} == {32, 64, 128, 256}
