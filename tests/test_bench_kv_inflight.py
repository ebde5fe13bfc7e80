"""bench/kv_inflight.py: the KV a point's requests held, rebuilt from a saved report's rows and its
per-request TTFT / TPOT, against the pool the server logged."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import kv_inflight as K

PANEL = Path(__file__).resolve().parent.parent / "bench/results/2026-12-06-h100-s4/qwen3-kvbind-tpot02"


def test_one_request_grows_from_its_prompt_by_one_token_per_tpot(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = type("Spec", (), {"arrival_s": 1.0, "input_len": 100, "output_len": 11})()
    monkeypatch.setattr(K, "build_requests", lambda cfg: ([spec], {}))
    monkeypatch.setattr("bench.sim.replay_sweeps.serving_config", lambda config: None)
    mean, peak = K.inflight({"config": {}, "slo_records": [[None, True, 0.5, 0.1, 0.1, 0.1]]}, step_s=0.01)
    # first token at 1.5 s with 101 tokens held, the last (11th) at 2.5 s with 111
    assert peak == pytest.approx(111, abs=0.2) and mean == pytest.approx(106, abs=0.5)


def test_a_saved_panel_reads_with_its_logged_pool() -> None:
    pts = K.folder_points(PANEL)
    assert len(pts) == 18 and {p.pool_tokens for p in pts} == {150_320}  # (9,396 - 1) x 16
    fcfs3 = [p for p in pts if p.run == "fcfs-recompute" and p.rate == 3]
    fcfs225 = [p for p in pts if p.run == "fcfs-recompute" and p.rate == 2.25]
    assert len(fcfs3) == 3 and min(p.mean_tokens for p in fcfs3) > max(p.mean_tokens for p in fcfs225)
    assert all(0 < p.mean_tokens < p.peak_tokens for p in pts)
    rep = json.loads((PANEL / "gp_lvf-rotate_r3_k1.json").read_text())
    assert K.inflight(rep)[1] == max(p.peak_tokens for p in pts if p.run == "lvf-rotate" and p.rate == 3)


def test_a_folder_without_reports_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "gp_fcfs-recompute_r3_k0.json").write_text(json.dumps({"config": {}}))  # no slo_records
    assert K.main([str(tmp_path)]) == 1 and "no goodput reports with slo_records" in capsys.readouterr().err
