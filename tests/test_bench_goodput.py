"""bench/goodput.py: attainment counts unsent and failed requests as misses; goodput is strict (the highest
swept rate with every swept rate up to it at the target), from the mean curve over repeats; provenance
of a panel is printed and mixed commits, calls or dirty trees are flagged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.goodput import Goodput, agreement, goodput, goodput_of, load, main, mean_curve, per_repeat, strict_goodput


def _report(sent: int, scheduled: int, both: float | None, **top: object) -> dict[str, object]:
    return {
        **top,
        "workload": {"scheduled": scheduled},
        "metrics": {
            "sent": sent,
            "request_throughput_rps": 1.0,
            "ttft_ms": {"p99": 100.0},
            "tpot_ms": {"p99": 20.0},
            "slo": {"both_attainment": both},
        },
    }


def _write(d: Path, label: str, rate: float, sent: int, scheduled: int, both: float, repeat: int | None = None,
           **top: object) -> None:
    tail = "" if repeat is None else f"_k{repeat}"
    (d / f"gp_{label}_r{rate:g}{tail}.json").write_text(json.dumps(_report(sent, scheduled, both, **top)))


def test_goodput_is_strict(tmp_path: Path) -> None:
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
    assert goodput(runs["lvf-rotate"], 0.9) == 2.0  # 4 failed: 6's 92 % does not count past the dip
    assert goodput(runs["fcfs-recompute"], 1.0) == 2.0
    assert goodput_of(runs["lvf-rotate"], 0.9).text() == "2"


def test_strict_goodput_bounds() -> None:
    assert strict_goodput([(5, 0.93), (5.5, 0.58), (6, 0.82), (6.5, 0.53)], 0.9) == Goodput(5.0)  # issue 32's fcfs
    assert strict_goodput([(6, 0.97), (5, 0.95), (5.5, 0.76)], 0.9) == Goodput(5.0)  # order of input is irrelevant
    top = strict_goodput([(6, 0.99), (7, 0.95)], 0.9)
    assert top == Goodput(7.0, lower_bound=True) and top.text() == ">= 7"
    low = strict_goodput([(7, 0.88), (9, 0.95)], 0.9)
    assert low.rate == 0.0 and low.text() == "< 7"
    assert strict_goodput([(3, 0.9)], 0.9).text() == ">= 3"  # exactly the target passes


def test_repeats_mean_min_max_and_agreement(tmp_path: Path, capsys) -> None:
    """Three repeats per rate: the mean curve decides; each repeat's own goodput and the agreement count."""
    att = {2: (1.0, 1.0, 1.0), 4: (0.95, 0.85, 0.95), 6: (0.9, 0.6, 0.75)}  # 4: mean 91.7 %, repeat 1 fails
    for rate, per in att.items():
        for k, a in enumerate(per):
            _write(tmp_path, "fcfs-recompute", rate, 100, 100, a, repeat=k, git_commit="c0ffee", git_dirty=False,
                   call_id="knee-1")
    for rate, a in ((2, 1.0), (4, 1.0), (6, 0.95)):  # a second run: every repeat the same, all pass
        for k in range(3):
            _write(tmp_path, "lvf-rotate", rate, 100, 100, a, repeat=k, git_commit="c0ffee", git_dirty=False,
                   call_id="knee-1")
    runs = load(tmp_path)
    fcfs = runs["fcfs-recompute"]
    assert [(p.rate, p.repeat) for p in fcfs][:4] == [(2, 0), (2, 1), (2, 2), (4, 0)]
    c4 = mean_curve(fcfs)[1]
    assert c4.rate == 4 and c4.repeats == 3 and abs(c4.mean - 0.9167) < 1e-3 and (c4.low, c4.high) == (0.85, 0.95)
    assert goodput_of(fcfs, 0.9) == Goodput(4.0)
    assert {k: g.text() for k, g in per_repeat(fcfs, 0.9).items()} == {0: ">= 6", 1: "2", 2: "4"}
    assert agreement(fcfs, 0.9) == (1, 3)
    out = tmp_path / "g.json"
    assert main([str(tmp_path), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "91.7% [85-95]" in text and ">= 6, 2, 4 (1/3)" in text
    assert "goodput ratio lvf-rotate / fcfs-recompute: >= 1.50x" in text  # lvf's top rate passed: a lower bound
    assert "!!!" not in text and "c0ffee x18" in text and "knee-1 x18" in text
    doc = json.loads(out.read_text())
    fd, ld = doc["runs"]["fcfs-recompute"], doc["runs"]["lvf-rotate"]
    assert fd["goodput_rps"] == 4.0 and fd["repeats"] == 3 and fd["repeats_agree"] == 1
    assert fd["goodput_per_repeat"]["1"]["goodput_rps"] == 2.0 and fd["curve"][1]["low"] == 0.85
    assert ld["goodput_lower_bound"] is True and ld["goodput_text"] == ">= 6"
    assert doc["ratios"]["lvf-rotate"]["text"] == ">= 1.50x"
    assert doc["provenance"]["warnings"] == []


def test_old_names_read_as_repeat_zero(tmp_path: Path) -> None:
    _write(tmp_path, "a-b", 2, 10, 10, 1.0)
    _write(tmp_path, "a-b", 2, 10, 10, 0.5, repeat=1)
    assert [(p.rate, p.repeat) for p in load(tmp_path)["a-b"]] == [(2.0, 0), (2.0, 1)]
    assert goodput_of(load(tmp_path)["a-b"], 0.9).text() == "< 2"  # mean 75 %


def test_panel_provenance_flags(tmp_path: Path, capsys) -> None:
    """A panel merging two calls of two commits, one from a dirty tree, says so loudly."""
    a, b = _folders(tmp_path)
    _write(a, "fcfs-recompute", 2, 10, 10, 1.0, repeat=0, git_commit="a" * 40, git_dirty=False, call_id="c1")
    _write(b, "lvf-rotate", 2, 10, 10, 1.0, repeat=0, git_commit="b" * 40, git_dirty=True, call_id="c2")
    out = tmp_path / "g.json"
    assert main([f"1/2 share={a}+{b}", "--out", str(out)]) == 0
    cap = capsys.readouterr()
    assert "!!! PANEL MIXES COMMITS" in cap.out and "!!! PANEL MERGES CALLS: c1 (1 reports), c2 (1 reports)" in cap.out
    assert "!!! DIRTY TREE: 1 of 2 reports" in cap.out and "!!! 1/2 share: PANEL MIXES COMMITS" in cap.err
    assert len(json.loads(out.read_text())["provenance"]["warnings"]) == 3
    _write(tmp_path, "x-y", 1, 10, 10, 1.0)  # an old report: no commit known
    assert main([str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "!!! COMMIT UNKNOWN for 1 of 1 reports" in text and "!!! CALL UNKNOWN for 1 of 1" in text
    assert "!!! DIRTY STATE UNKNOWN for 1 of 1" in text


def test_burst_prints_realized_peak(tmp_path: Path, capsys) -> None:
    for k, peak in enumerate((6.0, 7.0)):
        report = _report(60, 60, 1.0, git_commit="c", git_dirty=False, call_id="k")
        report["workload"] = {"scheduled": 60, "arrival": "burst", "realized_rate_rps": 4.1, "realized_peak_rps": peak}
        (tmp_path / f"gp_lvf-rotate-burst_r4_k{k}.json").write_text(json.dumps(report))
    assert main([str(tmp_path), "--out", str(tmp_path / "g.json")]) == 0
    text = capsys.readouterr().out
    line = next(ln for ln in text.splitlines() if "realized peak" in ln)
    assert line.split()[-1] == "6.5"  # the mean over repeats, under the nominal 4 req/s
    curve = json.loads((tmp_path / "g.json").read_text())["runs"]["lvf-rotate-burst"]["curve"]
    assert curve[0]["realized_peak_rps"] == 6.5


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
    (b / "gp_lvf-rotate_r1.json").unlink()
    _write(b, "lvf-rotate", 1.0, 10, 10, 0.95, repeat=1)  # another repeat of the same rate: merged
    assert main([f"1/8={a}+{b}", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["runs"]["lvf-rotate"]["curve"][0]["repeats"] == 2


def test_a_run_merged_from_calls_with_other_launcher_flags_is_flagged(tmp_path: Path, capsys) -> None:
    """knee.json's "servers": one run label whose servers ran other flags in the merged folders (here the
    host pool) is flagged; the port and the step log (where, not what) and other labels' flags are not."""
    a, b = _folders(tmp_path)
    base = ["--model-path", "preset:qwen3-30b-a3b", "--schedule-policy", "lvf", "--preemption-mode", "rotate"]

    def knee(d: Path, port: int, host_gb: int, step_log: bool) -> None:
        lvf = [*base[:2], "--port", str(port), *base[2:], "--kv-host-size-gb", str(host_gb),
               *(["--step-log-interval-s", "2"] if step_log else []), "--lvf-missed-last"]
        fcfs = [*base[:2], "--port", str(port), "--schedule-policy", "fcfs", "--preemption-mode", "recompute"]
        (d / "knee.json").write_text(json.dumps({"servers": {"lvf-rotate.missed": lvf, "fcfs-recompute": fcfs}}))

    for d, rate in ((a, 3.375), (b, 4.0)):
        _write(d, "lvf-rotate.missed", rate, 150, 150, 0.95, repeat=0, git_commit="c" * 40, call_id=d.name)
        _write(d, "fcfs-recompute", rate, 150, 150, 0.5, repeat=0, git_commit="c" * 40, call_id=d.name)
    knee(a, 31000, 32, True)
    knee(b, 31005, 32, False)  # another port, no step log: the same setting
    assert load(a)["lvf-rotate.missed"][0].server == (*base, "--kv-host-size-gb", "32", "--lvf-missed-last")
    assert main([f"{a}+{b}"]) == 0
    assert "RUN SETTINGS DIFFER" not in capsys.readouterr().out
    knee(b, 31005, 64, False)
    out = tmp_path / "g.json"
    assert main([f"{a}+{b}", "--out", str(out)]) == 0
    o = capsys.readouterr()
    want = "RUN SETTINGS DIFFER for lvf-rotate.missed: --kv-host-size-gb 32 (1 reports) / 64 (1 reports)"
    assert f"!!! {want}" in o.out and want in o.err and "for fcfs-recompute" not in o.out
    assert want in json.loads(out.read_text())["provenance"]["warnings"]


def test_an_unreadable_knee_json_loses_no_report(tmp_path: Path, capsys) -> None:
    """knee.json is provenance only: a broken one (a call killed mid-write) is named and skipped; the
    folder's reports still make the panel."""
    _write(tmp_path, "lvf-rotate", 2.0, 10, 10, 1.0)
    for text in ("{ truncated", json.dumps({"servers": ["--port", "1"]})):
        (tmp_path / "knee.json").write_text(text)
        assert main([str(tmp_path)]) == 0
        o = capsys.readouterr()
        assert "knee.json unreadable" in o.err and "its runs' launcher flags are not compared" in o.err
        assert load(tmp_path)["lvf-rotate"][0].server is None


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


def test_ratio_is_one_sided_when_one_curve_fails_every_swept_rate() -> None:
    """fcfs failing its lowest rate (5) while lvf holds 5.5 says lvf / fcfs > 1.10, not "n/a"."""
    from bench.goodput import ratio_text

    r, text = ratio_text(Goodput(5.5), Goodput(0.0, below_lowest=5.0))
    assert r == pytest.approx(1.1) and text.startswith("> 1.10x")
    r, text = ratio_text(Goodput(0.0, below_lowest=4.0), Goodput(5.0))
    assert r == pytest.approx(0.8) and text.startswith("< 0.80x")
    assert ratio_text(Goodput(0.0, below_lowest=4.0), Goodput(0.0, below_lowest=4.0))[0] is None


def test_a_mean_exactly_at_the_target_passes_in_any_summing_order() -> None:
    """131, 139 and 135 of 150 requests are 405 of 450, 90 % exactly; summed as floats in some orders the
    mean lands a hair under 0.9 (session 14's lvf point read "passes" in one tool and "fails" in another)."""
    from bench import goodput_knee as K
    fracs = [131 / 150, 139 / 150, 135 / 150]
    means = {sum(p) / 3 for p in ((fracs[0], fracs[1], fracs[2]), (fracs[2], fracs[0], fracs[1]),
                                  (fracs[1], fracs[2], fracs[0]))}
    for m in means:
        assert strict_goodput([(3.0, 0.95), (3.1875, m)], 0.9).rate == 3.1875
        assert K.bracket({3.0: 0.95, 3.1875: m}, 0.9) == (3.1875, None)
    assert strict_goodput([(3.0, 0.95), (3.1875, 0.8999)], 0.9).rate == 3.0  # a real miss still fails
