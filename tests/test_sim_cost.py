"""bench/sim: the cost model's fit recovers known rates, the H200 calibration predicts the measured step
times, missing measurements stay null with a reason, and the MoE expected-experts formula."""

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
    for key in ("decode.moe", "host_link.c2c", "prefill.mixed_batches", "executor_host.capped_two_gpu"):
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
