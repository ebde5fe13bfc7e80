"""bench/offline.py's MoE accounting on CPU (the bench itself needs a GPU): the decode roofline reads the
dense weights plus the experts a batch hits, counted from the router's real choices; a dense model
reads all its weights; the FLOP roofline counts active parameters."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from _tiny import make_scheduler, tiny_moe_config

from bench import offline
from bench.gpu_measure import PAGE, Layout, decode_batch
from bench.offline import Bench


def _bench(moe: bool, **args: str) -> Bench:
    import _tiny

    old = _tiny.tiny_config
    _tiny.tiny_config = tiny_moe_config if moe else old  # type: ignore[assignment]
    try:
        s = make_scheduler(page_size=PAGE, max_total_tokens=4096, **args)
    finally:
        _tiny.tiny_config = old  # type: ignore[assignment]
    b = Bench(argparse.Namespace(batch_sizes="1", contexts="32"))
    b.runner, b.bw, b.peak = s.runner, 1e12, 1e15
    b.count_weights(s.runner.cfg, s.runner.model)
    b.layout = Layout(s.runner.num_pages)
    return b


def test_moe_roofline_counts_the_experts_hit() -> None:
    b = _bench(moe=True)
    cfg = b.cfg
    assert cfg.moe is not None and len(b.experts) == cfg.num_layers
    per_expert = 3 * cfg.hidden_size * cfg.moe.intermediate_size * 4  # float32
    assert b.expert_bytes == [per_expert] * cfg.num_layers
    assert b.dense_bytes == b.weight_bytes - cfg.num_layers * cfg.moe.num_experts * per_expert
    one = b.experts_hit(decode_batch(b.layout.pages(1, 32), 32, cfg.vocab_size, "cpu"))
    assert one == [cfg.moe.top_k] * cfg.num_layers  # one token: exactly k experts per layer
    many = b.experts_hit(decode_batch(b.layout.pages(48, 32), 32, cfg.vocab_size, "cpu"))
    assert all(cfg.moe.top_k <= n <= cfg.moe.num_experts for n in many) and sum(many) > sum(one)
    assert b.weight_read_bytes(one) == b.dense_bytes + sum(one) * per_expert < b.weight_bytes
    assert b.weight_read_bytes([cfg.moe.num_experts] * cfg.num_layers) == b.weight_bytes
    assert b.roofline_ms(1, 32, one) < b.roofline_ms(1, 32, many)


def test_uniform_routing_draws_k_distinct_experts_anew_each_forward() -> None:
    """--moe-routing-simulation uniform (as the serving runs of dummy weights): one token still hits exactly
    k experts a layer, but a batch's choice is drawn anew each forward, where the router's own is fixed."""
    fixed, uniform = _bench(moe=True), _bench(moe=True, moe_routing_simulation="uniform")
    cfg = uniform.cfg
    assert cfg.moe is not None
    assert uniform.experts_hit(decode_batch(uniform.layout.pages(1, 32), 32, cfg.vocab_size, "cpu")) == \
        [cfg.moe.top_k] * cfg.num_layers
    batch = decode_batch(uniform.layout.pages(3, 32), 32, cfg.vocab_size, "cpu")
    ids: dict[str, list[list[int]]] = {"fixed": [], "uniform": []}
    for name, b in (("fixed", fixed), ("uniform", uniform)):
        for _ in range(6):
            seen: list[int] = []
            h = b.experts[0].register_forward_pre_hook(lambda _m, a, seen=seen: seen.extend(a[2].flatten().tolist()))
            try:
                b.experts_hit(batch)
            finally:
                h.remove()
            ids[name].append(seen)
    assert all(x == ids["fixed"][0] for x in ids["fixed"])
    assert any(x != ids["uniform"][0] for x in ids["uniform"])


def test_dense_roofline_reads_every_weight() -> None:
    b = _bench(moe=False)
    assert b.experts == [] and b.dense_bytes == b.weight_bytes
    batch = decode_batch(b.layout.pages(4, 32), 32, b.cfg.vocab_size, "cpu")
    assert b.experts_hit(batch) == [] and b.weight_read_bytes([]) == b.weight_bytes
    with torch.no_grad():
        assert b.roofline_flops_ms(4, 32) >= b.roofline_ms(4, 32) - 1e-12


def test_profile_categories_name_the_moe_kernels() -> None:
    """The profile split reads kernel names: each Triton kernel of sglang_ext/ops/moe lands in its category."""
    import re
    from pathlib import Path

    from bench.gpu_measure import kernel_category

    root = Path(__file__).resolve().parents[1] / "sglang_ext" / "ops" / "moe"
    names = {m for f in ("route.py", "align.py", "kernels.py")
             for m in re.findall(r"^def (_\w+_kernel)\(", (root / f).read_text(), re.M)}
    assert names == {"_route_kernel", "_count_kernel", "_place_kernel", "_gate_up_kernel", "_down_kernel",
                     "_sum_kernel"}
    assert {kernel_category(n) for n in ("_route_kernel", "_count_kernel", "_place_kernel")} == {"moe_routing"}
    assert {kernel_category(n) for n in ("_gate_up_kernel", "_down_kernel", "_sum_kernel")} == {"moe_experts"}
    assert kernel_category("BatchDecodeWithPagedKVCacheKernel") == "attention"
    assert kernel_category("_rms_norm_kernel") == "fused_ops"


def test_summary_prints_a_prefill_profile_beside_the_decode_ones() -> None:
    """The H200 run of 2026-12-03 (session 5) wrote its JSON and then died in `summary` on the prefill
    profile, which has no batch geometry: the summary must print every profile the bench writes."""
    run = Path(__file__).parents[1] / "bench/results/2026-12-03-h200-s5/c2-moetune-moebench/offline-mixtral-8x7b.json"
    text = offline.summary(json.loads(run.read_text()))
    assert "profile[prefill_1x1024]: " in text
    assert "profile[graph] bs=64 ctx=2048" in text and "attention 15% of kernel time" in text


def test_an_unknown_routing_simulation_is_refused_with_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    """bench/offline.py parses its flags before it looks for a GPU: a wrong --moe-routing-simulation is a
    usage error naming the allowed values, on any machine."""
    with pytest.raises(SystemExit) as e:
        offline.main(["--moe-routing-simulation", "zipf"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--moe-routing-simulation" in err and "'off'" in err and "'uniform'" in err


def test_the_kv_pool_is_cut_to_what_fits_beside_the_weights() -> None:
    """`kv_tokens_that_fit`: the sweep's H200-sized default pool is kept where it fits and cut where it does
    not (on an H100, 2026-12-07, Qwen3-30B-A3B asked 54.9 GiB of pool beside 57 GiB of weights and died at
    set-up; Llama-3-8B at bs 128 x 4K asked 65 GiB)."""
    from bench.sim.geometry import Geometry

    gib = 1 << 30
    h100_free, h200_free = int(79.1 * gib), int(139.8 * gib)
    qwen3, mixtral, llama = (Geometry.preset(n) for n in ("qwen3-30b-a3b", "mixtral-8x7b", "llama-3-8b"))
    assert offline.kv_tokens_that_fit(600_000, h200_free, qwen3) == 600_000  # what the H200 runs had
    assert offline.kv_tokens_that_fit(300_000, h200_free, mixtral) == 300_000
    cut = offline.kv_tokens_that_fit(600_000, h100_free, qwen3)
    assert 100_000 < cut < 250_000  # ~18 GiB of KV at 96 KiB a token, not the 54.9 GiB asked
    assert cut * qwen3.kv_bytes_per_token < 21.58 * gib  # what the failed set-up reported free after the weights
    llama_cut = offline.kv_tokens_that_fit(655_360, h100_free, llama)
    assert llama_cut < 655_360
    # a cut pool is an int: a float (Geometry counts bytes in floats) killed the set-up on an H100
    # (torch.empty refuses a float size; 2026-12-07 session 12, `487597.0 tokens`)
    assert type(cut) is int and type(llama_cut) is int
    assert offline.kv_tokens_that_fit(300_000, h100_free, mixtral) == 0  # 87 GiB of weights: no room at all


def test_prefill_shapes_parse_and_a_bad_one_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """--prefill-shapes: the single-request prefills the simulator's MoE prefill fit needs (three or more)."""
    assert offline.parse_shapes("1x256, 1X2048,4x2048") == [(1, 256, 0, 0, 0), (1, 2048, 0, 0, 0), (4, 2048, 0, 0, 0)]
    # serving's forwards: a chunk after a prefix, decode rows riding along, or both
    assert offline.parse_shapes("1x1024@4096,1x2048+24d6000,2x512@3000+8d5000") == [
        (1, 1024, 4096, 0, 0), (1, 2048, 0, 24, 6000), (2, 512, 3000, 8, 5000)]
    for bad in ("1024", "0x1024", "1x", "ax2", "1x1024@", "1x1024+24", "1x1024+0d500", "1x1024+4d0", "1x8@-1"):
        with pytest.raises(ValueError, match="REQSxLEN"):
            offline.parse_shapes(bad)
    with pytest.raises(SystemExit) as e:  # a usage error before any GPU is looked for
        offline.main(["--prefill-shapes", "1024", "--sections", "prefill"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--prefill-shapes" in err and "expected REQSxLEN" in err


def test_a_serving_shaped_prefill_batch_holds_the_prefix_and_the_riding_rows() -> None:
    """bench/offline.py's 1x40@32+2d50: one chunk of 40 tokens at positions 32-71 over its own pages (the
    prefix's KV read from the pool), and two decode rows at position 49 beside it, on disjoint pages."""
    from bench.gpu_measure import PAGE, Layout, prefill_batch

    layout = Layout(64)
    pages = layout.pages_each([32 + 40, 50, 50])
    assert [len(p) for p in pages] == [-(-72 // PAGE), -(-50 // PAGE), -(-50 // PAGE)]
    assert len({q for p in pages for q in p}) == sum(len(p) for p in pages)  # disjoint
    b = prefill_batch(pages[:1], 40, 1000, 32, [(p, 50) for p in pages[1:]], device="cpu")
    assert b.extend_lens == [40, 1, 1] and b.seq_lens == [72, 50, 50]
    assert b.positions.tolist() == [*range(32, 72), 49, 49]
