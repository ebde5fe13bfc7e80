"""bench/goodput.py: attainment counts unsent and failed requests as misses, and goodput is the highest
swept rate at which at least the target share met both SLOs."""

from __future__ import annotations

import json
from pathlib import Path

from bench.goodput import goodput, load, main


def _report(sent: int, scheduled: int, both: float | None) -> dict[str, object]:
    return {
        "workload": {"scheduled": scheduled},
        "metrics": {
            "sent": sent,
            "request_throughput_rps": 1.0,
            "ttft_ms": {"p99": 100.0},
            "tpot_ms": {"p99": 20.0},
            "slo": {"both_attainment": both},
        },
    }


def _write(d: Path, label: str, rate: float, sent: int, scheduled: int, both: float) -> None:
    (d / f"gp_{label}_r{rate:g}.json").write_text(json.dumps(_report(sent, scheduled, both)))


def test_goodput_is_highest_rate_meeting_target(tmp_path: Path) -> None:
    _write(tmp_path, "fcfs-recompute", 2, 60, 60, 1.0)
    _write(tmp_path, "fcfs-recompute", 4, 120, 120, 0.95)
    _write(tmp_path, "fcfs-recompute", 6, 180, 180, 0.5)
    _write(tmp_path, "lvf-rotate", 2, 60, 60, 1.0)
    _write(tmp_path, "lvf-rotate", 4, 100, 120, 1.0)  # 20 never sent: 100 of 120 = 83 %
    _write(tmp_path, "lvf-rotate", 6, 180, 180, 0.92)
    runs = load(tmp_path)
    assert sorted(runs) == ["fcfs-recompute", "lvf-rotate"]
    assert [p.rate for p in runs["lvf-rotate"]] == [2.0, 4.0, 6.0]
    assert abs(runs["lvf-rotate"][1].attainment - 100 / 120) < 1e-9
    assert goodput(runs["fcfs-recompute"], 0.9) == 4.0
    assert goodput(runs["lvf-rotate"], 0.9) == 6.0  # the highest rate, even past a dip
    assert goodput(runs["fcfs-recompute"], 1.0) == 2.0


def test_cli_writes_table_plot_and_json(tmp_path: Path, capsys) -> None:
    _write(tmp_path, "a-b", 1.5, 10, 10, 0.8)
    out, png = tmp_path / "g.json", tmp_path / "g.png"
    assert main([str(tmp_path), "--out", str(out), "--plot", str(png)]) == 0
    assert "a-b" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["runs"]["a-b"]["goodput_rps"] == 0.0 and doc["runs"]["a-b"]["points"][0]["attainment"] == 0.8
    assert png.stat().st_size > 0


def test_cli_empty_folder_is_an_error(tmp_path: Path) -> None:
    assert main([str(tmp_path)]) == 2


def _folders(tmp_path: Path) -> tuple[Path, Path]:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    return a, b


def test_cli_several_settings_one_panel_each(tmp_path: Path, capsys) -> None:
    a, b = _folders(tmp_path)
    _write(a, "fcfs-recompute", 2.0, 10, 10, 1.0)
    _write(b, "fcfs-recompute", 4.0, 10, 10, 0.5)
    out, png = tmp_path / "g.json", tmp_path / "g.png"
    assert main([f"1/4 share={a}", f"1/2 share={b}", "--out", str(out), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "== 1/4 share" in text and "== 1/2 share" in text
    doc = json.loads(out.read_text())["settings"]
    assert doc["1/4 share"]["fcfs-recompute"]["goodput_rps"] == 2.0
    assert doc["1/2 share"]["fcfs-recompute"]["goodput_rps"] == 0.0
    assert png.stat().st_size > 0
    assert main([f"x={tmp_path / 'none'}"]) == 2


def test_a_setting_swept_over_two_calls(tmp_path: Path, capsys) -> None:
    a, b = _folders(tmp_path)
    _write(a, "lvf-rotate", 1.0, 10, 10, 1.0)
    _write(b, "lvf-rotate", 2.5, 10, 10, 0.5)
    _write(b, "lvf-rotate", 2.0, 10, 10, 0.9)
    out = tmp_path / "g.json"
    assert main([f"1/8={a}+{b}", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())["runs"]["lvf-rotate"]
    assert [p["rate"] for p in doc["points"]] == [1.0, 2.0, 2.5] and doc["goodput_rps"] == 2.0
    _write(b, "lvf-rotate", 1.0, 10, 10, 0.2)  # the same run and rate in both: which one counts is unclear
    assert main([f"1/8={a}+{b}"]) == 2
    assert "in two of the folders" in capsys.readouterr().err


def test_one_model_of_a_multi_model_run(tmp_path: Path, capsys) -> None:
    """--model: that model's attainment (weaver_e2e.sh's hot model), unsent requests counted as its misses."""
    def per(sent: int, both: float) -> dict[str, object]:
        return {"sent": sent, "request_throughput_rps": 1.0, "ttft_ms": {"p99": 1.0}, "tpot_ms": {"p99": 1.0},
                "slo": {"both_attainment": both}}

    for rate, hot, cold in ((4, 1.0, 1.0), (8, 0.8, 1.0)):
        report = {**_report(20, 21, 0.9), "workload": {"scheduled": 21, "not_sent": 1},
                  "per_model": {"hot": per(18, hot), "cold": per(2, cold)}}
        (tmp_path / f"gp_weaver-fixed_r{rate}.json").write_text(json.dumps(report))
    only_hot = {**_report(5, 5, 1.0), "workload": {"scheduled": 5, "not_sent": 0}, "per_model": {"hot": per(5, 1.0)}}
    (tmp_path / "gp_weaver-fixed_r1.json").write_text(json.dumps(only_hot))
    assert [p.rate for p in load(tmp_path, "cold")["weaver-fixed"]] == [4, 8]  # no cold request at 1 req/s
    hot = load(tmp_path, "hot")["weaver-fixed"][1:]
    assert [p.scheduled for p in hot] == [19, 19] and [p.both_met for p in hot] == [18, 14]
    assert goodput(hot, 0.9) == 4.0
    assert goodput(load(tmp_path, "cold")["weaver-fixed"], 0.9) == 0.0  # 2 of 3 (the unsent one counts)
    assert main([str(tmp_path), "--model", "warm"]) == 2
    assert "of model 'warm'" in capsys.readouterr().err


def test_runs_scored_against_other_slos(tmp_path: Path, capsys) -> None:
    """--ttft-slo / --tpot-slo: the reports' per-request records scored anew (one sweep, two SLO settings)."""
    records = [["m", True, 1.0, 0.05, 0.1, 0.2], ["m", True, 3.0, 0.05, 0.1, 0.2], ["m", True, 4.0, 0.2, 0.3, 0.4],
               ["m", False, None, None, None, None]]
    report = {**_report(4, 5, 0.5), "slo_records": records}
    (tmp_path / "gp_lvf-rotate_r6.json").write_text(json.dumps(report))
    assert main([str(tmp_path), "--ttft-slo", "5", "--tpot-slo", "0.1", "--out", str(tmp_path / "a.json")]) == 0
    point = json.loads((tmp_path / "a.json").read_text())["runs"]["lvf-rotate"]["points"][0]
    assert (point["both_met"], point["scheduled"]) == (2, 5)  # the unsent fifth counts as a miss
    assert main([str(tmp_path), "--ttft-slo", "2", "--tpot-slo", "0.1", "--out", str(tmp_path / "b.json")]) == 0
    assert json.loads((tmp_path / "b.json").read_text())["runs"]["lvf-rotate"]["points"][0]["both_met"] == 1
    assert main([str(tmp_path), "--tpot-slo", "0.25", "--tbt-stat", "max", "--out", str(tmp_path / "c.json")]) == 0
    assert json.loads((tmp_path / "c.json").read_text())["runs"]["lvf-rotate"]["points"][0]["both_met"] == 2
    (tmp_path / "gp_old_r6.json").write_text(json.dumps(_report(4, 4, 1.0)))  # before slo_records
    assert main([str(tmp_path), "--ttft-slo", "2"]) == 2
    assert "no slo_records" in capsys.readouterr().err
