"""A server's expert distribution record prices a trained router's skew in the simulator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.sim.cost import CostModel
from bench.sim.expert_load import pick_probabilities, with_record
from bench.sim.fleet import load_geometry
from bench.sim.geometry import Geometry, skewed_experts_hit
from bench.sim.plan import read_models

QWEN3 = Geometry.preset("qwen3-30b-a3b")  # 48 sparse layers x 128 experts, top 8


def _record(path: Path, rows: list[list[int]], top_k: int = 8) -> Path:
    path.write_text(json.dumps({"logical_count": rows, "top_k": top_k, "num_experts": len(rows[0]),
                                "layers": list(range(len(rows))), "model": "qwen3-30b-a3b", "worker": "w-0"}))
    return path


def test_a_uniform_record_prices_as_uniform_routing(tmp_path: Path) -> None:
    rec = _record(tmp_path / "u.json", [[100] * 128] * 48)  # 1,600 tokens x 8 picks spread evenly
    geo = with_record(QWEN3, rec)
    assert all(sum(q) == pytest.approx(8.0) for q in geo.expert_pick)
    for rows in (1, 12, 64):
        assert geo.experts_hit(rows) == pytest.approx(QWEN3.experts_hit(rows), rel=1e-9)


def test_a_skewed_router_hits_fewer_experts_and_its_step_is_cheaper(tmp_path: Path) -> None:
    # half of every token's picks go to 8 hot experts, the other half spread over the other 120
    hot = [1000] * 8 + [round(8000 / 120)] * 120
    geo = with_record(QWEN3, _record(tmp_path / "s.json", [hot] * 48))
    q = geo.expert_pick[0]
    assert q[0] == pytest.approx(1000 / (sum(hot) / 8))
    assert skewed_experts_hit(q, 1) == pytest.approx(8.0)  # one token still reads its k experts
    assert geo.experts_hit(12) < QWEN3.experts_hit(12) - 10  # 12 rows: ~52 distinct instead of 69
    assert geo.experts_hit(4096) == pytest.approx(128.0, abs=1e-6)  # a long prefill reads them all
    uniform = CostModel.load(None, "qwen3-30b-a3b")
    skew = CostModel(uniform.cal, geo)
    assert skew.decode_s(12, 12 * 1024) < uniform.decode_s(12, 12 * 1024)
    assert skew.decode_s(1, 1024) == pytest.approx(uniform.decode_s(1, 1024), rel=1e-9)


def test_records_that_do_not_fit_the_model_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such file"):
        with_record(QWEN3, tmp_path / "missing.json")
    with pytest.raises(ValueError, match="48 x 128"):
        with_record(QWEN3, _record(tmp_path / "a.json", [[1] * 128] * 47))
    with pytest.raises(ValueError, match="top_k"):
        with_record(QWEN3, _record(tmp_path / "b.json", [[1] * 128] * 48, top_k=2))
    with pytest.raises(ValueError, match="no MoE layers"):
        with_record(Geometry.preset("llama-3-8b"), _record(tmp_path / "c.json", [[1] * 128] * 48))
    with pytest.raises(ValueError, match="counted no token"):
        pick_probabilities({"logical_count": [[0] * 8], "top_k": 2})
    (tmp_path / "d.json").write_text("{}")
    with pytest.raises(ValueError, match="not an expert distribution record"):
        with_record(QWEN3, tmp_path / "d.json")
    # given the .pt of a dump, the .json beside it is read
    _record(tmp_path / "e.json", [[3] * 128] * 48)
    assert with_record(QWEN3, tmp_path / "e.pt").expert_pick


def test_the_plan_model_list_takes_a_record_relative_to_itself(tmp_path: Path) -> None:
    _record(tmp_path / "rec.json", [[1000] * 8 + [67] * 120] * 48)
    (tmp_path / "models.yaml").write_text(
        "models:\n  - {name: r, model: qwen3-30b-a3b, rate: 1.0, expert_distribution: rec.json}\n"
        "  - {name: d, model: llama-3-8b, rate: 1.0}\n")
    specs = read_models(tmp_path / "models.yaml", "yaml", None)
    assert specs[0].expert_distribution == str(tmp_path / "rec.json") and specs[1].expert_distribution is None
    geo = load_geometry(specs[0].model, specs[0].expert_distribution)
    assert geo.expert_pick and geo.experts_hit(12) < QWEN3.experts_hit(12)
