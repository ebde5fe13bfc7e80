"""bench/sim: the cost model's fit recovers known rates, the H200 calibration predicts the measured step
times, missing measurements stay null with a reason, the MoE expected-experts formula, and the MoE path:
runs read with their geometry and measured hits, the moe rates' fit and its held-out split."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.sim import fit as fitmod
from bench.sim.cost import DEFAULT_CALIBRATION, Calibration, CostModel, Uncalibrated
from bench.sim.geometry import Geometry, expected_experts_hit
from bench.sim.runs import Report, decode_rows, find_reports, report_geometry
from bench.sim.validate import validate

LLAMA = Geometry.preset("llama-3-8b")
TRUE = {"weights_GBps": 3500.0, "gemm_TFLOPs": 600.0, "kv_GBps": 4400.0, "row_us": 9.0, "step_us": 450.0}


def _cal(**over: object) -> Calibration:
    d = json.loads(DEFAULT_CALIBRATION.read_text())
    d.update(over)
    return Calibration.from_dict(d)


def test_geometry_matches_the_bytes_offline_py_measured() -> None:
    assert LLAMA.dense_weight_bytes == 15_009_849_344  # env.weight_GB of every H200 offline report
    assert LLAMA.kv_bytes_per_token == 131_072
    assert Geometry.preset("preset:qwen2.5-32b").dense_weight_bytes > 4 * LLAMA.dense_weight_bytes


def test_decode_fit_recovers_known_rates_from_rows_the_model_generated() -> None:
    cm = CostModel(_cal(decode={**TRUE}), LLAMA)
    rows = [(bs, ctx, cm.decode_s(bs, bs * ctx)) for bs in (1, 8, 32, 64, 128, 256, 512) for ctx in (512, 2048, 8192)]
    got = fitmod.fit_decode(rows, LLAMA, TRUE["weights_GBps"])
    for k, v in TRUE.items():
        assert got[k] == pytest.approx(v, rel=1e-3), k


def test_prefill_fit_recovers_known_rates() -> None:
    cm = CostModel(_cal(decode={**TRUE}, prefill={"gemm_TFLOPs": 550.0, "attention_TFLOPs": 380.0}), LLAMA)
    rows = [(q, n, cm.prefill_s([(n, n)] * q)) for q, n in ((1, 1024), (1, 8192), (4, 2048), (2, 4096))]
    got = fitmod.fit_prefill(rows, LLAMA, TRUE["step_us"])
    assert got["gemm_TFLOPs"] == pytest.approx(550.0, rel=1e-6)
    assert got["attention_TFLOPs"] == pytest.approx(380.0, rel=1e-6)


def test_h200_calibration_predicts_the_measured_step_times() -> None:
    res = validate(DEFAULT_CALIBRATION, fitmod.RESULTS)
    for r in res["rows"]:
        print(f"{r['set']:13s} {r['point']:28s} {r['measured_ms']:8.2f} {r['predicted_ms']:8.2f} "
              f"{r['err_pct']:+6.1f} %")
    s = res["summary"]
    print({k: (v["n"], v["mape_pct"], v["max_ape_pct"]) for k, v in s.items()})
    assert s["decode fit"]["n"] >= 12 and s["decode held-out"]["n"] >= 10
    # what the committed fit reaches (0.6 / 1.4 % mean, 1.2 / 4.8 % max), with a margin
    assert s["decode fit"]["mape_pct"] < 2.0 and s["decode fit"]["max_ape_pct"] < 3.0
    assert s["decode held-out"]["mape_pct"] < 3.0 and s["decode held-out"]["max_ape_pct"] < 6.0
    assert s["prefill held-out"]["max_ape_pct"] < 6.0
    assert s["loo"]["max_ape_pct"] < 6.0
    # ctx 8K was never fitted: the extrapolation in KV holds
    k8 = [r for r in res["rows"] if r["set"] == "held-out" and "ctx 8192" in r["point"]]
    assert k8 and all(abs(r["err_pct"]) < 5.0 for r in k8)


def test_missing_measurements_are_null_with_a_reason() -> None:
    cal = Calibration.load()
    for key in ("decode.moe_trained_routing", "prefill.moe", "host_link.c2c", "prefill.mixed_batches",
                "executor_host.capped_two_gpu"):
        assert cal.missing[key]
    for v in cal.missing.values():
        assert isinstance(v, str) and len(v) > 10
    link, why = fitmod.host_link([])  # no kv_rotation run: null, never a guess
    assert set(link.values()) == {None} and "kv_rotation" in why
    ex, _ = fitmod.exchange([])
    assert all(v["base_us"] is None for v in ex.values())
    cm = CostModel(_cal(host_link=link, missing={"host_link.d2h_GBps": why}), LLAMA)
    with pytest.raises(Uncalibrated, match="kv_rotation"):
        cm.copy_s(1e9, "out")
    with pytest.raises(Uncalibrated, match="executor_max_sms=12"):
        CostModel.load().host_increase(16.0, executor_sms=12)


def test_link_exchange_and_host_use_the_measured_rates() -> None:
    cm = CostModel.load()
    link = cm.cal.host_link
    assert cm.copy_s(1e9, "out") == pytest.approx(1 / link["d2h_GBps"])  # type: ignore[operator]
    assert cm.copy_s(1e9, "in", duplex=True) == pytest.approx(2 / link["duplex_GBps"])  # type: ignore[operator]
    with pytest.raises(ValueError, match="direction"):
        cm.copy_s(1.0, "sideways")
    assert cm.exchange_s(0) == 0.0 and cm.exchange_s(128, "signalled") > cm.exchange_s(128, "lean") > 0
    assert cm.host_increase(32.0) == pytest.approx(2 * cm.host_increase(16.0))
    assert cm.host_increase(32.0, executor_sms=8) < cm.host_increase(32.0)


def test_expected_experts_hit_formula() -> None:
    assert expected_experts_hit(8, 2, 1) == pytest.approx(2.0)
    assert expected_experts_hit(8, 2, 2) == pytest.approx(8 * (1 - 0.75**2))
    assert expected_experts_hit(128, 8, 10_000) == pytest.approx(128.0)
    assert expected_experts_hit(8, 2, 0) == 0.0
    rng = np.random.default_rng(0)  # uniform top-k routing, simulated
    for e, k, rows in ((8, 2, 3), (64, 6, 16), (128, 8, 32)):
        sims = [len({int(x) for _ in range(rows) for x in rng.choice(e, k, replace=False)}) for _ in range(2000)]
        assert float(np.mean(sims)) == pytest.approx(expected_experts_hit(e, k, rows), rel=0.02)


def test_moe_geometry_reads_dense_weights_plus_the_experts_hit() -> None:
    """Mixtral-8x7B from its preset: every expert counted once gives the model's bf16 weights (all but the
    embedding table, which a step gathers from); a step reads the dense weights plus the experts hit."""
    from sglang_ext.configs import preset_config_file
    from sglang_ext.models.config import ModelConfig

    cfg = ModelConfig.from_path(preset_config_file("mixtral-8x7b"))
    g = Geometry.from_model_config(cfg, "mixtral-8x7b")
    expert = 2 * 3 * 4096 * 14336
    assert g.is_moe and g.expert_bytes == expert and g.sparse_layers == 32 and (g.num_experts, g.top_k) == (8, 2)
    assert g.dense_weight_bytes + 32 * 8 * expert == 2 * (cfg.num_params() - cfg.vocab_size * cfg.hidden_size)
    assert g.weight_read_bytes(1) == pytest.approx(g.dense_weight_bytes + 32 * 2 * expert)
    assert g.weight_read_bytes(10_000) == pytest.approx(g.dense_weight_bytes + 32 * 8 * expert)
    assert g.weight_read_bytes(4, experts_hit=3.0) == g.dense_weight_bytes + 32 * 3 * expert
    # FLOPs per row: the active parameters (k experts), the LM head included, the embedding not
    assert g.layer_params == pytest.approx(cfg.active_params() - 2 * cfg.vocab_size * cfg.hidden_size, abs=4096)
    cm = CostModel.load()
    moe_cm = CostModel(cm.cal, g)
    assert moe_cm.decode_s(1, 1024) < moe_cm.decode_s(64, 64 * 1024) < moe_cm.decode_s(256, 256 * 1024)


def test_padded_experts_price_the_engine_before_padding_rows_reached_no_expert() -> None:
    """`graph_sizes` (replaying runs made before 2e5bb7a): a decode step's experts are those its CUDA graph's
    padded rows hit, its attention and rows the real ones; graph sizes, eager sizes past the largest graph
    and dense models are priced as before."""
    sizes = (1, 2, 4, 8, 16, 24, 32)
    now = CostModel.load(DEFAULT_CALIBRATION, "qwen3-30b-a3b")
    then = CostModel.load(DEFAULT_CALIBRATION, "qwen3-30b-a3b", graph_sizes=sizes)
    kv = 12 * 4096
    assert then.decode_s(12, kv) == pytest.approx(now.decode_s(12, kv, experts_hit=now.geo.experts_hit(16)))
    assert then.decode_s(12, kv) > 1.05 * now.decode_s(12, kv)  # 16 rows' experts, not 12's
    for rows in (8, 16, 24, 40):
        assert then.decode_s(rows, rows * 4096) == now.decode_s(rows, rows * 4096)
    assert then.decode_s(12, kv, experts_hit=30.0) == now.decode_s(12, kv, experts_hit=30.0)  # measured: as given
    dense = CostModel.load(DEFAULT_CALIBRATION, "llama-3-8b", graph_sizes=sizes)
    assert dense.decode_s(12, kv) == CostModel.load(DEFAULT_CALIBRATION, "llama-3-8b").decode_s(12, kv)


def test_fit_command_writes_a_calibration_with_its_runs(tmp_path: Path) -> None:
    out = tmp_path / "h200.json"
    assert fitmod.main(["--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["gpu"] == "NVIDIA H200" and d["model_measured"] == "llama-3-8b"
    assert any(r["fit"] and r["path"].endswith("2026-11-29-h200-offline.json") for r in d["runs"])
    kinds = {r["kind"] for r in d["runs"]}
    assert {"offline", "kv_rotation", "ra_exchange", "remote_step", "remote_host"} <= kinds
    assert all(r["date"] for r in d["runs"])
    committed = json.loads(DEFAULT_CALIBRATION.read_text())
    for k in ("weights_GBps", "gemm_TFLOPs", "kv_GBps", "row_us", "step_us"):  # refitting is reproducible
        assert d["decode"][k] == pytest.approx(committed["decode"][k], rel=1e-6), k


MOE_DIR = "2026-12-03-h200-s4/c2-moebench-bench/"


def _moe_reports() -> list[Report]:
    return [r for r in find_reports(fitmod.RESULTS) if MOE_DIR in r.rel() and r.model != "llama-3-8b"]


def test_moe_runs_are_read_with_their_geometry_and_measured_hits() -> None:
    reports = _moe_reports()
    assert sorted(r.model for r in reports) == ["mixtral-8x7b", "qwen3-30b-a3b"]
    for r in reports:
        geo = report_geometry(r)
        assert geo.is_moe and geo.name == r.model
        assert (geo.num_experts, geo.top_k, geo.sparse_layers) == (
            r.env["moe"]["experts"], r.env["moe"]["top_k"], r.env["moe"]["sparse_layers"])
        assert geo.dense_weight_bytes == pytest.approx(r.env["dense_weight_GB"] * 1e9, rel=1e-6)
    rows = decode_rows(reports)
    assert len(rows) == 18 and all(d.experts_hit is not None for d in rows)
    mix8k = next(d for d in rows if d.model == "mixtral-8x7b" and (d.bs, d.ctx) == (8, 8192))
    assert mix8k.experts_hit == pytest.approx(7.09375) and mix8k.ms == pytest.approx(23.05194, rel=1e-5)
    # a preset that no longer matches the run's weight bytes is an error, not a silent mispricing
    bad = Report("offline", reports[0].path, {**reports[0].data, "env": {**reports[0].env, "weight_GB": 50.0}})
    with pytest.raises(ValueError, match="weight"):
        report_geometry(bad)


def test_measured_hits_are_used_when_a_row_has_them() -> None:
    cm = CostModel(Calibration.load(), Geometry.preset("mixtral-8x7b"))
    uniform = cm.geo.experts_hit(8)
    assert uniform == pytest.approx(8 * (1 - 0.75**8))
    fewer = cm.decode_s(8, 8 * 8192, experts_hit=7.09375)
    expert_rate = cm.cal.get("moe", "expert_GBps") * 1e9
    saved = 32 * (uniform - 7.09375) * cm.geo.expert_bytes / expert_rate
    assert cm.decode_s(8, 8 * 8192) - fewer == pytest.approx(saved)
    res = validate(DEFAULT_CALIBRATION, fitmod.RESULTS)
    row = next(r for r in res["rows"] if r["set"] == "moe-held-out" and r["point"] == "mixtral-8x7b bs 8 ctx 8192")
    assert row["experts_hit_measured"] == pytest.approx(7.09375)
    assert row["experts_hit_uniform"] == pytest.approx(uniform)
    assert row["predicted_ms"] == pytest.approx(1e3 * fewer) and row["predicted_uniform_ms"] > row["predicted_ms"]


def test_moe_fit_recovers_known_rates_and_the_dense_model_ignores_them() -> None:
    true = {"expert_GBps": 4000.0, "layer_expert_us": 0.3}
    cal = _cal(moe=true)
    geos = [Geometry.preset("mixtral-8x7b"), Geometry.preset("qwen3-30b-a3b")]
    rows = [(g, bs, ctx, CostModel(cal, g).decode_s(bs, bs * ctx), None) for g in geos
            for bs in (1, 8, 32, 128) for ctx in (1024, 4096)]
    got = fitmod.fit_moe(rows, dict(cal.decode))
    assert got["expert_GBps"] == pytest.approx(4000.0, rel=1e-6)
    assert got["layer_expert_us"] == pytest.approx(0.3, rel=1e-6)
    # Qwen3's fixed term: 48 layers x 128 experts x 0.3 us; a dense model pays none
    assert CostModel(cal, geos[1]).moe_overhead_s() == pytest.approx(48 * 128 * 0.3e-6)
    assert CostModel(cal, LLAMA).moe_overhead_s() == 0.0
    assert CostModel(cal, LLAMA).decode_s(64, 64 * 2048) == CostModel(_cal(), LLAMA).decode_s(64, 64 * 2048)
    # a file without the section prices experts at the dense rate, with no MoE term (the "dense rates")
    old = {k: v for k, v in json.loads(DEFAULT_CALIBRATION.read_text()).items() if k != "moe"}
    dense = CostModel(Calibration.from_dict(old), geos[0])
    assert dense.moe_overhead_s() == 0.0
    assert dense.decode_s(1, 1024) >= geos[0].weight_read_bytes(1) / (dense.cal.get("decode", "weights_GBps") * 1e9)


MOE_S5 = "2026-12-03-h200-s5/c2-moetune-moebench/"
S9 = "2026-12-06-h200-s9/"


def test_moe_validation_holds_out_what_the_fit_did_not_see() -> None:
    cal = json.loads(DEFAULT_CALIBRATION.read_text())
    src = cal["sources"]["moe_fit"]
    assert src["ctx"] == 1024 and len(src["rows"]) == 12 and len(src["held_out"]) == 6
    assert not set(src["rows"]) & set(src["held_out"])
    assert all("ctx 8192" in p for p in src["held_out"]) and all("ctx 1024" in p for p in src["rows"])
    # the tuned-table Mixtral run replaces the untuned one; its bs 64 is no outlier and is fitted
    assert src["excluded"] == [] and "mixtral-8x7b bs 64 ctx 1024" in src["rows"]
    assert [s["source"] for s in src["superseded"]] == ["bench/results/" + MOE_DIR + "offline-mixtral-8x7b.json"]
    assert sorted(src["runs"]) == ["bench/results/" + MOE_DIR + "offline-qwen3-30b-a3b.json",
                                   "bench/results/" + MOE_S5 + "offline-mixtral-8x7b.json"]
    runs = {r["path"]: r for r in cal["runs"]}
    for path in src["runs"]:
        assert runs[path]["kind"] == "offline" and runs[path]["used_for"].startswith("moe fit")
    old = runs["bench/results/" + MOE_DIR + "offline-mixtral-8x7b.json"]
    assert old["used_for"].startswith("not used: measured with the untuned") and MOE_S5 in old["used_for"]
    assert runs["bench/results/" + MOE_DIR + "offline.json"]["used_for"] == "validation (held out)"

    res = validate(DEFAULT_CALIBRATION, fitmod.RESULTS)
    by_set: dict[str, list[dict[str, object]]] = {}
    for r in res["rows"]:
        by_set.setdefault(r["set"], []).append(r)
    def decode(group: str) -> list[dict[str, object]]:
        return [r for r in by_set[group] if str(r["what"]).startswith("decode")]

    def in_fit(r: dict[str, object]) -> bool:
        return any(f.endswith(str(r["source"])) for f in src["runs"])

    fitted = {r["point"] for r in decode("moe-fit")}
    assert fitted == set(src["rows"]) and all(in_fit(r) for r in decode("moe-fit"))
    held = {r["point"] for r in decode("moe-held-out") if in_fit(r)}
    assert held == set(src["held_out"]) and not held & fitted
    # runs measured after the fit are held out whole, their rows at the fit's context too (session 9's
    # Mixtral rows at ctx 1,024 and 6,144, with the router's choice and with uniform routing)
    later = [r for r in decode("moe-held-out") if not in_fit(r)]
    assert {str(r["source"]) for r in later} == {"bench/results/" + S9 + "offline-mixtral-8x7b-off.json",
                                                 "bench/results/" + S9 + "offline-mixtral-8x7b-uniform.json"}
    assert len(later) == 16 and any("ctx 1024" in str(r["point"]) for r in later)
    assert all(abs(float(str(r["err_pct"]))) < 5.0 for r in later)
    assert "moe-outlier" not in by_set
    assert not any(MOE_DIR + "offline-mixtral" in str(r["source"]) for r in res["rows"])  # superseded: unused
    mix = next(r for r in by_set["moe-fit"] if r["point"] == "mixtral-8x7b bs 64 ctx 1024")
    assert mix["measured_ms"] == pytest.approx(26.886, rel=1e-4) and abs(float(mix["err_pct"])) < 5.0
    s = res["summary"]
    # what the committed fit reaches (held out: 2.3 % mean over 22 rows, 11.6 % max), with a margin
    assert s["moe-held-out decode"]["n"] == 22 and s["moe-held-out decode"]["mape_pct"] < 5.0
    assert s["moe-held-out decode"]["max_ape_pct"] < 13.0
    assert s["moe-dense decode"]["n"] == 34 and s["moe-dense decode"]["max_ape_pct"] > 40.0  # Qwen3 bs 1
    # the new dense run is held out and within the dense band
    new = [r for r in res["rows"] if r["source"].endswith(MOE_DIR + "offline.json")]
    assert len(new) == 3 and all(r["set"] == "held-out" and abs(float(r["err_pct"])) < 5.0 for r in new)


MOE_PRE = {"expert_GBps": 3600.0, "layer_expert_us": 6.0, "gemm_TFLOPs": 500.0,
           "blend_from_tokens": 256.0, "blend_to_tokens": 1024.0}


def test_moe_prefill_fit_recovers_known_rates_from_rows_the_model_generated() -> None:
    cal = _cal(moe={"expert_GBps": 4100.0, "layer_expert_us": 0.36}, moe_prefill=MOE_PRE)
    geos = [Geometry.preset("mixtral-8x7b"), Geometry.preset("qwen3-30b-a3b")]
    rows = [(g, q, n, CostModel(cal, g).prefill_s([(n, n)] * q)) for g in geos
            for q, n in ((1, 1024), (1, 8192), (4, 2048), (2, 4096))]
    got = fitmod.fit_moe_prefill(rows, dict(cal.decode), dict(cal.prefill))
    for k in ("expert_GBps", "layer_expert_us", "gemm_TFLOPs"):
        assert got[k] == pytest.approx(MOE_PRE[k], rel=1e-6), k
    # one model's rows (two token counts) cannot identify three rates: a dropped rate is infinite, not None
    one = fitmod.fit_moe_prefill([r for r in rows if r[0] is geos[0] and r[1] == 1], dict(cal.decode),
                                 dict(cal.prefill))
    assert all(v is not None for v in one.values())


def test_moe_prefill_fit_takes_its_own_attention_rate_from_many_lengths() -> None:
    """Single-request prefills of >= fit.MOE_ATTENTION_MIN_LENGTHS lengths (the H100's Qwen3: 256 to 8K) tell
    the attention's L^2 from the GEMMs' L: the fit then returns moe_prefill.attention_TFLOPs, and the cost
    model prices an MoE prefill's attention with it (a dense model's stays at prefill.attention_TFLOPs)."""
    truth = {**MOE_PRE, "attention_TFLOPs": 180.0}
    cal = _cal(moe={"expert_GBps": 4100.0, "layer_expert_us": 0.36}, moe_prefill=truth)
    g = Geometry.preset("qwen3-30b-a3b")
    cm = CostModel(cal, g)
    assert cm.attention_TFLOPs() == 180.0
    assert CostModel(cal, Geometry.preset("llama-3-8b")).attention_TFLOPs() == cal.get("prefill", "attention_TFLOPs")
    lengths = (1024, 1536, 2048, 4096, 6144, 8192)
    rows = [(g, 1, n, cm.prefill_s([(n, n)])) for n in lengths]
    got = fitmod.fit_moe_prefill(rows, dict(cal.decode), dict(cal.prefill))
    for k in ("gemm_TFLOPs", "attention_TFLOPs"):
        assert got[k] == pytest.approx(truth[k], rel=1e-5), k
    # one model from 1K tokens up hits every expert: only the per-expert sum of read and fixed cost is known
    def per_expert(r: dict[str, float]) -> float:
        return g.expert_bytes / (r["expert_GBps"] * 1e9) + r["layer_expert_us"] * 1e-6
    assert per_expert(got) == pytest.approx(per_expert(truth), rel=1e-5)
    # fewer lengths (the H200's 1K and 8K a model): no attention column, the dense rate stays
    few = fitmod.fit_moe_prefill(rows[:2] + rows[-1:], dict(cal.decode), dict(cal.prefill))
    assert "attention_TFLOPs" not in few
    no_own = _cal(moe={"expert_GBps": 4100.0, "layer_expert_us": 0.36}, moe_prefill=MOE_PRE)
    assert CostModel(no_own, g).attention_TFLOPs() == no_own.get("prefill", "attention_TFLOPs")


def test_moe_prefill_fit_takes_the_attention_rate_from_equal_tokens_after_a_prefix() -> None:
    """Two lengths alone cannot give an MoE its attention rate; the same token counts measured again after a
    prefix (bench/offline.py's 1x6144@1536) can: equal expert and GEMM work, more attention. The fit then
    returns moe_prefill.attention_TFLOPs and prices the prefix rows exactly."""
    truth = {**MOE_PRE, "attention_TFLOPs": 345.0}
    cal = _cal(moe={"expert_GBps": 4100.0, "layer_expert_us": 0.36}, moe_prefill=truth)
    g = Geometry.preset("qwen3-30b-a3b")
    cm = CostModel(cal, g)
    shapes = ((2048, 0), (8192, 0), (2048, 4096), (8192, 1024), (4096, 0), (4096, 2048))
    rows = [(g, 1, n, cm.prefill_s([(n, p + n)]), p) for n, p in shapes]
    assert not fitmod.equal_token_pairs([r[:4] for r in rows if r[4] == 0])  # no prefix: only lengths
    assert fitmod.equal_token_pairs(rows)
    got = fitmod.fit_moe_prefill(rows, dict(cal.decode), dict(cal.prefill))
    assert got["attention_TFLOPs"] == pytest.approx(345.0, rel=1e-5)
    assert got["gemm_TFLOPs"] == pytest.approx(truth["gemm_TFLOPs"], rel=1e-5)
    # without the prefix rows (three lengths): the dense prefill's attention rate stays
    assert "attention_TFLOPs" not in fitmod.fit_moe_prefill([r for r in rows if r[4] == 0], dict(cal.decode),
                                                            dict(cal.prefill))


def test_equal_token_attention_groups_equal_shapes_only() -> None:
    """The attention slope takes rows of one geometry and one shape (requests, tokens each): 2 x 3072 beside
    1 x 6144 differs in LM head rows too, so it is no group; a slope that is not positive measures nothing."""
    g = Geometry.preset("qwen3-30b-a3b")
    per_flop = 1 / 345e12
    lone = [(g, 1, 6144, 0.1 + g.attention_flops(6144, 6144) * per_flop),
            (g, 1, 6144, 0.1 + g.attention_flops(6144, 7680) * per_flop, 1536)]
    assert fitmod.equal_token_attention_s(lone) == pytest.approx(per_flop, rel=1e-9)
    assert fitmod.equal_token_attention_s([lone[0], (g, 2, 3072, 0.09)]) is None
    assert fitmod.equal_token_attention_s([lone[0], (g, 1, 6144, 0.05, 1536)]) is None  # faster with more keys


def test_a_prefill_only_offline_report_is_read() -> None:
    """bench/offline.py --sections prefill (--prefill-shapes rows alone) writes an empty decode list: its
    prefill rows still count (the H100's Qwen3 prefills of 2026-12-07 s15 are such reports)."""
    from bench.sim.runs import classify, prefill_rows

    d = {"decode": [], "prefill": [{"reqs": 1, "len": 256, "ms": 45.9}], "env": {"gpu": "X"}}
    assert classify(d) == "offline"
    assert classify({"decode": [], "prefill": []}) is None
    reps = [r for r in find_reports(gpu="H100") if r.rel().endswith("h100-s15/c4-offline-qwen3-prefill.json")]
    assert len(reps) == 1 and {(p.reqs, p.length) for p in prefill_rows(reps)} >= {(1, 256), (1, 4096)}


def test_serving_shaped_prefill_rows_are_validated_not_fitted(tmp_path: Path) -> None:
    """bench/offline.py's REQSxLEN@PREFIX+ROWSdCTX rows (a chunk after a prefix, decode rows riding) are read
    with their shape, kept out of the rows the prefill rates are fitted to, and priced as serving's forwards
    (the chunk's attention over the prefix, the decode rows beside it)."""
    from bench.sim.fit import is_fit
    from bench.sim.runs import Report, prefill_rows

    d = {"decode": [], "env": {"gpu": "X", "model": "preset:qwen3-30b-a3b"}, "prefill": [
        {"reqs": 1, "len": 2048, "ms": 50.0},
        {"reqs": 1, "len": 2048, "ms": 60.0, "prefix": 4096, "decode_rows": 0, "decode_ctx": 0},
        {"reqs": 1, "len": 2048, "ms": 58.0, "prefix": 0, "decode_rows": 16, "decode_ctx": 6000}]}
    path = tmp_path / "offline.json"
    path.write_text(json.dumps(d))
    rep = Report("offline", path, d)
    lone, after, mixed = prefill_rows([rep])
    assert (lone.single, after.single, mixed.single) == (True, False, False)
    assert [is_fit(p, {rep.rel()}) for p in (lone, after, mixed)] == [True, False, False]
    assert after.shape == "1 x 2048 @ 4096" and mixed.shape == "1 x 2048 + 16 decoding at 6000"
    cm = CostModel(_cal(), Geometry.preset("qwen3-30b-a3b"))
    assert after.priced_s(cm) == cm.prefill_s([(2048, 6144)])
    assert mixed.priced_s(cm) == cm.prefill_s([(2048, 2048)], 16, 96_000)
    assert after.priced_s(cm) > lone.priced_s(cm) and mixed.priced_s(cm) > lone.priced_s(cm)


def test_moe_prefill_blends_from_the_decode_form_to_the_prefill_form() -> None:
    cal = _cal(moe={"expert_GBps": 4100.0, "layer_expert_us": 0.36}, moe_prefill=MOE_PRE)
    g = Geometry.preset("qwen3-30b-a3b")
    cm = CostModel(cal, g)
    assert cm.has_moe_prefill()

    def decode_form(t: int) -> float:
        return g.sparse_layers * g.experts_hit(t) * g.expert_bytes / 4100e9 + cm.moe_overhead_s()

    def prefill_form(t: int) -> float:
        return (g.sparse_layers * g.experts_hit(t) * (g.expert_bytes / 3600e9 + 6e-6)
                + g.expert_flops(t) / 500e12)

    for t in (1, 16, 256):  # a short chunk costs its experts like a decode batch of as many rows
        assert cm.moe_prefill_experts_s(t) == pytest.approx(decode_form(t))
    for t in (1024, 4096, 8192):  # the measured prefill regime
        assert cm.moe_prefill_experts_s(t) == pytest.approx(max(decode_form(t), prefill_form(t)))
    mid = cm.moe_prefill_experts_s(640)  # halfway: the mean of the two
    assert mid == pytest.approx(0.5 * decode_form(640) + 0.5 * max(decode_form(640), prefill_form(640)))
    assert g.expert_flops(1024) == pytest.approx(2 * 3 * 2048 * 768 * 8 * 1024 * 48)
    # the prefill form prices the non-expert GEMMs at the dense prefill rate, and drops the decode fixed term
    t = cm.prefill_s([(8192, 8192)])
    rest = 2.0 * g.layer_params * 8192 + 2.0 * g.lm_head_params - g.expert_flops(8192)
    want = (max(g.dense_weight_bytes / (cal.decode["weights_GBps"] * 1e9), rest / (cal.prefill["gemm_TFLOPs"] * 1e12))
            + prefill_form(8192) + g.attention_flops(8192, 8192) / (cal.prefill["attention_TFLOPs"] * 1e12)
            + cal.decode["step_us"] * 1e-6)
    assert t == pytest.approx(want)
    # a dense model ignores the section; a file without it prices MoE prefill as before (dense rates + moe term)
    assert CostModel(cal, LLAMA).prefill_s([(4096, 4096)]) == CostModel(_cal(), LLAMA).prefill_s([(4096, 4096)])
    no_term = CostModel(_cal(moe={"expert_GBps": 4100.0, "layer_expert_us": 0.36}, moe_prefill=None), g)
    assert not no_term.has_moe_prefill()
    flops = 2.0 * g.layer_params * 8192 + 2.0 * g.lm_head_params
    old = (no_term._dense_s(8192, flops, cal.prefill["gemm_TFLOPs"], None) + no_term.moe_overhead_s()
           + g.attention_flops(8192, 8192) / (cal.prefill["attention_TFLOPs"] * 1e12) + cal.decode["step_us"] * 1e-6)
    assert no_term.prefill_s([(8192, 8192)]) == pytest.approx(old)


def test_moe_prefill_term_is_fitted_on_single_prefills_and_validated_on_the_rest() -> None:
    cal = json.loads(DEFAULT_CALIBRATION.read_text())
    src = cal["sources"]["moe_prefill_fit"]
    assert sorted(src["rows"]) == ["mixtral-8x7b 1 x 1024", "mixtral-8x7b 1 x 8192", "qwen3-30b-a3b 1 x 1024",
                                   "qwen3-30b-a3b 1 x 8192"]
    assert sorted(src["held_out"]) == ["mixtral-8x7b 4 x 2048", "qwen3-30b-a3b 4 x 2048"]
    mp = cal["moe_prefill"]
    assert 2000 < mp["expert_GBps"] < 4800 and 0 < mp["layer_expert_us"] < 50 and 200 < mp["gemm_TFLOPs"] < 800
    assert (mp["blend_from_tokens"], mp["blend_to_tokens"]) == (256, 1024)
    assert "moe_prefill" not in cal["missing"]
    s = validate(DEFAULT_CALIBRATION, fitmod.RESULTS)["summary"]
    # committed: fit rows within 2.1 %, held-out batched prefills within 2.5 %, leave-one-out 11.1 % mean
    assert s["moe-fit prefill"]["n"] == 4 and s["moe-fit prefill"]["max_ape_pct"] < 4.0
    assert s["moe-held-out prefill"]["n"] == 2 and s["moe-held-out prefill"]["max_ape_pct"] < 5.0
    assert s["moe-loo prefill"]["n"] == 4 and s["moe-loo prefill"]["mape_pct"] < 15.0
    assert s["moe-no-prefill-term prefill"]["n"] == 6 and s["moe-no-prefill-term prefill"]["mape_pct"] > 30.0
    assert s["moe-cross prefill qwen3-30b-a3b"]["max_ape_pct"] > 100.0  # Mixtral alone does not transfer


def test_the_moe_occupancy_analysis_reproduces_the_fit_at_h_0(tmp_path: Path) -> None:
    """bench/sim/moe_occupancy.py: at h = 0 it is fit.py's fit_moe (the calibration's moe rates and the
    -11.6 % worst row); the programs it counts are the tuned tables' (Mixtral bs 1: 448 gate/up, 128 down)."""
    from bench.sim import moe_occupancy as O

    assert O.programs(Geometry.preset("mixtral-8x7b"), 1, 2.0) == (448, 128)
    out = tmp_path / "occ.json"
    assert O.main(["--h", "0", "0.3", "--out", str(out)]) == 0
    sweep = json.loads(out.read_text())["sweep"]
    cal = json.loads(DEFAULT_CALIBRATION.read_text())["moe"]
    assert sweep[0]["expert_GBps"] == pytest.approx(cal["expert_GBps"], rel=1e-6)
    assert sweep[0]["layer_expert_us"] == pytest.approx(cal["layer_expert_us"], rel=1e-6)
    worst = max(abs(r["error_pct"]) for r in sweep[0]["rows"])
    assert worst == pytest.approx(11.6, abs=0.05)
    assert max(abs(r["error_pct"]) for r in sweep[1]["rows"]) < worst  # the occupancy factor narrows it


def test_a_card_profiled_in_part_borrows_only_what_it_did_not_measure(tmp_path: Path) -> None:
    """`fit --fill-from`: an H100 with its own offline sweep (here the H200's sweep relabelled) keeps its fitted
    decode and prefill rates and takes the host link, exchange, executor-host and MoE rates it has no run
    for from the derived file, each listed; nothing it measured is overwritten."""
    src = fitmod.RESULTS / "2026-11-29-h200-offline.json"
    d = json.loads(src.read_text())
    d["env"]["gpu"] = "NVIDIA H100 80GB HBM3"
    (tmp_path / "h100-offline.json").write_text(json.dumps(d))
    out = tmp_path / "h100.json"
    derived = fitmod.REPO / "bench/sim/calibration/h100.json"
    assert fitmod.main(["--results", str(tmp_path), "--gpu", "H100", "--out", str(out)]) == 0
    alone = json.loads(out.read_text())
    assert alone["host_link"]["h2d_GBps"] is None and "moe_prefill" in alone["missing"]
    assert fitmod.main(["--results", str(tmp_path), "--gpu", "H100", "--fill-from", str(derived),
                        "--out", str(out)]) == 0
    cal, ref = json.loads(out.read_text()), json.loads(derived.read_text())
    assert cal["decode"] == alone["decode"] and cal["prefill"] == alone["prefill"]  # its own, kept
    taken = cal["filled_from"]["rates"]
    assert all(cal["host_link"][k] == ref["host_link"][k] for k in ("d2h_GBps", "h2d_GBps", "duplex_GBps"))
    assert cal["executor_host"]["capped_increase"] == ref["executor_host"]["capped_increase"]
    assert "host_link.h2d_GBps" in taken and "moe.expert_GBps" in taken
    assert not any(k.startswith(("decode.", "prefill.")) for k in taken)
    assert "moe_prefill" not in cal["missing"] and cal["filled_from"]["derived"] is True
    # every key the cost model needs to use the MoE prefill rates, the blend bounds included (before
    # 2026-12-07 they were left out, and the MoE prefill fell back to the dense rates: 40 % cheap on an H100)
    assert cal["moe_prefill"] == ref["moe_prefill"]
    assert all(k in cal["missing"] for k in fitmod.MISSING_ALWAYS)  # the notes stay
    with pytest.raises(SystemExit, match=r"no bench/offline\.py report"):  # no run of that card
        fitmod.main(["--results", str(tmp_path), "--gpu", "B200", "--out", str(out)])


def test_fit_refuses_a_missing_fill_from_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        fitmod.main(["--fill-from", str(tmp_path / "nope.json"), "--out", str(tmp_path / "out.json")])
    assert e.value.code == 2 and "no such calibration file" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()
